"""AccumTrainer's held-out loss: the mean over every target of the evaluation set (all batches, all ranks),
like the training loss -- not stock Trainer's mean of per-batch means weighted by rows."""

from __future__ import annotations

from typing import Any

import torch


def without_repeated_eval_rows(accelerator: Any, labels: torch.Tensor) -> torch.Tensor:
    """``labels`` with the rows Accelerate repeated to even out the ranks masked (-100).

    A sharded evaluation set that does not fill ``batch x ranks`` gets its last step filled with
    examples from its start (``even_batches``), so every rank runs as many batches. Stock
    ``gather_for_metrics`` cuts them off the gathered tensors: the real rows of that step are the
    first ``remainder`` of the rank-major concatenation. The exact eval_loss sums targets rank by
    rank, so it leaves them out the same way here, or they would count twice."""
    state = accelerator.gradient_state
    world, rows = accelerator.num_processes, labels.shape[0]
    if world < 2 or not state.end_of_dataloader or state.remainder is None or state.remainder <= 0:
        return labels
    from accelerate.data_loader import DataLoaderShard

    loader = state.active_dataloader
    if not isinstance(loader, DataLoaderShard) or getattr(loader, "total_batch_size", None) != rows * world:
        return labels  # not the even_batches layout (packed rows, a dispatched iterable): left as it is
    real = min(rows, max(0, state.remainder - accelerator.process_index * rows))
    if real == rows:
        return labels
    labels = labels.clone()
    labels[real:] = -100
    return labels
