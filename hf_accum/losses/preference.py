"""Preference-pair losses (DPO and its pairwise variants) as a ``(sum, count)`` per unit.

This module owns the math of one micro-batch of preference pairs, free of any trainer:

* :func:`completion_logps` -- each row's summed log-probability of its completion (labels != -100 after the
  causal shift), in the logits' own dtype (float64 stays float64: the exactness tests need it; TRL's fused head
  accumulates in float32); :func:`fused_completion_logps` the same without the logits
  (:mod:`hf_accum.fused.logprobs`, in :func:`hf_accum.losses.token_loss.compute_dtype`: float64 stays float64);
* :func:`pair_losses` -- TRL 1.16's per-pair formulas (``trl/trainer/dpo_trainer.py``, ``_compute_loss``) for
  the loss types whose value depends on one pair only: ``sigmoid``, ``hinge``, ``ipo``, ``robust``;
* :class:`DPOPairLoss` -- a ``loss_sum_fn`` for :func:`hf_accum.train` and the loss of
  :class:`hf_accum.AccumDPOTrainer`: it returns the micro-batch's SUM of per-pair losses and its number of pairs
  (and, with an ``sft`` term, that term's summed token loss over the chosen completions and their token count).
  The core divides each sum by its count over the whole update (all micro-batches, all ranks) once
  (:mod:`hf_accum.accumulation`), so the update's loss is the big batch's
  ``mean over all pairs of the pair loss + sft_weight * mean over all chosen tokens of -log p``;
* :func:`collate_pairs` -- the micro-batch layout :class:`DPOPairLoss` reads: rows ``[0, P)`` are the chosen and
  rows ``[P, 2P)`` the rejected completions of the same ``P`` prompts, ``labels`` -100 outside the completions.

Loss types that depend on the whole batch (``aot``, ``aot_unpaired``: sorted over the batch; KTO's KL estimate)
are not sums over pairs: no accumulation reproduces them without a window-level pass, so they are refused.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hf_accum.fused.logprobs import FusedLogProbs

IGNORE_INDEX = -100

PAIR_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
"""Loss types whose per-pair value depends on that pair only (a sum over pairs is exact under accumulation)."""
TOKEN_LOSS_TYPES = ("sft",)
"""Loss types summed over the chosen completions' tokens (the ``sft`` term: a token mean over the update)."""
SUPPORTED_LOSS_TYPES = PAIR_LOSS_TYPES + TOKEN_LOSS_TYPES
REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
"""Batch keys holding the reference log-probs: inputs of the loss, never of the model's forward."""


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_sum[rows], n_targets[rows])``: each row's summed ``log p(label)`` over its prediction targets.

    Position ``i`` predicts label ``i + 1`` (the causal shift); labels -100 are not targets. Computed in the
    logits' dtype (``log_softmax`` of a float64 tensor stays float64)."""
    shifted_logits = logits[:, :-1, :]
    targets = labels[:, 1:].to(logits.device)
    is_target = targets.ne(IGNORE_INDEX)
    log_probs = shifted_logits.log_softmax(-1)
    token_logps = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token_logps = token_logps.masked_fill(~is_target, 0.0)
    return token_logps.sum(-1), is_target.sum(-1)


def fused_completion_logps(fused: FusedLogProbs, model: nn.Module, inputs: dict[str, Any],
                           labels: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor] | None:
    """``(outputs, logp_sum[rows], n_targets[rows])`` as :func:`completion_logps` gives them, from one forward whose
    head returns the log-probs (no ``[tokens, vocab]`` logits; ``outputs.logits`` is a marker); ``None`` when the
    model's head cannot be fused."""
    result = fused.causal_logps(model, inputs, labels)
    if result is None:
        return None
    return result.outputs, result.logps.sum(-1), labels[:, 1:].ne(IGNORE_INDEX).sum(-1).to(result.logps.device)


def pair_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """TRL 1.16's per-pair loss ``Tensor[pairs]`` (``f_divergence_type='reverse_kl'``, no WPO weighting).

    ``ipo`` divides each completion's log-ratio by its completion length (TRL's normalization, confirmed by the
    IPO authors): pass ``chosen_lengths`` / ``rejected_lengths`` (completion tokens per pair)."""
    check_loss_type(loss_type, PAIR_LOSS_TYPES)
    chosen_logratios = chosen_logps - ref_chosen_logps.to(chosen_logps)
    rejected_logratios = rejected_logps - ref_rejected_logps.to(rejected_logps)
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("pair_losses(loss_type='ipo') needs chosen_lengths and rejected_lengths (completion "
                             "tokens per pair): TRL's IPO divides each log-ratio by its completion's length")
        ipo_delta = (chosen_logratios / chosen_lengths.to(delta).clamp(min=1.0)
                     - rejected_logratios / rejected_lengths.to(delta).clamp(min=1.0))
        return (ipo_delta - 1 / (2 * beta)) ** 2
    # robust (Chowdhury et al. 2024): unbiased under a label-flip rate of label_smoothing.
    clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
    flipped = -label_smoothing * F.logsigmoid(-beta * delta)
    return (clean - flipped) / (1 - 2 * label_smoothing)


