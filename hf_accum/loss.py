"""Token-summed losses: ``(loss_sum, n_targets)`` for one micro-batch, computed from logits.

This module owns *what a prediction target is* and *how a micro-batch's loss is summed*.
It never divides by anything: turning sums into the exact mean of an optimizer update is
the job of :mod:`hf_accum.accumulation`, which needs the target count of the whole window
(all micro-batches, all ranks) and therefore cannot be decided inside one micro-batch.

Why we recompute the loss from logits instead of using ``outputs.loss``: a model's own
loss divides by *its* count (a per-micro-batch mean), and whether it honours
``num_items_in_batch`` depends on the head (sequence-classification heads accept the
keyword and ignore it). Summing ourselves makes every head exact the same way.

Loss kinds:

* ``causal_lm`` -- logits ``[B, T, V]``, labels ``[B, T]``; the target of position ``i`` is
  ``labels[:, i + 1]`` (the causal shift), so position 0 of a row is never a target.
* ``token`` -- logits ``[B, T, C]``, labels ``[B, T]`` aligned with the logits (token
  classification, encoder-decoder LMs whose decoder inputs are already shifted).
* ``sequence`` -- logits ``[B, C]`` of a sequence-classification head, with transformers' three
  problem types (same inference as ``ForSequenceClassificationLoss``: ``C == 1`` is regression,
  integer labels are single-label, float labels multi-label; ``config.problem_type`` wins):
  single-label cross-entropy (a target per labelled row), multi-label binary cross-entropy and
  regression squared error (a target per label *element*, as transformers' mean counts them).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
LossKind = Literal["causal_lm", "token", "sequence"]
LOSS_KINDS: tuple[str, ...] = ("causal_lm", "token", "sequence")
PROBLEM_TYPES: tuple[str, ...] = ("single_label_classification", "multi_label_classification", "regression")

# Bytes of loss-dtype (fp32) logits processed at a time. Above this, the cross-entropy runs chunk
# by chunk under activation checkpointing: neither the fp32 upcast of bf16 logits nor the
# log-softmax that cross_entropy saves for backward (each V x 4 bytes per position: 0.5 MB per
# token at a 128k vocabulary) ever exists for the whole micro-batch, only for one chunk. Sized
# in bytes, not rows, so one chunk stays the same size whatever the vocabulary.
DEFAULT_CHUNK_BYTES = 256 * 2**20


def infer_loss_kind(model: torch.nn.Module) -> LossKind:
    """Tell which target layout a model's head uses, from its class (PEFT/DDP wrappers removed).

    Raises ``ValueError`` for heads we cannot place: pass ``loss_kind`` explicitly then.
    """
    inner = unwrap_model(model)
    config = getattr(inner, "config", None)
    name = type(inner).__name__
    if getattr(config, "is_encoder_decoder", False):
        # Seq2seq LMs feed right-shifted decoder inputs: labels already align with logits.
        return "token"
    if name.endswith(("ForCausalLM", "LMHeadModel")) or (
        name.endswith("ForConditionalGeneration") and not getattr(config, "is_encoder_decoder", False)
    ):
        return "causal_lm"
    if name.endswith("ForSequenceClassification"):
        return "sequence"
    if name.endswith("ForTokenClassification"):
        return "token"
    raise ValueError(
        f"cannot tell the loss layout of {name!r}; pass loss_kind= one of {LOSS_KINDS} "
        "('causal_lm' shifts labels by one, 'token' aligns them with logits, 'sequence' has one label per row)"
    )


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP/FSDP (``.module``), torch.compile (``._orig_mod``) and PEFT (``.base_model.model``)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__.startswith("Peft") and hasattr(model, "base_model"):
            model = model.base_model.model if hasattr(model.base_model, "model") else model.base_model
    return model


def aligned_targets(labels: torch.Tensor, kind: LossKind = "causal_lm") -> torch.Tensor:
    """Labels aligned with the logit positions that predict them (-100 where nothing is predicted).

    For ``causal_lm`` the logit at position ``i`` predicts ``labels[:, i + 1]``; the last
    logit predicts nothing, so it gets ``IGNORE_INDEX``. Keeping the tensor the size of the
    logits (instead of slicing the logits) avoids a copy of the logits.
    """
    if kind == "causal_lm":
        return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    if kind in ("token", "sequence"):
        return labels
    raise ValueError(f"loss_kind={kind!r} is not one of {LOSS_KINDS}")


def count_targets(labels: torch.Tensor, kind: LossKind = "causal_lm") -> torch.Tensor:
    """Number of prediction targets in a micro-batch (after the causal shift), as an int64 tensor."""
    if kind == "causal_lm":
        return labels[..., 1:].ne(IGNORE_INDEX).sum()
    if kind == "sequence" and labels.is_floating_point():
        # Regression and multi-label: every label element is a target (transformers' mean counts them all).
        return torch.tensor(labels.numel(), device=labels.device)
    return aligned_targets(labels, kind).ne(IGNORE_INDEX).sum()


def sequence_problem_type(num_labels: int, labels: torch.Tensor, problem_type: str | None = None) -> str:
    """transformers' rule (``ForSequenceClassificationLoss``): the config's problem_type, else
    regression for one output, single-label for integer labels, multi-label for float labels."""
    if problem_type is not None:
        if problem_type not in PROBLEM_TYPES:
            raise ValueError(f"problem_type={problem_type!r}; allowed: {PROBLEM_TYPES}")
        return problem_type
    if num_labels == 1:
        return "regression"
    return "multi_label_classification" if labels.is_floating_point() else "single_label_classification"


def model_problem_type(model: torch.nn.Module) -> str | None:
    """``config.problem_type`` of a (wrapped) model, if it sets one."""
    return getattr(getattr(unwrap_model(model), "config", None), "problem_type", None)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 for the loss arithmetic; fp64 stays fp64 (so exactness tests mean 1e-12)."""
    return torch.promote_types(dtype, torch.float32)


