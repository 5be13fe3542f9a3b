"""torchrun worker: the auto batch ramp on 2 CPU processes (gloo) whose ranks hold very different token counts.

Run as ``torchrun --nproc_per_node 2 tests/rampup_auto_ddp_worker.py OUT.json``; rank 0 writes the audited gradient
errors, every update's sequences and batch change as each rank saw them (all ranks must decide the same), the
LRs and the number of gradient all-reduce rounds (one per update, whatever the window).
"""

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import sys

import torch.distributed as dist

from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, tiny_causal_lm
from hf_accum.testing.cases.loop_ddp_case import AllReduceCounter

# 64 rows, micro-batch 2 -> 16 micro-batches per rank and epoch; K up to 8: global batch 32, start 2 x 2 x 2 = 8.
# Accelerate hands micro-batch j to rank j % 2: long rows (pairs 4m, 4m+1) on rank 0, short ones on rank 1.
EXAMPLES = random_rows(64, seed=21, min_len=3, max_len=40, long_rows=lambda i: (i // 2) % 2 == 0)
EAGER = {"margin": 0.5, "release": 0.25, "patience": 2, "min_updates": 2, "lr_rule": "sqrt"}


def main(out_path: str) -> None:
    counter = AllReduceCounter()
    scenario = Scenario("auto_ddp", tiny_causal_lm, EXAMPLES, PaddingCollator(PAD), micro_batch=2, accumulation=8,
                        epochs=2, scheduler="linear",
                        loop_kwargs={"rampup_batch_size": "auto", "warmup_ratio": 0.1, "rampup_auto": EAGER})
    result, exact = run_exact(scenario, on_model=counter.attach)
    seen = [(u.sequences, u.batch_change, u.learning_rate) for u in result.updates]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, seen)
    report = {
        "world_size": dist.get_world_size(),
        "updates": len(result.updates),
        "errors": [r.relative_error for r in exact.records],
        "sequences": [u.sequences for u in result.updates],
        "changes": [u.batch_change for u in result.updates],
        "ranks_agree": all(other == every_rank[0] for other in every_rank),
        "allreduce_rounds": counter.rounds,
    }
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
