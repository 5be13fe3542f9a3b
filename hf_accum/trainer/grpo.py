"""AccumGRPOTrainer: TRL's ``GRPOTrainer`` whose every update applies the big batch's gradient, in every ``loss_type``.

This module owns what GRPO's losses mean over one optimizer update and how the trainer gets there.

**The rule.** Every TRL 1.16 ``loss_type`` aggregates a per-token loss ``l[i, t]`` (completion ``i``, token ``t``,
mask ``m``) as a *sum over units divided by a count of units*. Over one update -- all its micro-batches on all
ranks, whatever ``steps_per_generation`` and ``gradient_accumulation_steps`` are -- the exact loss is that sum over
the update's completions divided by the update's count (:data:`MODE_UNITS`):

========================  ===========================================  ====================================
loss_type                 sum over the update                          count over the update
========================  ===========================================  ====================================
grpo, sapo                sum_i (sum_t m l / max(1, |o_i|))            completions
luspo                     sum_i sum_t m l                              completions
dr_grpo                   sum_i sum_t m l                              completions x max_completion_length
bnpo, dapo, cispo, vespo  sum_i sum_t m l                              completion tokens (at least 1)
========================  ===========================================  ====================================

(``bnpo`` is TRL's token mean of one batch; over the update's batch it is ``dapo``'s formula.) The KL term
(``beta > 0``) is its own ``(sum, count)``: ``beta * kl[i, t]`` summed with the loss type's weights and divided by
the loss type's count -- the unit TRL and verl aggregate it with (``per_token_loss + beta * kl`` in TRL, ``agg_loss
(kld, loss_agg_mode)`` in verl). The entropy bonus (``entropy_coef``) is a third term whose unit is always the
completion token (TRL documents it as "the mean per-token entropy regardless of loss_type").

**How.** The counts are needed before the first backward of the update, and with ``steps_per_generation <
gradient_accumulation_steps`` the update's later micro-batches are generated *during* it. So
:meth:`AccumGRPOTrainer.get_batch_samples` (Trainer fetches an update's raw batches there) runs TRL's own
``_prepare_inputs`` for each of the update's micro-batches up front -- generating, scoring and buffering exactly as
TRL would, at the same ``_step`` values and with the same parameters (no optimizer step happens inside an
update) -- counts completions and tokens, and all-reduces the counts once. ``compute_loss`` then lets TRL compute its
per-micro-batch policy loss (with ``beta`` and the entropy bonus switched off for that call), turns TRL's divisor
into the update's count (:func:`hf_accum.compat.trl_grpo_divisor`), and adds the KL and entropy terms from the same
forward's log-probs. Generation itself is never touched (a harness may replace ``_generate_and_score_completions``).

**Log-probs.** The per-token log-probs and entropies of the policy, the old policy and the reference come from our
fused log-probs (:mod:`hf_accum.fused.logprobs`: chunked over the completion tokens, no ``[tokens, vocab]`` logits,
the entropy and its gradient from the same chunks), in :func:`hf_accum.losses.token_loss.compute_dtype`: a float64
model is exact to rounding, so float64 tests measure the accumulation math, not float32 rounding (TRL's fused head
accumulates in float32). ``fused_logprobs=False``, a head that cannot be fused, multimodal inputs or a MoE router loss
take TRL's fused head, or for a float64 model the full logits in float64.

**sapo.** TRL 1.16 stores ``sapo_temperature_pos`` / ``_neg`` as float32 constants (1.05 -> 1.0499999523); the loss
here uses them as Python floats in the loss dtype (:meth:`AccumGRPOTrainer.get_sapo_token_loss`).

Refused, with the reason: ``top_entropy_quantile < 1`` (a quantile of each micro-batch's entropies, not a sum),
``use_adaptive_entropy``, and a MoE router loss (TRL adds it per micro-batch; no rule here yet).

Later: the per-term ``(sum, count)`` bookkeeping here is local (:class:`WindowCounts`); once the unit-generalised
core of :mod:`hf_accum.accumulation` (stream ``dpo``) lands, the terms should be carried by it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, cast

import torch

from hf_accum.accumulation import DeviceSums, exact_mean_factor
from hf_accum.compat import (
    grpo_entropy_bonus_switch,
    grpo_step,
    set_grpo_step,
    trl_grpo_divisor,
    trl_metrics,
)
from hf_accum.fused.logprobs import FusedLogProbs
from hf_accum.losses.token_loss import IGNORE_INDEX, compute_dtype

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as error:  # TRL is an optional extra
    raise ImportError("AccumGRPOTrainer needs TRL: pip install 'hf_accum[trl]'") from error


@dataclass(frozen=True)
class Unit:
    """How a per-token quantity is summed over an update and what it is divided by.

    ``per_sequence_mean``: each completion's token mean enters the sum (else each token enters it). ``count``:
    ``"sequences"``, ``"tokens"`` or ``"sequences_x_length"`` (completions times ``max_completion_length``)."""

    per_sequence_mean: bool
    count: str


SEQUENCE_MEANS = Unit(per_sequence_mean=True, count="sequences")
SEQUENCE_SUMS = Unit(per_sequence_mean=False, count="sequences")
CONSTANT_LENGTH = Unit(per_sequence_mean=False, count="sequences_x_length")
TOKENS = Unit(per_sequence_mean=False, count="tokens")

MODE_UNITS: dict[str, Unit] = {
    "grpo": SEQUENCE_MEANS, "sapo": SEQUENCE_MEANS,
    "luspo": SEQUENCE_SUMS,
    "dr_grpo": CONSTANT_LENGTH,
    "bnpo": TOKENS, "dapo": TOKENS, "cispo": TOKENS, "vespo": TOKENS,
}
"""Every TRL 1.16 ``loss_type`` and the unit its loss (and its KL term) is a mean over."""
SUPPORTED_LOSS_TYPES = tuple(MODE_UNITS)


def unit_sum(per_token: torch.Tensor, mask: torch.Tensor, unit: Unit) -> torch.Tensor:
    """This micro-batch's sum of ``per_token`` (``(B, T)``, or ``(B, 1)`` for a sequence-level quantity, broadcast
    over the completion's tokens as TRL does) in ``unit``: never a mean over the micro-batch."""
    masked = (per_token * mask).sum(-1)
    if unit.per_sequence_mean:
        masked = masked / mask.sum(-1).clamp(min=1.0)
    return masked.sum()