def token_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    kind: LossKind = "causal_lm",
    label_smoothing: float = 0.0,
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
    problem_type: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss over the micro-batch's targets and the number of targets.

    The sum is taken in :func:`compute_dtype` (fp32 for bf16/fp16 logits), never in the
    logits' low precision. Label smoothing follows ``torch.nn.functional.cross_entropy``:
    per target ``(1 - eps) * nll + eps * mean_c(-log p_c)``, so sum / n equals torch's mean.
    ``problem_type`` only matters for ``kind="sequence"`` (see :func:`sequence_problem_type`).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if kind == "sequence":
        problem = sequence_problem_type(logits.shape[-1], labels, problem_type)
        if problem == "regression":
            return _regression_loss_sum(logits, labels)
        if problem == "multi_label_classification":
            return _multi_label_loss_sum(logits, labels)
    targets = aligned_targets(labels, kind).reshape(-1).to(logits.device)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if flat_logits.shape[0] != targets.shape[0]:
        raise ValueError(
            f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)} for loss_kind={kind!r}"
        )
    n_targets = targets.ne(IGNORE_INDEX).sum()
    rows = rows_per_chunk(flat_logits.shape[-1], flat_logits.dtype, chunk_bytes)
    if rows >= flat_logits.shape[0]:
        # Small enough: one call. No copy of the target rows either -- cross_entropy skips the
        # ignore_index rows itself, and a copy would cost a gather now and a scatter in backward.
        return _cross_entropy_sum(flat_logits, targets, label_smoothing), n_targets
    total = flat_logits.new_zeros((), dtype=compute_dtype(flat_logits.dtype))
    for start in range(0, flat_logits.shape[0], rows):
        # Slices are views: only the chunk's fp32 upcast / log-softmax is live, and recomputed in backward.
        total = total + checkpoint(
            _cross_entropy_sum, flat_logits[start : start + rows], targets[start : start + rows], label_smoothing,
            use_reentrant=False,
        )
    return total, n_targets


def rows_per_chunk(vocab_size: int, dtype: torch.dtype, chunk_bytes: int | None = DEFAULT_CHUNK_BYTES) -> int:
    """Positions per cross-entropy chunk so that one chunk's loss-dtype logits fit ``chunk_bytes``."""
    if chunk_bytes is None:
        return 2**62  # never chunk
    bytes_per_row = vocab_size * torch.finfo(compute_dtype(dtype)).bits // 8
    return max(1, chunk_bytes // bytes_per_row)


def _cross_entropy_sum(rows: torch.Tensor, targets: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return F.cross_entropy(
        rows.to(compute_dtype(rows.dtype)), targets, reduction="sum", label_smoothing=label_smoothing
    )


def _regression_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared error summed over every label element (transformers: MSELoss mean over elements)."""
    dtype = compute_dtype(logits.dtype)
    predictions = logits.to(dtype).reshape(labels.shape)
    loss_sum = (predictions - labels.to(logits.device, dtype)).pow(2).sum()
    return loss_sum, torch.tensor(labels.numel(), device=logits.device)


def _multi_label_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary cross-entropy summed over every (row, class) element (transformers: BCEWithLogits mean)."""
    dtype = compute_dtype(logits.dtype)
    loss_sum = F.binary_cross_entropy_with_logits(
        logits.to(dtype), labels.to(logits.device, dtype), reduction="sum"
    )
    return loss_sum, torch.tensor(labels.numel(), device=logits.device)
