"""Token-summed losses: ``(loss_sum, n_targets)`` for one micro-batch, computed from logits.

This module owns *what a prediction target is* and *how a micro-batch's loss is summed*.
It never divides by anything: turning sums into the exact mean of an optimizer update is
the job of :mod:`hf_accum.accumulation`, which needs the target count of the whole window
(all micro-batches, all ranks) and therefore cannot be decided inside one micro-batch.

Why we recompute the loss instead of using ``outputs.loss``: a model's own loss divides by
*its* count (a per-micro-batch mean), and whether it honours ``num_items_in_batch`` depends
on the head (sequence-classification heads accept the keyword and ignore it). Summing
ourselves makes every head exact the same way. (For causal LMs the front-ends sum it without
logits at all, from the hidden states: :mod:`hf_accum.fused.loss`, same targets, same sum.)

Loss kinds are one table, :data:`LOSS_KIND_SPECS` (alignment, which model classes use it,
how it is summed and counted):

* ``causal_lm`` -- logits ``[B, T, V]``, labels ``[B, T]``; the target of position ``i`` is
  ``labels[:, i + 1]`` (the causal shift), so position 0 of a row is never a target.
* ``token`` -- logits ``[B, T, C]``, labels ``[B, T]`` aligned with the logits (token
  classification, encoder-decoder LMs whose decoder inputs are already shifted).
* ``sequence`` -- logits ``[B, C]`` of a sequence-classification head, with transformers' three
  problem types (same inference as ``ForSequenceClassificationLoss``: ``C == 1`` is regression,
  integer labels are single-label, float labels multi-label; ``config.problem_type`` wins):
  single-label cross-entropy (a target per labelled row), multi-label binary cross-entropy and
  regression squared error (a target per label *element*, as transformers' mean counts them).

A model whose class names no layout (a causal LM inside a custom ``nn.Module``) is placed by
:func:`hf_accum.losses.model_loss.probe_loss_kind`: its own loss on one micro-batch, compared with ours under each
layout (the model's own loss, its extra terms and the probe live in :mod:`hf_accum.losses.model_loss`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
LossKind = str  # a key of LOSS_KIND_SPECS
PROBLEM_TYPES: tuple[str, ...] = ("single_label_classification", "multi_label_classification", "regression")

# Bytes of loss-dtype (fp32) logits processed at a time. Above this, the cross-entropy runs chunk
# by chunk under activation checkpointing: neither the fp32 upcast of bf16 logits nor the
# log-softmax that cross_entropy saves for backward (each V x 4 bytes per position: 0.5 MB per
# token at a 128k vocabulary) ever exists for the whole micro-batch, only for one chunk. Sized
# in bytes, not rows, so one chunk stays the same size whatever the vocabulary. The fused linear
# cross-entropy (hf_accum.fused.loss) uses the same bound for its chunks of logits: 384 positions
# at a 128k vocabulary (a multiple of 128 rows: its GEMMs run as fast per FLOP as at 512, where 341
# or 410 rows run 3-6% slower), small enough that an fp32 loss step at vocab 128256 and hidden 2048
# peaks at 0.25x the logits path's memory, its weight gradient (1 GiB) included. (On a CPU its fp32 chunks hold
# at least 384 rows at any vocabulary: hf_accum.fused.loss.MIN_CPU_CHUNK_ROWS.)
DEFAULT_CHUNK_BYTES = 192 * 2**20


@dataclass(frozen=True)
class LossKindSpec:
    """One target layout. Adding a loss kind means adding one entry to :data:`LOSS_KIND_SPECS` (and,
    if its reference loss differs, one to :data:`hf_accum.verify.REFERENCE_LAYOUTS`)."""

    description: str
    align: Callable[[torch.Tensor], torch.Tensor]
    """labels -> labels aligned with the logit positions that predict them (-100: nothing predicted)."""
    claims: Callable[[str, Any], bool]
    """(model class name, config) -> whether heads of that class use this layout."""
    per_token: bool = True
    """A per-position cross-entropy over logits ``[B, T, V]``: a model's own loss can be probed against it."""
    fused: bool = False
    """The loss can be computed from hidden states and the output layer (hf_accum.fused.loss)."""
    loss_sum: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    """(logits, labels, label_smoothing, chunk_bytes, problem_type) -> (sum, count); default: cross-entropy."""
    count: Callable[[torch.Tensor], torch.Tensor] | None = None
    """labels -> number of targets; default: the aligned labels that are not -100."""


def _next_token(labels: torch.Tensor) -> torch.Tensor:
    # The logit at position i predicts labels[:, i + 1]; the last logit predicts nothing. Keeping the
    # tensor the size of the logits (instead of slicing the logits) avoids a copy of the logits.
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def _same_positions(labels: torch.Tensor) -> torch.Tensor:
    return labels


def _class_name_ends(*suffixes: str, encoder_decoder: bool | None = None) -> Callable[[str, Any], bool]:
    def claims(name: str, config: Any) -> bool:
        if encoder_decoder is not None and bool(getattr(config, "is_encoder_decoder", False)) != encoder_decoder:
            return False
        return name.endswith(suffixes)

    return claims


