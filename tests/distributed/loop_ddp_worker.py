"""torchrun worker: the loop on 2 CPU processes (gloo) whose ranks hold very different token counts.

Run as ``torchrun --nproc_per_node 2 tests/loop_ddp_worker.py OUT.json``; rank 0 writes the world
size it really got, the audited gradient errors of the exact and naive loops, the LRs, and the
number of gradient all-reduce rounds counted by a DDP comm hook.
"""

import json
import sys

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_naive, tiny_causal_lm

# 28 rows, micro-batch 2 -> 14 micro-batches, 7 per rank -> windows of 3, 3 and a short 1.
# Accelerate hands micro-batch j to rank j % 2, so rows 4m, 4m+1 (long) land on rank 0 and
# rows 4m+2, 4m+3 (3-5 tokens) on rank 1.
EXAMPLES = random_rows(28, seed=21, min_len=3, max_len=40, long_rows=lambda i: (i // 2) % 2 == 0)


def scenario() -> Scenario:
    return Scenario("ddp", tiny_causal_lm, EXAMPLES, PaddingCollator(PAD), micro_batch=2, accumulation=3,
                    epochs=2, scheduler="linear", warmup_steps=1)


class AllReduceCounter:
    """DDP comm hook: plain all-reduce (DDP's default), counting rounds (last bucket of a backward)."""

    def __init__(self):
        self.rounds = 0

    def attach(self, ddp_model):
        ddp_model.register_comm_hook(None, self.hook)

    def hook(self, state, bucket):
        if bucket.is_last():
            self.rounds += 1
        return default_hooks.allreduce_hook(None, bucket)


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
