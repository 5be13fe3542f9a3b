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
* ``sequence`` -- logits ``[B, C]``, labels ``[B]``: one target per sequence (sequence
  classification). ``C == 1`` with float labels is regression (squared error).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
LossKind = Literal["causal_lm", "token", "sequence"]
LOSS_KINDS: tuple[str, ...] = ("causal_lm", "token", "sequence")

# Rows of logits upcast to fp32 at a time. Above this many targets the cross-entropy is
# computed chunk by chunk under activation checkpointing, so the fp32 copy of the logits
# (V floats per target: 0.5 MB per token at a 128k vocabulary) never exists for the whole
# micro-batch at once; only one chunk's worth is live in forward and in backward.
DEFAULT_CHUNK_TARGETS = 4096


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
        return torch.tensor(labels.shape[0], device=labels.device)  # regression: every row counts
    return aligned_targets(labels, kind).ne(IGNORE_INDEX).sum()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 for the loss arithmetic; fp64 stays fp64 (so exactness tests mean 1e-12)."""
    return torch.promote_types(dtype, torch.float32)


def token_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    kind: LossKind = "causal_lm",
    label_smoothing: float = 0.0,
    chunk_targets: int | None = DEFAULT_CHUNK_TARGETS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss over the micro-batch's targets and the number of targets.

    The sum is taken in :func:`compute_dtype` (fp32 for bf16/fp16 logits), never in the
    logits' low precision. Label smoothing follows ``torch.nn.functional.cross_entropy``:
    per target ``(1 - eps) * nll + eps * mean_c(-log p_c)``, so sum / n equals torch's mean.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if kind == "sequence" and labels.is_floating_point():
        return _regression_loss_sum(logits, labels)
    targets = aligned_targets(labels, kind).reshape(-1).to(logits.device)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if flat_logits.shape[0] != targets.shape[0]:
        raise ValueError(
            f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)} for loss_kind={kind!r}"
        )
    valid = targets.ne(IGNORE_INDEX)
    n_targets = valid.sum()
    # Only rows with a target take part: with prompt masking most rows are skipped, and the
    # fp32 upcast below then costs memory for answer tokens only.
    rows, row_targets = flat_logits[valid], targets[valid]
    if chunk_targets is None or rows.shape[0] <= chunk_targets:
        return _cross_entropy_sum(rows, row_targets, label_smoothing), n_targets
    total = rows.new_zeros((), dtype=compute_dtype(rows.dtype))
    for start in range(0, rows.shape[0], chunk_targets):
        stop = start + chunk_targets
        total = total + checkpoint(
            _cross_entropy_sum, rows[start:stop], row_targets[start:stop], label_smoothing, use_reentrant=False
        )
    return total, n_targets


def _cross_entropy_sum(rows: torch.Tensor, targets: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return F.cross_entropy(
        rows.to(compute_dtype(rows.dtype)), targets, reduction="sum", label_smoothing=label_smoothing
    )


def _regression_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = compute_dtype(logits.dtype)
    predictions = logits.reshape(labels.shape[0], -1).to(dtype).squeeze(-1)
    loss_sum = (predictions - labels.to(dtype)).pow(2).sum()
    return loss_sum, torch.tensor(labels.shape[0], device=logits.device)
