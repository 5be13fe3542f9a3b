"""Token-summed losses: ``(loss_sum, n_targets)`` for one micro-batch, computed from logits.

This module owns *what a prediction target is* and *how a micro-batch's loss is summed*.
It never divides by anything: turning sums into the exact mean of an optimizer update is
the job of :mod:`hf_accum.accumulation`, which needs the target count of the whole window
(all micro-batches, all ranks) and therefore cannot be decided inside one micro-batch.

Why we recompute the loss instead of using ``outputs.loss``: a model's own loss divides by
*its* count (a per-micro-batch mean), and whether it honours ``num_items_in_batch`` depends
on the head (sequence-classification heads accept the keyword and ignore it). Summing
ourselves makes every head exact the same way. (For causal LMs the front-ends sum it without
logits at all, from the hidden states: :mod:`hf_accum.fused_loss`, same targets, same sum.)

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
:func:`probe_loss_kind`: its own loss on one micro-batch, compared with ours under each layout.
"""

from __future__ import annotations

import contextlib
import logging
import math
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
# cross-entropy (hf_accum.fused_loss) uses the same bound for its chunks of logits: 512 positions
# at a 128k vocabulary, large enough that its matmuls run at full speed on a CPU core (measured
# against 64-1024 positions).
DEFAULT_CHUNK_BYTES = 256 * 2**20

# Relative agreement between a model's own loss and ours that identifies its target layout.
PROBE_TOLERANCE = 1e-6
# Positions of the first micro-batch's row that the model-loss probe runs (more when its first target is later).
PROBE_POSITIONS = 64


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
    """The loss can be computed from hidden states and the output layer (hf_accum.fused_loss)."""
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
    # Seq2seq LMs feed right-shifted decoder inputs: their labels already align with the logits.
    return bool(getattr(config, "is_encoder_decoder", False)) or name.endswith("ForTokenClassification")


def _sequence_loss_sum(logits, labels, label_smoothing, chunk_bytes, problem_type):
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


def _cannot_place(name: str, detail: str = "") -> ValueError:
    return ValueError(
        f"cannot tell the loss layout of {name!r}{detail}; pass loss_kind= one of {LOSS_KINDS} "
        "('causal_lm' shifts labels by one, 'token' aligns them with logits, 'sequence' has one label per row)"
    )


def infer_loss_kind(model: torch.nn.Module) -> LossKind:
    """Tell which target layout a model's head uses, from its class (PEFT/DDP wrappers removed).

    Raises ``ValueError`` for heads we cannot place: pass ``loss_kind`` explicitly, or let
    :func:`probe_loss_kind` compare the model's own loss with ours on a micro-batch.
    """
    inner = unwrap_model(model)
    name, config = type(inner).__name__, getattr(inner, "config", None)
    matches = [kind for kind, spec in LOSS_KIND_SPECS.items() if spec.claims(name, config)]
    if len(matches) != 1:
        raise _cannot_place(name)
    return matches[0]


def probe_loss_kind(model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor) -> LossKind:
    """The per-token layout whose mean (plus the model's known extra terms) equals the model's own loss on
    this micro-batch (1e-6 relative).

    For models whose class says nothing (a causal LM inside a custom ``nn.Module``): runs the model
    once with ``labels``, without gradient, and recomputes the mean from its logits under every
    per-token layout of :data:`LOSS_KIND_SPECS`. Raises the ``infer_loss_kind`` error when none or
    more than one matches.
    """
    return probe_model_loss(model, inputs, labels).kind


@dataclass(frozen=True)
class ModelLossTerm:
    """A term a model adds to its own loss beyond the cross-entropy: ``coef * outputs[output]``, where
    ``coef`` is the model's (or its config's) attribute of that name. The front-ends add it back (see
    :func:`model_loss_terms`); a term not listed here makes :func:`probe_model_loss` stop the run."""

    output: str
    coef: str


