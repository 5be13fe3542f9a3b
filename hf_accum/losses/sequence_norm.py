"""Per-sequence normalization: an update's loss is the mean over its sequences of each sequence's mean token
loss (SFT where long answers should not dominate), exact across micro-batches, ranks and packed rows.

It is a loss *weighting*, not a second scaling path. Each target ``t`` gets the weight ``w_t = 1 / n_s(t)``
(``n_s`` the targets of its sequence ``s``), a micro-batch's loss is ``sum_t w_t * loss_t`` and its "count" is
the number of sequences with at least one target. The one normalization owner then divides the update's sum by
its count, unchanged (``exact_mean_factor(N_sequences, W)``)::

    (1 / S) * sum_s (1 / n_s) * sum_{t in s} loss_t      S = sequences with >= 1 target, all micro-batches, ranks

A sequence never spans two micro-batches, so ``n_s`` is known inside the micro-batch that holds it. A row is a
sequence; a padding-free packed row (``position_ids`` restarting, :class:`hf_accum.batching.PackingCollator`)
holds one sequence per restart of its positions (wherever they do not increase). Causal LMs only (a target at
position ``i + 1`` is predicted from ``i``).

The fused loss takes the weights per target row (:func:`hf_accum.fused.loss.linear_cross_entropy_sum`), so sequence
mode keeps the fused path where token mode has it (:class:`hf_accum.losses.micro_batch.MicroBatchLoss` computes the
weights and the count); :class:`SequenceMeanLoss` is the logits path's loss (evaluation, DeepSpeed, heads not fused).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from hf_accum.accumulation import packed_sequence_starts
from hf_accum.losses.token_loss import IGNORE_INDEX, aligned_targets, compute_dtype

# The setting's values and check are declared with the setting (hf_accum.settings); re-exported for this module's users.


def refuse_custom_loss(normalization: str, custom: str | None, where: str,
                       error: type[Exception] = ValueError) -> None:
    """Sequence mode weighs the built-in loss per target; ``custom`` (a description of the user's own loss,
    None when there is none) would have to weigh itself, so the combination is refused, naming ``where``."""
    if normalization == "sequence" and custom:
        raise error(f"{where}='sequence' weighs the built-in loss per sequence; {custom} must do its own weighting: "
                    "pass normalization='token'")


def target_segments(labels: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, segment)``, both ``[rows, positions]`` and aligned with the logits: the label each position
    predicts (-100: none) and a micro-batch-wide id of the sequence that label belongs to."""
    rows, length = labels.shape
    if position_ids is not None and position_ids.shape == labels.shape:
        # A new sequence wherever a packed row restarts its positions; a row's first position always starts one.
        local = packed_sequence_starts(position_ids.to(labels.device)).long().cumsum(dim=1)
    else:
        local = torch.ones_like(labels)
    segment = torch.arange(rows, device=labels.device).unsqueeze(1) * (length + 1) + local
    # The logit at position i predicts the label at i + 1: it belongs to that label's sequence.
    segment = torch.cat([segment[:, 1:], segment[:, -1:]], dim=1)
    return aligned_targets(labels, "causal_lm"), segment


def sequence_weights(labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, sequences)``: per-position weights ``1 / n_s`` (0 where nothing is predicted) and the number of
    sequences with at least one target (an int64 tensor: no host sync)."""
    targets, segment = target_segments(labels, position_ids)
    is_target = targets.ne(IGNORE_INDEX)
    # Segment ids are below rows * (positions + 1) (target_segments): count targets per id directly, with no
    # data-dependent size (torch.unique, .item()) that would sync the host on every micro-batch.
    counts = torch.zeros(labels.shape[0] * (labels.shape[1] + 1), dtype=torch.long, device=labels.device)
    counts.index_add_(0, segment.reshape(-1), is_target.reshape(-1).long())
    weights = torch.where(is_target, 1.0 / counts[segment].clamp(min=1).to(dtype),
                          torch.zeros((), dtype=dtype, device=labels.device))
    return weights, counts.gt(0).sum()


def count_sequences(batch: Mapping[str, Any]) -> torch.Tensor:
    """The count a sequence-normalized micro-batch reports: its sequences with at least one target."""
    return sequence_weights(batch["labels"], batch.get("position_ids"))[1]


def sequence_loss_sum(logits: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                      label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_t w_t * loss_t, sequences)`` of one micro-batch (the front-ends divide by the update's count)."""
    dtype = compute_dtype(logits.dtype)
    labels = labels.to(logits.device)
    weights, sequences = sequence_weights(labels, position_ids, dtype)
    targets = aligned_targets(labels, "causal_lm")
    per_token = F.cross_entropy(logits.to(dtype).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="none", label_smoothing=label_smoothing)
    return (per_token * weights.reshape(-1)).sum(), sequences


class SequenceMeanLoss:
    """A ``loss_sum_fn(outputs, labels, inputs)`` (both front-ends' logits path) in sequence mode."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        self.label_smoothing = label_smoothing

    def __call__(self, outputs: Any, labels: torch.Tensor,
                 inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return sequence_loss_sum(outputs.logits, labels, inputs.get("position_ids"), self.label_smoothing)
