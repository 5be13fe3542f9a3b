"""torchrun worker: ramp-up and token-budget windows on 2 CPU processes (gloo) whose ranks hold very different
token counts. Rank 0 writes, per setting, the audited gradient errors, the windows, the LRs and the number of
gradient all-reduce rounds (a DDP comm hook): one per update, whatever the window's length.

Run as ``torchrun --nproc_per_node 2 tests/distributed/loop_windows_ddp_worker.py OUT.json``.
"""

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import sys

import torch.distributed as dist

from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, run_exact, tiny_causal_lm
from hf_accum.testing.cases.loop_ddp_case import EXAMPLES, AllReduceCounter

SETTINGS = {
    # 28 rows, micro-batch 2 -> 7 micro-batches per rank; global batch 2 x 2 x 3 = 12, ramp from 4 by 4.
    "rampup": {"rampup_batch_size": [4, 4, 16]},
    "tokens": {"tokens_per_update": 120},
}


def scenario(loop_kwargs: dict) -> Scenario:
    return Scenario("ddp_windows", tiny_causal_lm, EXAMPLES, PaddingCollator(PAD), micro_batch=2, accumulation=3,
                    epochs=2, scheduler="linear", warmup_steps=1, loop_kwargs=loop_kwargs)


def main(out_path: str) -> None:
    report = {}
    for name, loop_kwargs in SETTINGS.items():
        counter = AllReduceCounter()
        result, exact = run_exact(scenario(loop_kwargs), on_model=counter.attach)
        report[name] = {
            "updates": len(result.updates),
            "errors": [r.relative_error for r in exact.records],
            "sequences": [u.sequences for u in result.updates],
            "targets": [u.targets for u in result.updates],
            "micro_batches": [u.micro_batches for u in result.updates],
            "learning_rates": [u.learning_rate for u in result.updates],
            "allreduce_rounds": counter.rounds,
        }
    report["world_size"] = dist.get_world_size()  # the process group exists once an Accelerator was built
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