# Router losses of mixture-of-experts models (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, ...: ``aux_loss``;
# Switch/NLLB-MoE: encoder/decoder load-balancing and router z-losses). Each is a per-forward scalar.
MODEL_LOSS_TERMS: tuple[ModelLossTerm, ...] = (
    ModelLossTerm("aux_loss", "router_aux_loss_coef"),
    ModelLossTerm("encoder_aux_loss", "router_aux_loss_coef"),
    ModelLossTerm("decoder_aux_loss", "router_aux_loss_coef"),
    ModelLossTerm("encoder_z_loss", "router_z_loss_coef"),
    ModelLossTerm("decoder_z_loss", "router_z_loss_coef"),
)

# Set this attribute on the model (``model.hf_accum_drop_model_loss_terms = True``) to train on the
# cross-entropy alone although the model's own loss holds a term hf_accum does not know.
DROP_TERMS_ATTRIBUTE = "hf_accum_drop_model_loss_terms"


def _term_coef(model: torch.nn.Module, name: str) -> float:
    inner = unwrap_model(model)
    value = getattr(inner, name, None)
    if value is None:
        value = getattr(getattr(inner, "config", None), name, None)
    return float(value or 0.0)


def model_loss_terms(model: torch.nn.Module, outputs: Any) -> torch.Tensor | None:
    """``sum coef * term`` over the known terms the forward returned (None: none). Computed as the model
    computes it (the term's dtype times the coefficient), so a probe compares like with like; the graph is
    kept, so the term's gradient reaches the router weights."""
    total = None
    for term in MODEL_LOSS_TERMS:
        value = outputs.get(term.output) if hasattr(outputs, "get") else getattr(outputs, term.output, None)
        coef = _term_coef(model, term.coef) if torch.is_tensor(value) else 0.0
        if coef:
            total = coef * value if total is None else total + coef * value.to(total.device)
    return total


class UnaccountedLossTerm(ValueError):
    """The model's own loss holds a term the cross-entropy (plus the known terms) does not explain."""


@dataclass(frozen=True)
class ModelLossProbe:
    """What the first micro-batch showed about a model's own loss."""

    kind: LossKind
    own_loss: float | None
    """The model's ``forward(labels=...)`` loss on the probed rows (None: its forward gives none)."""
    extra: float = 0.0
    """The known terms' part of it (``coef * aux_loss`` ...), added back by the front-ends."""


def probe_model_loss(
    model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor, kind: LossKind | None = None
) -> ModelLossProbe:
    """Compare the model's own loss with the cross-entropy from its logits plus its known terms, once.

    One forward with ``labels``, without gradient, on the rows of ``inputs`` that hold targets (the first
    such row when rows can be sliced, so no extra ``(tokens x vocab)`` logits of a whole micro-batch). With
    ``kind`` None the layout is found by the comparison (:func:`probe_loss_kind`); with ``kind`` given, a
    model whose loss differs raises :class:`UnaccountedLossTerm` naming the class and the difference
    (unless it carries ``hf_accum_drop_model_loss_terms = True``): a term it adds that we would drop.
    """
    name = type(unwrap_model(model)).__name__
    inputs, labels = _probe_rows(inputs, labels, kind or "causal_lm")
    try:
        with probing(model):
            outputs = model(**inputs, labels=labels)
        own, logits = outputs["loss"], outputs["logits"]
    except (TypeError, KeyError, ValueError) as error:
        if kind is not None:  # a forward without a loss of its own adds nothing we could drop
            return ModelLossProbe(kind, None)
        raise _cannot_place(name, f" (its forward gives no loss and logits with labels=: {error})") from None
    if own is None or logits is None or (kind is None and logits.dim() != 3):
        if kind is not None:
            return ModelLossProbe(kind, None)
        raise _cannot_place(name, " (its forward returns no loss or no [B, T, V] logits)")
    extra_tensor = model_loss_terms(model, outputs)
    extra = float(extra_tensor) if extra_tensor is not None else 0.0
    candidates = [kind] if kind is not None else [k for k, spec in LOSS_KIND_SPECS.items() if spec.per_token]
    means = {k: _probe_mean(logits, labels, k, model) for k in candidates}
    matches = [k for k, mean in means.items() if mean is not None and _same_loss(mean + extra, float(own))]
    if kind is None:
        if len(matches) != 1:
            found = "matches none of" if not matches else f"matches {matches} alike among"
            raise _cannot_place(name, f" (its own loss {float(own):.6g} on the first micro-batch {found} the layouts)")
        logger.info("loss layout of %s: %r (its own loss on the first micro-batch equals ours)", name, matches[0])
        return ModelLossProbe(matches[0], float(own), extra)
    if not matches and means[kind] is not None:
        _unaccounted(model, name, float(own), means[kind], extra)
    return ModelLossProbe(kind, float(own), extra)