def _token_claims(name: str, config: Any) -> bool:
    # Seq2seq LMs feed right-shifted decoder inputs: their labels already align with the logits. An
    # encoder-decoder's sequence-classification head (BART's, T5's) is the "sequence" layout's.
    seq2seq_lm = bool(getattr(config, "is_encoder_decoder", False)) and not name.endswith("ForSequenceClassification")
    return seq2seq_lm or name.endswith("ForTokenClassification")


def _sequence_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float, chunk_bytes: int | None,
    problem_type: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    problem = sequence_problem_type(logits.shape[-1], labels, problem_type)
    if problem == "regression":
        return _regression_loss_sum(logits, labels)
    if problem == "multi_label_classification":
        return _multi_label_loss_sum(logits, labels)
    return _cross_entropy_loss_sum(logits, labels, label_smoothing, chunk_bytes)


def _sequence_count(labels: torch.Tensor) -> torch.Tensor:
    if labels.is_floating_point():
        # Regression and multi-label: every label element is a target (transformers' mean counts them all).
        return torch.tensor(labels.numel(), device=labels.device)
    return labels.ne(IGNORE_INDEX).sum()


LOSS_KIND_SPECS: dict[str, LossKindSpec] = {
    "causal_lm": LossKindSpec(
        "logits [B, T, V], labels [B, T]; position i predicts labels[:, i + 1] (position 0 of a row is never a target)",
        align=_next_token, fused=True,
        claims=_class_name_ends("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", encoder_decoder=False),
    ),
    "token": LossKindSpec(
        "logits [B, T, C], labels [B, T] aligned with the logits (token classification, encoder-decoder LMs)",
        align=_same_positions, claims=_token_claims,
    ),
    "sequence": LossKindSpec(
        "logits [B, C] of a sequence-classification head, one label (or C float labels) per row",
        align=_same_positions, claims=_class_name_ends("ForSequenceClassification"), per_token=False,
        loss_sum=_sequence_loss_sum, count=_sequence_count,
    ),
}
LOSS_KINDS: tuple[str, ...] = tuple(LOSS_KIND_SPECS)


def loss_kind_spec(kind: LossKind) -> LossKindSpec:
    """The registry entry of ``kind``; a clear error naming the allowed kinds otherwise."""
    if kind not in LOSS_KIND_SPECS:
        raise ValueError(f"loss_kind={kind!r} is not one of {LOSS_KINDS}")
    return LOSS_KIND_SPECS[kind]


def cannot_place(name: str, detail: str = "") -> ValueError:
    return ValueError(
        f"cannot tell the loss layout of {name!r}{detail}; pass loss_kind= one of {LOSS_KINDS} "
        "('causal_lm' shifts labels by one, 'token' aligns them with logits, 'sequence' has one label per row)"
    )


def infer_loss_kind(model: torch.nn.Module) -> LossKind:
    """Tell which target layout a model's head uses, from its class (PEFT/DDP wrappers removed).

    Raises ``ValueError`` for heads we cannot place: pass ``loss_kind`` explicitly, or let
    :func:`hf_accum.losses.model_loss.probe_loss_kind` compare the model's own loss with ours on a micro-batch.
    """
    inner = unwrap_model(model)
    name, config = type(inner).__name__, getattr(inner, "config", None)
    matches = [kind for kind, spec in LOSS_KIND_SPECS.items() if spec.claims(name, config)]
    if len(matches) != 1:
        raise cannot_place(name)
    return matches[0]


def unwrap_model(model: torch.nn.Module | None) -> Any:
    """Strip DDP/FSDP (``.module``), torch.compile (``._orig_mod``) and PEFT (``.base_model.model``)."""
    seen: set[int] = set()
    inner: Any = model  # the wrappers' attributes are dynamic (Module.__getattr__)
    while id(inner) not in seen:
        seen.add(id(inner))
        if hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
            inner = inner.module
        elif hasattr(inner, "_orig_mod"):
            inner = inner._orig_mod
        elif type(inner).__name__.startswith("Peft") and hasattr(inner, "base_model"):
            inner = inner.base_model.model if hasattr(inner.base_model, "model") else inner.base_model
    return inner


def aligned_targets(labels: torch.Tensor, kind: LossKind = "causal_lm") -> torch.Tensor:
    """Labels aligned with the logit positions that predict them (-100 where nothing is predicted)."""
    return loss_kind_spec(kind).align(labels)


def count_targets(labels: torch.Tensor, kind: LossKind = "causal_lm") -> torch.Tensor:
    """Number of prediction targets in a micro-batch (after the causal shift), as an int64 tensor."""
    spec = loss_kind_spec(kind)
    return spec.count(labels) if spec.count is not None else spec.align(labels).ne(IGNORE_INDEX).sum()


def check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")


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
    check_label_smoothing(label_smoothing)
    spec = loss_kind_spec(kind)
    if spec.loss_sum is not None:
        return spec.loss_sum(logits, labels, label_smoothing, chunk_bytes, problem_type)
    return _cross_entropy_loss_sum(logits, spec.align(labels), label_smoothing, chunk_bytes)


def _cross_entropy_loss_sum(
    logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float, chunk_bytes: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of logits ``[..., V]`` against targets already aligned with them."""
    targets = targets.reshape(-1).to(logits.device)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if flat_logits.shape[0] != targets.shape[0]:
        raise ValueError(f"labels {tuple(targets.shape)} do not match logits {tuple(logits.shape)}")
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