def check_loss_type(loss_type: Any, allowed: Sequence[str] = SUPPORTED_LOSS_TYPES) -> None:
    """One clear refusal for a loss type that is not a sum over pairs (or chosen tokens)."""
    if loss_type not in allowed:
        whole_batch = loss_type in ("aot", "aot_unpaired")
        why = (" depends on the whole batch (it sorts the batch's log-ratios), so no accumulation can reproduce the "
               "big batch's value" if whole_batch else " is not supported")
        raise ValueError(f"DPO loss_type={loss_type!r}{why}; supported (exact over every update): "
                         f"{', '.join(allowed)}")


def loss_terms(loss_type: str | Sequence[str], loss_weights: Sequence[float] | None = None,
               sft_weight: float = 0.0) -> tuple[dict[str, float], float]:
    """``({pair loss type: weight}, sft weight)`` from TRL's ``loss_type`` (one or a list) and ``loss_weights``."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = list(loss_weights) if loss_weights is not None else [1.0] * len(types)
    if len(weights) != len(types):
        raise ValueError(f"loss_weights={weights!r} must give one weight per loss_type {types!r}")
    pair: dict[str, float] = {}
    for name, weight in zip(types, weights):
        check_loss_type(name)
        if name in TOKEN_LOSS_TYPES:
            sft_weight += float(weight)
        else:
            pair[name] = pair.get(name, 0.0) + float(weight)
    return pair, float(sft_weight)


class DPOPairLoss:
    """``loss_sum_fn(outputs, labels, inputs)`` for micro-batches of preference pairs (:func:`collate_pairs`).

    Rows ``[0, P)`` of ``labels`` / ``outputs.logits`` are the chosen completions, rows ``[P, 2P)`` the rejected
    ones of the same prompts; ``inputs["ref_chosen_logps"]`` and ``inputs["ref_rejected_logps"]`` (``[P]``) are the
    reference model's summed completion log-probs. Returns, as the core's terms (one per unit):

    * ``sft_weight == 0`` (and no ``"sft"`` in ``loss_type``): ``(sum over pairs of the pair loss, P)``, 0-d;
    * else ``(tensor([pair_sum, sft_sum]), tensor([P, chosen targets]))``, ``sft_sum = -sft_weight * sum of the
      chosen completions' token log-probs``: two terms, each divided by its own count over the update.

    ``loss_type``: one of :data:`PAIR_LOSS_TYPES`, or TRL's list form (``["sigmoid", "sft"]``) with
    ``loss_weights``. :meth:`count_units` counts the same units from the labels alone (the front-ends that
    count a window before backward use it), :attr:`term_names` names them, :attr:`last_stats` holds the last
    micro-batch's detached sums for TRL's metrics (rewards, margins, accuracies, log-probs).

    ``fused`` (default): while training, :meth:`run_forward` runs the model with its head returning the log-probs
    (:mod:`hf_accum.fused.logprobs`: no ``[tokens, vocab]`` logits, exact to rounding in the loss dtype); a model
    whose head cannot be fused, evaluation, and ``fused=False`` take the logits path.
    """

    non_model_keys = REFERENCE_KEYS

    def __init__(self, beta: float = 0.1, loss_type: str | Sequence[str] = "sigmoid", label_smoothing: float = 0.0,
                 sft_weight: float = 0.0, loss_weights: Sequence[float] | None = None, fused: bool = True,
                 chunk_bytes: int | None = None) -> None:
        self.pair_weights, self.sft_weight = loss_terms(loss_type, loss_weights, sft_weight)
        if not self.pair_weights:
            raise ValueError(f"DPOPairLoss(loss_type={loss_type!r}) needs at least one pair loss type "
                             f"({', '.join(PAIR_LOSS_TYPES)})")
        if "robust" in self.pair_weights and not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"DPOPairLoss(label_smoothing={label_smoothing}): loss_type='robust' needs 0 <= "
                             "label_smoothing < 0.5")
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)
        self.last_stats: dict[str, torch.Tensor] | None = None
        self.fused = FusedLogProbs(chunk_bytes) if fused else None
        self._fused_logps: tuple[Any, torch.Tensor, torch.Tensor] | None = None

    @property
    def term_names(self) -> tuple[str, ...]:
        """The units of the terms this loss returns, in order."""
        return ("pair", "sft") if self.sft_weight else ("pair",)

    def count_units(self, labels: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
        """The counts :meth:`__call__` returns, from the labels alone (before any forward)."""
        pairs = _pair_count(labels)
        if not self.sft_weight:
            return torch.tensor(float(pairs), dtype=torch.float64, device=labels.device)
        chosen_targets = labels[:pairs, 1:].ne(IGNORE_INDEX).sum().to(torch.float64)
        return torch.stack([torch.tensor(float(pairs), dtype=torch.float64, device=labels.device), chosen_targets])

    def run_forward(self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor) -> Any:
        """The micro-batch's forward (:class:`~hf_accum.losses.micro_batch.MicroBatchLoss` calls it): fused log-probs
        while
        training (kept for :meth:`__call__`), else the model's own forward (logits)."""
        self._fused_logps = None
        if self.fused is not None and model.training and torch.is_grad_enabled():
            self._fused_logps = fused_completion_logps(self.fused, model, inputs, labels)
        return self._fused_logps[0] if self._fused_logps is not None else model(**inputs)

    def __call__(self, outputs: Any, labels: torch.Tensor,
                 inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = _pair_count(labels)
        fused, self._fused_logps = self._fused_logps, None
        if fused is not None and fused[0] is outputs:
            logp_sum, n_targets = fused[1], fused[2]
        else:
            logp_sum, n_targets = completion_logps(outputs.logits, labels)
        return self.from_logps(logp_sum, n_targets, inputs["ref_chosen_logps"], inputs["ref_rejected_logps"], pairs)

    def from_logps(self, logp_sum: torch.Tensor, n_targets: torch.Tensor, ref_chosen: torch.Tensor,
                   ref_rejected: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The terms from each row's summed completion log-prob and target count (chosen rows first)."""
        chosen, rejected = logp_sum[:pairs], logp_sum[pairs:]
        ref_chosen = torch.as_tensor(ref_chosen, device=chosen.device).to(chosen.dtype)
        ref_rejected = torch.as_tensor(ref_rejected, device=chosen.device).to(chosen.dtype)
        losses: torch.Tensor = sum(  # type: ignore[assignment]  # never empty: pair_weights has a loss
            weight * pair_losses(chosen, rejected, ref_chosen, ref_rejected, beta=self.beta, loss_type=name,
                                 label_smoothing=self.label_smoothing, chosen_lengths=n_targets[:pairs],
                                 rejected_lengths=n_targets[pairs:])
            for name, weight in self.pair_weights.items()
        )
        self.last_stats = pair_stats(chosen, rejected, ref_chosen, ref_rejected, self.beta)
        count = torch.tensor(float(pairs), dtype=torch.float64, device=chosen.device)
        pair_sum = losses.sum()
        if not self.sft_weight:
            return pair_sum, count
        sft_sum = -self.sft_weight * chosen.sum()
        chosen_targets = n_targets[:pairs].sum().to(torch.float64)
        return torch.stack([pair_sum, sft_sum.to(pair_sum.dtype)]), torch.stack([count, chosen_targets])


@torch.no_grad()
def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               beta: float) -> dict[str, torch.Tensor]:
    """Detached float64 sums over the micro-batch's pairs of TRL's DPO metrics (``rewards/*``, ``logps/*``), and
    ``pairs``: divided by the update's pairs they give TRL's pair means over the whole update."""
    chosen_rewards = beta * (chosen - ref_chosen).detach().double()
    rejected_rewards = beta * (rejected - ref_rejected).detach().double()
    return {
        "pairs": torch.tensor(float(chosen.shape[0]), dtype=torch.float64, device=chosen.device),
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).double().sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/chosen": chosen.detach().double().sum(),
        "logps/rejected": rejected.detach().double().sum(),
    }