@dataclass(frozen=True)
class WindowCounts:
    """The update's completions and completion tokens on all ranks (one all-reduce), and ``W``."""

    sequences: float
    tokens: float
    world_size: int
    max_completion_length: int

    def count(self, unit: Unit) -> float:
        """The update's number of ``unit`` (at least 1: a window without any leaves every sum at 0)."""
        if unit.count == "sequences":
            value = self.sequences
        elif unit.count == "tokens":
            value = self.tokens
        else:
            value = self.sequences * self.max_completion_length
        return max(value, 1.0)

    def factor(self, unit: Unit) -> float:
        """``W / N``: turns this rank's sum into its share of the update's mean (the one normalization owner)."""
        return exact_mean_factor(self.count(unit), self.world_size)


def loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """The tokens TRL's loss covers: the completion mask, times the tool mask of multi-turn rollouts."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


class PreparedMicroBatch(dict):
    """A micro-batch TRL's ``_prepare_inputs`` already produced (generated, scored, sliced) for this update."""


class AccumGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` (same constructor, ``GRPOConfig``, reward functions, generation) whose every optimizer
    update applies the gradient of the ``loss_type``'s formula over the update's whole batch (see the module
    docstring for each formula), on any number of ranks, for any ``steps_per_generation`` /
    ``gradient_accumulation_steps``, short last windows included. TRL's logged metrics are kept; ``kl`` is logged as
    the update's exact token mean."""

    def __init__(self, *args: Any, fused_logprobs: bool = True, **kwargs: Any) -> None:
        grpo_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if grpo_args is not None:
            refuse_inexact_settings(grpo_args)
        super().__init__(*args, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                "AccumGRPOTrainer: the MoE router auxiliary loss (router_aux_loss_coef != 0 with output_router_logits) "
                "is added by TRL as a per-micro-batch mean, which has no exact rule over an update yet; set "
                "router_aux_loss_coef=0"
            )
        self._unit = MODE_UNITS[self.loss_type]
        self._window: WindowCounts | None = None
        self._captured: list[tuple] | None = None
        self._kl_stats = DeviceSums(("kl_sum", "tokens"), self.args.device)
        self.fused_logprobs = FusedLogProbs() if fused_logprobs else None

    # -- the update's micro-batches, prepared and counted before its first backward -----------------------
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list[Any], Any]:
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples:
            return batch_samples, num_items_in_batch
        assert self.model is not None  # set by Trainer.__init__
        self.model.train()  # as training_step would; an evaluation may have left eval mode on
        prepared = self._prepare_window(batch_samples)
        self._window = self._count_window(prepared)
        return prepared, num_items_in_batch

    def _prepare_window(self, batch_samples: list) -> list[PreparedMicroBatch]:
        """TRL's ``_prepare_inputs`` for each micro-batch of the update, at the ``_step`` it would run at (it
        generates at a generation boundary and slices its buffer otherwise)."""
        start = grpo_step(self)
        prepared = []
        try:
            for offset, raw in enumerate(batch_samples):
                set_grpo_step(self, start + offset)
                prepared.append(PreparedMicroBatch(super()._prepare_inputs(raw)))
        finally:
            set_grpo_step(self, start)  # GRPOTrainer.training_step advances it, micro-batch by micro-batch
        return prepared

    def _count_window(self, micro_batches: Sequence[dict[str, Any]]) -> WindowCounts:
        counts = DeviceSums(("sequences", "tokens"), self.accelerator.device)
        for inputs in micro_batches:
            mask = loss_mask(inputs)
            counts.add(sequences=mask.shape[0], tokens=mask.sum())
        totals = counts.reduce(self.accelerator)  # the update's one all-reduce of its counts
        return WindowCounts(totals["sequences"], totals["tokens"], self.accelerator.num_processes,
                            int(self.max_completion_length or 0))

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        if isinstance(generation_batch, PreparedMicroBatch):
            return generation_batch
        return super()._prepare_inputs(generation_batch)

    # -- the loss ------------------------------------------------------------------------------------------
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Training: TRL's policy loss rescaled from TRL's divisor to the update's count, plus the KL and entropy
        terms, each ``W * sum / N`` with its own ``N``. Evaluation: TRL's own loss."""
        assert self.model is not None  # set by Trainer.__init__
        if not (self.model.training and isinstance(inputs, PreparedMicroBatch) and self._window is not None):
            with self._exact_sapo_temperatures(model):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        window = self._window
        inputs.setdefault("num_items_in_batch", torch.tensor(window.tokens, device=self.accelerator.device))
        beta, self.beta = self.beta, 0.0  # TRL adds beta * kl inside its aggregation: ours is a term of its own
        self._captured = []
        try:
            with grpo_entropy_bonus_switch(self, enabled=False), self._exact_sapo_temperatures(model):
                policy_loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.beta = beta
            captured, self._captured = self._captured, None
        if len(captured) != 1:
            raise RuntimeError(f"GRPOTrainer computed {len(captured)} log-prob passes in one compute_loss (TRL 1.16: "
                               "one); AccumGRPOTrainer cannot add its KL / entropy terms")
        per_token_logps, entropies, _ = captured[0]
        mask = loss_mask(inputs)
        # What TRL divided this micro-batch's sum by, as TRL computed it (dapo's is a float32 tensor): multiplying
        # by that same value, in float64, restores the sum exactly before it is divided by the update's count.
        divisor = torch.as_tensor(trl_grpo_divisor(self, inputs, mask), dtype=torch.float64)
        loss = policy_loss * (divisor * window.factor(self._unit)).to(policy_loss.device, policy_loss.dtype)
        if self.beta != 0.0:
            loss = loss + self.beta * self._kl_term(inputs, per_token_logps, mask, window)
        if self.entropy_coef != 0.0:
            entropy_sum = unit_sum(entropies, mask, TOKENS)
            loss = loss - self.entropy_coef * entropy_sum * window.factor(TOKENS)
        return loss

    @contextlib.contextmanager
    def _exact_sapo_temperatures(self, model: Any) -> Iterator[None]:
        """For one TRL loss call: ``sapo``'s temperatures as 0-d tensors in the loss dtype. TRL 1.16 builds them with
        ``torch.where(advantages > 0, pos, neg)`` over two Python floats, i.e. a float32 tensor (1.05 ->
        1.0499999523: 3.4e-9 from the documented formula in float64); 0-d tensors make that ``where`` take their
        dtype (the loss dtype: float64 stays float64, other dtypes compute in float32 as before)."""
        args = self.args
        names = ("sapo_temperature_pos", "sapo_temperature_neg")
        if self.loss_type != "sapo" or not all(isinstance(getattr(args, name, None), float) for name in names):
            yield
            return
        saved = {name: getattr(args, name) for name in names}
        dtype = _loss_dtype(self.accelerator.unwrap_model(model))
        try:
            for name, value in saved.items():
                setattr(args, name, torch.tensor(value, dtype=dtype))
            yield
        finally:
            for name, value in saved.items():
                setattr(args, name, value)

    def _kl_term(self, inputs: dict[str, Any], per_token_logps: torch.Tensor, mask: torch.Tensor,
                 window: WindowCounts) -> torch.Tensor:
        """``W * sum(kl) / N`` in the loss type's unit; TRL's ``k3`` estimator and its optional IS correction."""
        ref = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        args = cast(GRPOConfig, self.args)  # GRPOTrainer.__init__ makes args a GRPOConfig
        if args.use_bias_correction_kl:
            per_token_kl = per_token_kl * self._importance_weights(inputs, per_token_logps, mask)
        self._kl_stats.add(kl_sum=(per_token_kl * mask).sum().detach(), tokens=mask.sum())
        return unit_sum(per_token_kl, mask, self._unit) * window.factor(self._unit)

    def _importance_weights(self, inputs: dict[str, Any], per_token_logps: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
        """TRL's ``coef_1``: ``exp(log pi - log pi_old)`` per token, or the masked mean per sequence."""
        old = inputs.get("old_per_token_logps")
        log_ratio = per_token_logps - (per_token_logps.detach() if old is None else old)
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        return torch.exp(log_ratio)

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **model_kwargs: Any) -> Any:
        text_only = not compute_aux_loss and all(value is None for value in model_kwargs.values())
        fused = getattr(self, "fused_logprobs", None)  # (TRL may score before our constructor's end)
        result = None
        if text_only and fused is not None:
            result = self._fused_logps(fused, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                       compute_entropy)
        if result is None and text_only and _full_precision_applies(self.accelerator.unwrap_model(model)):
            result = self._full_precision_logps(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                compute_entropy)
        elif result is None:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **model_kwargs)
        captured = getattr(self, "_captured", None)  # only inside AccumGRPOTrainer.compute_loss
        if captured is not None:
            captured.append(result)
        return result

    def _fused_logps(self, fused: FusedLogProbs, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     logits_to_keep: int, batch_size: int | None,
                     compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, None] | None:
        """TRL's per-token log-probs and entropies of the completion tokens, fused (:mod:`hf_accum.fused.logprobs`);
        ``None`` when the model's head cannot be fused."""
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, am = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            # Position p predicts token p + 1: the completion's tokens are targets of the positions before them.
            targets = torch.full_like(ids, IGNORE_INDEX)
            targets[:, -logits_to_keep - 1:-1] = ids[:, -logits_to_keep:].masked_fill(
                am[:, -logits_to_keep:] == 0, IGNORE_INDEX)
            with self.accelerator.autocast():
                result = fused.token_logps(model, {"input_ids": ids, "attention_mask": am, "use_cache": False},
                                           targets, temperature=self.temperature, entropy=compute_entropy)
            if result is None:
                return None
            all_logps.append(result.logps[:, -logits_to_keep - 1:-1])
            if result.entropies is not None:
                all_entropies.append(result.entropies[:, -logits_to_keep - 1:-1])
        return torch.cat(all_logps), (torch.cat(all_entropies) if compute_entropy else None), None

    def _full_precision_logps(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              logits_to_keep: int, batch_size: int | None,
                              compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """TRL's per-token log-probs and entropies of the completion tokens, from the full logits in the model's own
        dtype (TRL's fused head accumulates in float32, a 1e-7 floor under a float64 model)."""
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, am = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            with self.accelerator.autocast():
                logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits
            # Position p predicts token p + 1: the completion's tokens are predicted by the positions before them.
            logits = logits[:, -logits_to_keep - 1:-1] / self.temperature
            log_probs = logits.log_softmax(-1)
            targets = ids[:, -logits_to_keep:]
            is_target = am[:, -logits_to_keep:].bool()
            logps = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            all_logps.append(torch.where(is_target, logps, torch.zeros_like(logps)))
            if compute_entropy:
                entropy = -(log_probs.exp() * log_probs).sum(-1)
                all_entropies.append(torch.where(is_target, entropy, torch.zeros_like(entropy)))
        entropies = torch.cat(all_entropies) if compute_entropy else None
        return torch.cat(all_logps), entropies, None

    # -- the window's end: metrics ----------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients and self._window is not None:
            self._window = None
            if self.beta != 0.0:  # TRL's kl metric (a token mean), exact over the update: one all-reduce
                totals = self._kl_stats.reduce(self.accelerator)
                trl_metrics(self, "train")["kl"].append(totals["kl_sum"] / max(totals["tokens"], 1.0))
            if self.entropy_coef != 0.0:
                trl_metrics(self, "train")["entropy_coef"].append(self.entropy_coef)
        return loss


def refuse_inexact_settings(args: Any) -> None:
    """GRPOConfig settings whose loss is not a sum over the update's units, refused before anything loads."""
    loss_type = getattr(args, "loss_type", "dapo")
    if loss_type not in MODE_UNITS:
        raise ValueError(f"AccumGRPOTrainer: loss_type={loss_type!r} is not one AccumGRPOTrainer knows; supported "
                         f"(each exact over every update): {', '.join(SUPPORTED_LOSS_TYPES)}")
    if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        raise ValueError(
            f"AccumGRPOTrainer: top_entropy_quantile={args.top_entropy_quantile} keeps the tokens above a quantile of "
            "each micro-batch's entropies, which no accumulation reproduces over an update (the quantile is not a "
            "sum); use top_entropy_quantile=1.0"
        )
    if getattr(args, "use_adaptive_entropy", False):
        raise ValueError("AccumGRPOTrainer: use_adaptive_entropy=True is not supported yet; use a fixed entropy_coef "
                         "(its bonus is exact: the update's mean per-token entropy)")


def _loss_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the per-token loss is computed in: the log-probs' (at least float32, float64 for float64)."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if output_embeddings is not None else None
    weight = getattr(head, "weight", None)
    return compute_dtype(weight.dtype) if isinstance(weight, torch.Tensor) else torch.float32


def _full_precision_applies(model: torch.nn.Module) -> bool:
    """Float64 models (text only, unfused): TRL's float32 fused head would be the precision floor."""
    output_embeddings = getattr(model, "get_output_embeddings", None)  # PreTrainedModel's (Any through nn.Module)
    head = output_embeddings() if output_embeddings is not None else None
    return head is not None and head.weight.dtype == torch.float64
