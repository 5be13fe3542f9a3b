"""The model's own loss: which target layout it uses, which extra terms it adds, and the one probe that tells.

:mod:`hf_accum.losses.token_loss` sums the cross-entropy from logits; this module compares that sum with what a model's
``forward(labels=...)`` returns, once, on a small slice of the first micro-batch:

* :func:`probe_loss_kind` / :func:`resolve_loss_kind` -- the layout of a head whose class names none (a causal LM
  inside a custom ``nn.Module``): the per-token layout whose mean equals the model's own loss;
* :data:`MODEL_LOSS_TERMS` / :func:`model_loss_terms` -- the terms a model adds beyond the cross-entropy (MoE
  router losses), added back by the front-ends; :func:`probe_model_loss` stops a run whose model adds a term
  nobody knows (:class:`UnaccountedLossTerm`), which the training loss would otherwise silently drop;
* :func:`training_inputs` -- the inputs of the forward that trains (called without ``labels``): an
  encoder-decoder's decoder inputs built from the labels the way the model builds them when called with
  ``labels=`` (:func:`decoder_inputs_from_labels`); the probe checks that this forward gives the model's own
  loss, so a model that builds different inputs without ``labels`` stops the run
  (:class:`DifferentTrainingForward`) instead of training another objective silently;
* :func:`leading_slice` / :func:`probing` -- the side forward: a leading slice of one row (padding-free rows
  included), no gradient, eval mode (also used by :mod:`hf_accum.fused.head`'s probe).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from hf_accum.errors import InputError
from hf_accum.losses.token_loss import (
    IGNORE_INDEX,
    LOSS_KIND_SPECS,
    LossKind,
    aligned_targets,
    cannot_place,
    infer_loss_kind,
    loss_kind_spec,
    model_problem_type,
    token_loss_sum,
    unwrap_model,
)

logger = logging.getLogger("hf_accum.losses.token_loss")  # one log for what the loss layer decides

# Relative agreement between a model's own loss and ours that identifies its target layout.
PROBE_TOLERANCE = 1e-6
# Positions of the first micro-batch's row that the model-loss probe runs (more when its first target is later).
PROBE_POSITIONS = 64


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
    total: torch.Tensor | None = None
    for term in MODEL_LOSS_TERMS:
        value: Any = outputs.get(term.output) if hasattr(outputs, "get") else getattr(outputs, term.output, None)
        coef = _term_coef(model, term.coef) if torch.is_tensor(value) else 0.0
        if coef:
            total = coef * value if total is None else total + coef * value.to(total.device)
    return total


class UnaccountedLossTerm(ValueError):
    """The model's own loss holds a term the cross-entropy (plus the known terms) does not explain."""


class DifferentTrainingForward(UnaccountedLossTerm):
    """The model builds different inputs when called with ``labels=`` than in the forward that trains (called
    without them): its own loss is not the loss of the forward whose gradient we would apply."""


# What an encoder-decoder's decoder reads; when the batch holds neither, the model builds them from ``labels``.
DECODER_INPUT_KEYS = ("decoder_input_ids", "decoder_inputs_embeds")


def is_encoder_decoder(model: torch.nn.Module) -> bool:
    """Whether the model (DDP/FSDP/PEFT/compile wrappers removed) is an encoder-decoder (its config says so)."""
    return bool(getattr(getattr(unwrap_model(model), "config", None), "is_encoder_decoder", False))


def training_inputs(model: torch.nn.Module, inputs: dict[str, Any], labels: torch.Tensor | None,
                    kind: LossKind | None = None) -> dict[str, Any]:
    """The inputs of the forward that trains, which runs without ``labels`` (no model-side loss): ``inputs``,
    plus, for an encoder-decoder LM whose batch carries labels but no decoder inputs (what
    ``DataCollatorForSeq2Seq`` without ``model=`` gives), the ``decoder_input_ids`` the model itself builds from
    the labels when called with ``labels=``. Without them a BART would build its decoder inputs from the
    *encoder's* ``input_ids`` (another objective) and a T5 would refuse to run.

    Only per-token integer labels ``[B, T]`` are target tokens: an encoder-decoder's sequence-classification head
    (``[B]`` labels, or ``[B, C]`` float multi-label ones; ``kind`` ``"sequence"``) builds its decoder inputs
    from ``input_ids``, and a head whose forward takes no ``decoder_input_ids`` has no decoder."""
    if labels is None or not torch.is_tensor(labels) or labels.dim() != 2 or labels.is_floating_point():
        return inputs
    if kind is not None and not loss_kind_spec(kind).per_token:
        return inputs
    if not is_encoder_decoder(model) or not _takes_decoder_inputs(model):
        return inputs
    if any(inputs.get(key) is not None for key in DECODER_INPUT_KEYS):
        return inputs
    return {**inputs, "decoder_input_ids": decoder_inputs_from_labels(model, labels)}


def _takes_decoder_inputs(model: torch.nn.Module) -> bool:
    forward = getattr(unwrap_model(model), "forward", None)
    try:
        return callable(forward) and "decoder_input_ids" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a forward without a signature to read: not known to take them
        return False


