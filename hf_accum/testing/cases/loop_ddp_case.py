"""The data and the all-reduce counter of the loop DDP family's jobs (tests/distributed/loop_ddp_worker.py): ranks
with very different token counts."""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hf_accum.testing import random_rows

# 28 rows, micro-batch 2 -> 14 micro-batches, 7 per rank -> windows of 3, 3 and a short 1.
# Accelerate hands micro-batch j to rank j % 2, so rows 4m, 4m+1 (long) land on rank 0 and
# rows 4m+2, 4m+3 (3-5 tokens) on rank 1.
EXAMPLES = random_rows(28, seed=21, min_len=3, max_len=40, long_rows=lambda i: (i // 2) % 2 == 0)


class AllReduceCounter:
    """DDP comm hook: plain all-reduce (DDP's default), counting rounds (last bucket of a backward)."""

    def __init__(self) -> None:
        self.rounds = 0

    def attach(self, ddp_model: DistributedDataParallel) -> None:
        ddp_model.register_comm_hook(None, self.hook)

    # No annotations: DDP's register_comm_hook compares the annotation of ``bucket`` with dist.GradBucket, and
    # under ``from __future__ import annotations`` it would see a string and refuse the hook.
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        if bucket.is_last():
            self.rounds += 1
        # None: the default group, as torch's code takes it (its annotation says ProcessGroup only)
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
