"""torchrun worker: the loop on 2 CPU processes (gloo) whose ranks hold very different token counts.

Run as ``torchrun --nproc_per_node 2 tests/distributed/loop_ddp_worker.py OUT.json``; rank 0 writes the world
size it really got, the audited gradient errors of the exact and naive loops, the LRs, and the
number of gradient all-reduce rounds counted by a DDP comm hook.
"""

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import sys

import torch.distributed as dist

from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, run_exact, run_naive, tiny_causal_lm
from hf_accum.testing.cases.loop_ddp_case import EXAMPLES, AllReduceCounter


def scenario() -> Scenario:
    return Scenario("ddp", tiny_causal_lm, EXAMPLES, PaddingCollator(PAD), micro_batch=2, accumulation=3,
                    epochs=2, scheduler="linear", warmup_steps=1)


def uneven_ranks_refusal() -> str:
    """26 rows with even_batches=False: 7 micro-batches on rank 0, 6 on rank 1. Without the check,
    rank 0's last window would wait forever in an all-reduce rank 1 never joins."""
    from accelerate import DataLoaderConfiguration

    uneven = Scenario("uneven", tiny_causal_lm, EXAMPLES[:26], PaddingCollator(PAD), micro_batch=2, accumulation=3,
                      accelerator_kwargs={"dataloader_config": DataLoaderConfiguration(even_batches=False)})
    try:
        run_exact(uneven)
    except ValueError as error:
        return str(error)
    return ""


def main(out_path: str) -> None:
    counter = AllReduceCounter()
    result, exact = run_exact(scenario(), on_model=counter.attach)
    naive = run_naive(scenario())
    report = {
        "world_size": dist.get_world_size(),
        "updates": len(result.updates),
        "targets_per_update": [u.targets for u in result.updates],
        "exact_errors": [r.relative_error for r in exact.records],
        "naive_errors": [r.relative_error for r in naive.records],
        "learning_rates": [r.learning_rate for r in exact.records],
        "allreduce_rounds": counter.rounds,
        "uneven_ranks_error": uneven_ranks_refusal(),
    }
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