def decoder_inputs_from_labels(model: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """An encoder-decoder's decoder inputs from its labels, by the model's own code: its
    ``prepare_decoder_input_ids_from_labels`` (T5, BART, mBART, Marian, Pegasus, ...), else its ``_shift_right``,
    else its modeling module's ``shift_tokens_right`` given its config's pad and decoder start ids. The probe
    (:func:`probe_model_loss`) checks the result against the model's own ``forward(labels=...)``."""
    inner = unwrap_model(model)
    prepare = getattr(inner, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return prepare(labels=labels)
    shift_right = getattr(inner, "_shift_right", None)
    if callable(shift_right):
        return shift_right(labels)
    shifted = _module_shift(inner, labels)
    if shifted is not None:
        return shifted
    name = type(inner).__name__
    raise InputError(
        f"{name} is an encoder-decoder and the batch has labels but no decoder_input_ids, and {name} has no "
        "prepare_decoder_input_ids_from_labels to build them as its forward(labels=...) does; put decoder_input_ids "
        "in the batch (e.g. DataCollatorForSeq2Seq(tokenizer, model=model))"
    )


def _module_shift(inner: Any, labels: torch.Tensor) -> torch.Tensor | None:
    """``shift_tokens_right(labels, ...)`` of the model's modeling module, its other arguments from its config
    (None: no such function, or one asking for an argument the config does not name)."""
    shift = getattr(sys.modules.get(type(inner).__module__), "shift_tokens_right", None)
    config = getattr(inner, "config", None)
    if not callable(shift) or config is None:
        return None
    parameters = list(inspect.signature(shift).parameters)[1:]
    if any(getattr(config, name, None) is None for name in parameters):
        return None
    result = shift(labels, **{name: getattr(config, name) for name in parameters})
    return result if torch.is_tensor(result) else None


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

    Then the forward that trains, on the same rows: without ``labels``, on :func:`training_inputs` (``inputs``
    are the batch's, before them). Its loss must be the one ours gave on the labels forward, else
    :class:`DifferentTrainingForward`: the model builds other inputs when it gets ``labels``.
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
        raise cannot_place(name, f" (its forward gives no loss and logits with labels=: {error})") from None
    if own is None or logits is None or (kind is None and logits.dim() != 3):
        if kind is not None:
            return ModelLossProbe(kind, None)
        raise cannot_place(name, " (its forward returns no loss or no [B, T, V] logits)")
    extra_tensor = model_loss_terms(model, outputs)
    extra = float(extra_tensor) if extra_tensor is not None else 0.0
    candidates = [kind] if kind is not None else [k for k, spec in LOSS_KIND_SPECS.items() if spec.per_token]
    means = {k: _probe_mean(logits, labels, k, model) for k in candidates}
    matches = [k for k, mean in means.items() if mean is not None and _same_loss(mean + extra, float(own))]
    if kind is None:
        if len(matches) != 1:
            found = "matches none of" if not matches else f"matches {matches} alike among"
            raise cannot_place(name, f" (its own loss {float(own):.6g} on the first micro-batch {found} the layouts)")
        logger.info("loss layout of %s: %r (its own loss on the first micro-batch equals ours)", name, matches[0])
        kind = matches[0]
    mean = means[kind]
    if not matches and mean is not None:
        _unaccounted(model, name, float(own), mean, extra)
    # Every rank that got here runs the training forward too (a DDP forward is a collective).
    _check_training_forward(model, name, inputs, labels, kind, float(own), None if mean is None else mean + extra)
    return ModelLossProbe(kind, float(own), extra)


def _check_training_forward(model: torch.nn.Module, name: str, inputs: dict[str, Any], labels: torch.Tensor,
                            kind: LossKind, own: float, expected: float | None) -> None:
    """The forward that trains (without ``labels``, on :func:`training_inputs`) must give the loss ours gives on
    the model's ``forward(labels=...)`` (``expected``: its cross-entropy plus known terms; None: not comparable,
    nothing checked), else :class:`DifferentTrainingForward`: the model builds other inputs when it gets
    ``labels`` (an encoder-decoder shifting its labels into decoder inputs, a custom forward), and the gradient we
    would apply is not the gradient of its own loss."""
    cause = f"{name} builds different inputs when called with labels= than in the forward that trains (without labels)"
    try:
        with probing(model):
            outputs = model(**training_inputs(model, inputs, labels, kind))
        logits = outputs["logits"]
    except (TypeError, KeyError, ValueError) as error:
        if expected is None:
            return
        raise DifferentTrainingForward(f"{cause}: that forward fails ({error}); {_DIFFERENT_FORWARD_FIX}") from error
    if expected is None:
        return
    spec = LOSS_KIND_SPECS[kind]
    if logits is None or (spec.per_token and spec.align(labels).shape != logits.shape[:2]):
        shape = None if logits is None else tuple(logits.shape)
        raise DifferentTrainingForward(
            f"{cause}: its logits {shape} there do not line up with labels {tuple(labels.shape)} as its own loss's "
            f"do; {_DIFFERENT_FORWARD_FIX}")
    ours = _probe_mean(logits, labels, kind, model)
    if ours is None:  # no target in the probed rows: nothing to compare
        return
    terms = model_loss_terms(model, outputs)
    training = ours + (float(terms) if terms is not None else 0.0)
    if not _same_loss(training, expected):
        raise DifferentTrainingForward(
            f"{cause}: its own loss {own:.6g} (forward(labels=...)) vs the training forward's {training:.6g} on the "
            f"first micro-batch; {_DIFFERENT_FORWARD_FIX}")


_DIFFERENT_FORWARD_FIX = (
    "put the inputs it builds from the labels in the batch (an encoder-decoder: decoder_input_ids, e.g. "
    "DataCollatorForSeq2Seq(tokenizer, model=model)), or make its forward build the same inputs without labels="
)


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
def probing(model: torch.nn.Module) -> Iterator[None]:
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