def _probe_mean(logits: torch.Tensor, labels: torch.Tensor, kind: LossKind, model: torch.nn.Module) -> float | None:
    """The plain (unsmoothed) per-target mean of ``kind`` from the logits; None where it does not apply."""
    spec = LOSS_KIND_SPECS[kind]
    if spec.per_token and spec.align(labels).shape != logits.shape[:2]:
        return None
    loss_sum, n_targets = token_loss_sum(logits, labels, kind, problem_type=model_problem_type(model))
    return float(loss_sum) / int(n_targets) if int(n_targets) > 0 else None


def _same_loss(ours: float, own: float) -> bool:
    return math.isclose(ours, own, rel_tol=PROBE_TOLERANCE, abs_tol=PROBE_TOLERANCE)


def _unaccounted(model: torch.nn.Module, name: str, own: float, mean: float, extra: float) -> None:
    difference = own - mean - extra
    where = f"{name}'s own loss {own:.6g} = cross-entropy {mean:.6g}" + (f" + known terms {extra:.6g}" if extra else "")
    if getattr(unwrap_model(model), DROP_TERMS_ATTRIBUTE, False):
        logger.warning("%s + %.6g that hf_accum drops (%s=True)", where, difference, DROP_TERMS_ATTRIBUTE)
        return
    raise UnaccountedLossTerm(
        f"{where} + {difference:.6g} from a term hf_accum does not know (its training loss would silently drop it); "
        "compute the whole loss in loss_sum_and_count (AccumTrainer) / loss_sum_fn (hf_accum.train) and set "
        f"model.{DROP_TERMS_ATTRIBUTE} = True, or set only that attribute to train on the cross-entropy alone"
    )


def _probe_rows(inputs: dict[str, Any], labels: torch.Tensor, kind: LossKind) -> tuple[dict[str, Any], torch.Tensor]:
    """A small slice of the micro-batch that holds a target, when the inputs' layout lets it be cut (else all
    of it): the first row with a target and, for per-position labels, its first positions up to that target
    (at least :data:`PROBE_POSITIONS`). Padding-free rows (several sequences flattened into one row, as TRL's
    ``padding_free``/``packing`` and transformers' ``DataCollatorWithFlattening`` make) are cut too
    (:func:`leading_slice`). The own loss and ours are compared on the same forward, so any slice compares
    like with like; a small one keeps the probe's logits far below one training chunk."""
    rows = labels.shape[0] if labels.dim() else 0
    if rows == 0:
        return inputs, labels
    has_target = aligned_targets(labels, kind).reshape(rows, -1).ne(IGNORE_INDEX).any(1)
    row = int(has_target.nonzero()[0]) if bool(has_target.any()) else 0
    if LOSS_KIND_SPECS[kind].per_token and labels.dim() == 2:
        offset = 1 if kind == "causal_lm" else 0  # the first label a causal LM predicts is at position 1
        found = labels[row, offset:].ne(IGNORE_INDEX).nonzero()
        end = max(PROBE_POSITIONS, int(found[0]) + offset + 1 if found.numel() else 0)
        cut = leading_slice(inputs, row, end, layout=tuple(labels.shape))
        if cut is not None:
            return cut, labels[row : row + 1, :end]
    cut = leading_slice(inputs, row, None, layout=(rows,))
    return (cut, labels[row : row + 1]) if cut is not None else (inputs, labels)


