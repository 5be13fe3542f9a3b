"""What both front-ends call per micro-batch: the forward and the summed loss, ``(outputs, loss_sum, n_targets)``.

:class:`MicroBatchLoss` takes the fused path (:mod:`hf_accum.fused.head`, :mod:`hf_accum.fused.loss`) for
causal LMs while training, the logits path otherwise; it adds the terms a model adds to its own loss (a MoE
router loss) by the rule in its docstring, and optionally sums TRL's metrics (:class:`TokenStats`) in the
same pass. :func:`logits_token_stats` gives those metrics from logits.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch
from torch import nn

from hf_accum.boundary import default_unit_counter
from hf_accum.fused.head import FusedCausalLMLoss
from hf_accum.fused.loss import (
    TokenStats,
)
from hf_accum.losses.model_loss import model_loss_terms, probe_model_loss, resolve_loss_kind, training_inputs
from hf_accum.losses.sequence_norm import SequenceMeanLoss, refuse_custom_loss, sequence_weights
from hf_accum.losses.token_loss import (
    IGNORE_INDEX,
    LossKind,
    aligned_targets,
    check_label_smoothing,
    compute_dtype,
    count_targets,
    infer_loss_kind,
    loss_kind_spec,
    rows_per_chunk,
    token_loss_sum,
)
from hf_accum.settings import check_normalization

logger = logging.getLogger("hf_accum.fused.loss")


# (outputs, labels, inputs) -> (summed loss, number of units). Must sum, never average. A loss of several terms
# with different units returns 1-d tensors (one sum and one count per term, hf_accum.accumulation); such a loss
# (or one whose unit is not the target token, e.g. hf_accum.losses.preference.DPOPairLoss) also declares
# ``term_names`` and ``count_units(labels, inputs)`` (the same counts from the labels alone, for the front-ends
# that count a window before backward) and may name ``non_model_keys`` (batch keys kept out of the forward) and
# ``run_forward(model, inputs, labels)`` (runs the model itself, e.g. with fused log-probs; its outputs go to the loss).
# A loss that is not the model's own ``forward(labels=...)`` loss (a reward model's pairwise loss) sets
# ``compares_model_loss = False``: the first-micro-batch probe then has nothing to compare and is not run.
LossSumFn = Callable[[Any, torch.Tensor, dict], "tuple[torch.Tensor, torch.Tensor]"]


class MicroBatchLoss:
    """A run's forward and summed loss per micro-batch: ``(outputs, loss_sum, n_targets)``.

    * ``kind`` -- the target layout; None: from the model class, else probed on the first micro-batch
      (:func:`hf_accum.losses.model_loss.resolve_loss_kind`).
    * ``loss_sum_fn(outputs, labels, inputs)`` -- the loss from the forward's outputs (the logits path);
      None: :func:`hf_accum.losses.token_loss.token_loss_sum`.
    * ``fused`` -- whether layouts that allow it (causal LMs) may use :class:`FusedCausalLMLoss` while
      training; ``outputs.logits`` then holds the loss, not logits. Pass False when ``loss_sum_fn``
      needs the logits (a custom loss).
    * ``token_stats`` -- also compute each micro-batch's :class:`TokenStats` (entropy, arg-max hits) into
      :attr:`last_token_stats`: inside the fused pass, else from the logits (per-token loss kinds).
    * ``normalization`` -- ``token`` (the loss sums its targets' losses and counts its targets) or ``sequence``
      (each target weighted by 1 / its sequence's targets, the count is the sequences:
      :mod:`hf_accum.losses.sequence_norm`); the weights go into the fused pass, or into the logits path's loss
      (:class:`~hf_accum.losses.sequence_norm.SequenceMeanLoss`, the default ``loss_sum_fn`` of that mode).

    **The forward that trains** runs without ``labels`` (no model-side loss); an encoder-decoder whose batch has
    labels but no decoder inputs gets the ``decoder_input_ids`` it builds from them itself
    (:func:`hf_accum.losses.model_loss.training_inputs`), in training and evaluation alike. The probe below checks that
    this forward gives the model's own ``forward(labels=...)`` loss, for any model.

    **Terms the model adds to its own loss.** The first micro-batch is probed once
    (:func:`hf_accum.losses.model_loss.probe_model_loss`): the model's own ``forward(labels=...)`` loss must equal
    the cross-entropy from its logits plus its known terms (:data:`hf_accum.losses.model_loss.MODEL_LOSS_TERMS`, e.g.
    a MoE router's ``router_aux_loss_coef * aux_loss``), else the run stops naming the model and the
    difference. While training, the known terms are added to the micro-batch's loss *sum* weighted by its
    target count: micro-batch ``k`` (``n_k`` targets, router loss ``aux_k``) adds ``coef * aux_k * n_k``.
    The front-ends divide the update's sum by its ``N`` targets (all micro-batches, all ranks) once, so the
    update minimizes ``CE mean + coef * sum_k (n_k / N) aux_k``: ``coef`` times the token-weighted mean of
    the micro-batches' router losses. Its weight does not grow with K or the number of ranks (stock
    ``Trainer`` adds ``coef * aux_k`` per micro-batch: K times), and when every micro-batch holds the same
    rows it is the big batch's own term exactly. (A load-balancing loss is not a sum over tokens, so no
    accumulation equals a big batch of *different* micro-batches without a pre-pass over the window.)
    :attr:`aux_sum` is the term's detached part of the last training micro-batch's sum (None: none), so
    the front-ends log the cross-entropy and the term apart. Evaluation sums the cross-entropy alone.
    """

    def __init__(
        self,
        kind: LossKind | None = None,
        label_smoothing: float = 0.0,
        problem_type: str | None = None,
        loss_sum_fn: LossSumFn | None = None,
        fused: bool = True,
        chunk_bytes: int | None = None,
        token_stats: bool = False,
        normalization: str = "token",
    ):
        check_label_smoothing(label_smoothing)
        self.kind = kind
        self.label_smoothing = label_smoothing
        self.problem_type = problem_type
        check_normalization(normalization, "MicroBatchLoss(normalization)", kind)
        refuse_custom_loss(normalization, "a custom loss_sum_fn" if loss_sum_fn else None,
                           "MicroBatchLoss(normalization)")
        self.normalization = normalization
        if normalization == "sequence":
            loss_sum_fn = SequenceMeanLoss(label_smoothing)
        self.loss_sum_fn = loss_sum_fn or self._token_loss_sum
        self.fused = FusedCausalLMLoss(label_smoothing, chunk_bytes) if fused else None
        self.terms_checked = not getattr(loss_sum_fn, "compares_model_loss", True)  # see LossSumFn
        self.aux_sum: torch.Tensor | None = None
        self.token_stats = token_stats
        self.last_token_stats: TokenStats | None = None

    @property
    def term_names(self) -> tuple[str, ...]:
        """The units of the loss's terms, primary first (one for the built-in losses)."""
        names = getattr(self.loss_sum_fn, "term_names", None)
        return tuple(names) if names else ("sequence" if self.normalization == "sequence" else "target",)

    @property
    def extra_terms(self) -> tuple[str, ...]:
        """The terms after the primary one (what the window tally adds columns for)."""
        return self.term_names[1:]

    def count_units(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The counts this loss will return for ``batch``, from the batch alone (before any forward)."""
        own = getattr(self.loss_sum_fn, "count_units", None)
        if own is not None:
            return own(batch["labels"], batch)
        # The front-ends resolve the layout before they count (trainer.core, DeepSpeedStepper); a loss of several
        # terms counts its own units (count_units above).
        assert self.kind is not None, "count_units before the loss layout (kind) is known"
        return default_unit_counter(self.kind, self.normalization)(batch)

    def model_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The forward's inputs: without the keys the loss reads but the model must not get."""
        skip = getattr(self.loss_sum_fn, "non_model_keys", ())
        return {key: value for key, value in inputs.items() if key not in skip} if skip else inputs

    def __call__(self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor,
                 need_logits: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor]:
        if not self.terms_checked:
            self._probe_model_loss(model, self.model_inputs(inputs), labels)
        if self.kind is None:
            self.kind = resolve_loss_kind(model, inputs, labels)
        # The forward runs without labels: an encoder-decoder gets the decoder inputs it would build from them.
        inputs = training_inputs(model, inputs, labels)
        outputs, loss_sum, n_targets = self._cross_entropy(model, inputs, labels, need_logits)
        self.aux_sum = None
        terms = model_loss_terms(model, outputs) if model.training else None
        if terms is not None and loss_sum.dim() > 0:
            raise NotImplementedError(
                f"the model adds a term to its own loss (e.g. a MoE router loss) and the loss has several terms "
                f"{self.term_names}: no rule for the router term is defined there; disable it "
                "(output_router_logits=False)")
        if terms is not None:
            # coef * aux_k * n_k: the update's W / N turns it into the token-weighted mean (class docstring).
            self.aux_sum = terms.to(loss_sum.device, loss_sum.dtype) * torch.as_tensor(
                n_targets, device=loss_sum.device, dtype=loss_sum.dtype
            )
            loss_sum = loss_sum + self.aux_sum
            self.aux_sum = self.aux_sum.detach()
        return outputs, loss_sum, n_targets

    def _cross_entropy(self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor,
                       need_logits: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
        assert self.kind is not None  # resolved by __call__
        stats = TokenStats.zeros(torch.float64, labels.device) if self.token_stats else None
        self.last_token_stats = stats
        if self._may_fuse(model) and not need_logits:
            weights = count = None
            if self.normalization == "sequence":
                weights, count = sequence_weights(labels, inputs.get("position_ids"))
            assert self.fused is not None  # _may_fuse
            fused = self.fused.forward_loss(model, inputs, labels, stats, weights)
            if fused is not None:
                outputs, loss_sum = fused
                return outputs, loss_sum, count if count is not None else count_targets(labels, self.kind)
        # No labels: no model-side loss, no wasted (fp32) loss math. A loss that runs the forward itself
        # (``run_forward``: DPOPairLoss's fused log-probs, its head returning them) does so unless logits are asked.
        own_forward = None if need_logits else getattr(self.loss_sum_fn, "run_forward", None)
        model_inputs = self.model_inputs(inputs)
        outputs = own_forward(model, model_inputs, labels) if own_forward is not None else model(**model_inputs)
        loss_sum, n_targets = self.loss_sum_fn(outputs, labels, inputs)
        if stats is not None and loss_kind_spec(self.kind).per_token:
            stats.add_(logits_token_stats(outputs.logits, labels, self.kind))
        return outputs, loss_sum, n_targets

    def _probe_model_loss(self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor) -> None:
        """Once, on the first micro-batch: the layout (when unknown) and no dropped term. Every rank probes
        its first micro-batch (the forward goes through DDP, whose buffer broadcast is a collective); a
        micro-batch without targets has no loss to compare, and is not compared."""
        kind = self.kind
        if kind is None:
            try:
                kind = infer_loss_kind(model)
            except ValueError:
                kind = None  # probe_model_loss finds it from the model's own loss
        self.kind = probe_model_loss(model, inputs, labels, kind).kind
        self.terms_checked = True

    def _may_fuse(self, model: nn.Module) -> bool:
        # Training only: evaluation and prediction want logits, and the fused path computes gradients.
        assert self.kind is not None  # resolved by __call__
        return (
            self.fused is not None and loss_kind_spec(self.kind).fused and model.training and torch.is_grad_enabled()
        )

    def _token_loss_sum(self, outputs: Any, labels: torch.Tensor,
                        inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kind is not None  # resolved by __call__
        return token_loss_sum(outputs.logits, labels, self.kind, self.label_smoothing, problem_type=self.problem_type)


@torch.no_grad()
def logits_token_stats(logits: torch.Tensor, labels: torch.Tensor, kind: LossKind = "causal_lm") -> TokenStats:
    """:class:`TokenStats` of a micro-batch from its materialized logits (the logits path's counterpart of
    the fused pass's): entropy ``-sum_c p_c log p_c`` and first-arg-max hits over the prediction targets,
    one chunk of upcast logits at a time. Every position is evaluated and non-targets are masked
    afterwards, so no data-dependent shape forces a host sync."""
    targets = aligned_targets(labels, kind).reshape(-1).to(logits.device)
    flat_logits = logits.detach().reshape(-1, logits.shape[-1])
    is_target = targets.ne(IGNORE_INDEX)
    stats = TokenStats.zeros(compute_dtype(flat_logits.dtype), logits.device)
    stats.targets += is_target.sum()
    rows = rows_per_chunk(flat_logits.shape[-1], flat_logits.dtype)
    for start in range(0, flat_logits.shape[0], rows):
        chunk = flat_logits[start : start + rows].to(compute_dtype(flat_logits.dtype))
        chunk_is_target = is_target[start : start + rows]
        log_p = chunk.log_softmax(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        stats.entropy_sum += entropy.masked_fill(~chunk_is_target, 0).sum()
        stats.top1_hits += (chunk.argmax(-1).eq(targets[start : start + rows]) & chunk_is_target).sum()
    return stats