def _pair_count(labels: torch.Tensor) -> int:
    rows = int(labels.shape[0])
    if rows % 2:
        raise ValueError(f"a preference micro-batch holds chosen rows then rejected rows (2 x pairs); got {rows} "
                         "rows (build it with hf_accum.losses.preference.collate_pairs)")
    return rows // 2


def collate_pairs(features: Iterable[Mapping[str, Any]], pad_token_id: int,
                  ref_dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """One micro-batch of ``P`` pairs for :class:`DPOPairLoss`: ``input_ids``, ``attention_mask``, ``labels``
    (``[2P, L]``, right-padded; chosen rows first) and, when every feature has them, ``ref_chosen_logps`` /
    ``ref_rejected_logps`` (``[P]``). Each feature holds ``chosen_input_ids``, ``chosen_labels``,
    ``rejected_input_ids``, ``rejected_labels`` (labels -100 on the prompt)."""
    features = list(features)
    rows = [(f["chosen_input_ids"], f["chosen_labels"]) for f in features]
    rows += [(f["rejected_input_ids"], f["rejected_labels"]) for f in features]
    for index, (ids, labels) in enumerate(rows):
        if len(ids) != len(labels):
            side = "chosen" if index < len(features) else "rejected"
            raise ValueError(f"pair {index % len(features)}: {side}_input_ids and {side}_labels differ in length "
                             f"({len(ids)} vs {len(labels)})")
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        labels[row, : len(ids)] = torch.as_tensor(row_labels, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if features and all(key in f for f in features for key in REFERENCE_KEYS):
        for key in REFERENCE_KEYS:
            batch[key] = torch.tensor([float(f[key]) for f in features], dtype=ref_dtype)
    return batch