# Flash-attention keyword arguments of padding-free batches: the boundaries of the sequences flattened
# into the one row (cumulative lengths) and the longest of them. Cutting the row's positions cuts them too.
_SEQUENCE_BOUNDS = {"cu_seq_lens_q": "max_length_q", "cu_seq_lens_k": "max_length_k"}


def leading_slice(
    inputs: dict[str, Any], row: int, end: int | None, layout: tuple[int, ...] | None = None
) -> dict[str, Any] | None:
    """``inputs`` reduced to row ``row`` and, with ``end``, to that row's first ``end`` positions; None when
    some input is not known to be cut that way (the caller then keeps the whole micro-batch: correct, only
    costlier).

    ``layout`` is ``(rows,)`` or ``(rows, positions)`` of the batch (default: ``input_ids``' or
    ``inputs_embeds``'); a tensor input must start with it, except a padding-free row's sequence
    boundaries (``cu_seq_lens_q/k``: those up to ``end``, then ``end``) and their maxima (``max_length_q/k``),
    recomputed for the cut. A prefix of a causal sequence is itself a valid input: every position attends to
    earlier positions only."""
    if layout is None:
        reference = inputs.get("input_ids", inputs.get("inputs_embeds"))
        if reference is None or reference.dim() < 2:
            return None
        layout = tuple(reference.shape[: 1 if end is None else 2])
    if end is not None and len(layout) < 2:
        return None
    flattened = layout[0] == 1 and any(k in inputs for k in _SEQUENCE_BOUNDS)
    recomputed = {_SEQUENCE_BOUNDS[k] for k in _SEQUENCE_BOUNDS if k in inputs} if flattened else set()
    cut: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in _SEQUENCE_BOUNDS and flattened:
            if not (torch.is_tensor(value) and value.dim() == 1):
                return None  # boundaries in a form this does not cut (a list, an array): keep the whole batch
            bounds = _cut_bounds(value, end)
            cut[key] = bounds
            if _SEQUENCE_BOUNDS[key] in inputs:
                cut[_SEQUENCE_BOUNDS[key]] = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
        elif key in recomputed:
            continue  # recomputed with its boundaries
        elif torch.is_tensor(value):
            if value.dim() < len(layout) or tuple(value.shape[: len(layout)]) != layout:
                return None
            value = value[row : row + 1]
            cut[key] = value if end is None else value[:, :end]
        else:
            cut[key] = value
    return cut


def _cut_bounds(bounds: torch.Tensor, end: int | None) -> torch.Tensor:
    """Cumulative sequence lengths ``[0, l1, l1 + l2, ...]`` of a row cut to its first ``end`` positions."""
    if end is None or end >= int(bounds[-1]):
        return bounds
    kept = bounds[bounds < end]
    return torch.cat([kept, kept.new_tensor([end])])


@contextlib.contextmanager
def probing(model: torch.nn.Module):
    """A side forward that is not training: no gradient, eval mode (no dropout; not counted as a
    training forward by hooks), every module's mode restored afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def resolve_loss_kind(
    model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor, explicit: LossKind | None = None
) -> LossKind:
    """``explicit`` if given, else the model class's layout, else the probed one (this micro-batch)."""
    if explicit is not None:
        loss_kind_spec(explicit)
        return explicit
    try:
        return infer_loss_kind(model)
    except ValueError:
        return probe_loss_kind(model, inputs, labels)


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
