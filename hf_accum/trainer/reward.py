"""AccumRewardTrainer: TRL's ``RewardTrainer`` whose every update applies the big batch's gradient of the mean
over ALL its preference pairs.

This module owns the pairwise reward-model loss of one micro-batch (:class:`RewardPairLoss`, a ``(sum, count)``
over pairs; also a ``loss_sum_fn`` for :func:`hf_accum.train` on micro-batches from TRL's
``DataCollatorForPreference`` wrapped by :class:`RewardPairLabels`) and its composition with TRL's
``RewardTrainer``. TRL keeps what it owns: dataset preparation (implicit or explicit prompt, chat templates, EOS,
``max_length`` filtering), its collator (chosen rows
``[0, P)``, rejected rows ``[P, 2P)``, an optional ``margin`` per pair), the sequence-classification model
(``num_labels=1``), PEFT, model cards. AccumTrainer owns the normalization: the window's pairs are counted on
all ranks before any forward and each micro-batch backpropagates ``loss_sum * W / P_update``
(:mod:`hf_accum.trainer.window`).

The loss, TRL 1.16's (``reward_trainer.py``, ``compute_loss``), per pair ``p`` with rewards ``c_p`` (chosen) and
``r_p`` (rejected), margin ``m_p`` (0 without one) and ``center_rewards_coefficient`` ``a`` (0 when None)::

    l_p = -log sigmoid(c_p - r_p - m_p) + a * (c_p + r_p)^2,     L = (1 / P) * sum_p l_p

Both terms are means over the same pairs in TRL (``torch.mean`` over the ``P`` values ``(c_p + r_p)^2``: the
centering term is per pair, not per reward), so they share one unit, the pair, and one count.

Why it is needed: TRL takes each micro-batch's *mean* over its pairs and divides it by K (a pair weighs
``1 / (K * P_k)`` instead of ``1 / P``: wrong whenever micro-batches or ranks hold different numbers of pairs), and
its metrics all-gather per-micro-batch tensors, which fails (gloo size mismatch) when ranks hold different numbers
of pairs (``even_batches=False``).

What the composition repairs:

* the batches: :class:`RewardPairLabels` gives each micro-batch ``labels[P]`` (1: a counted pair; AccumTrainer
  counts units from ``labels``, and an evaluation pair that Accelerate repeated to even out the ranks is masked
  -100 there, so the exact ``eval_loss`` counts it once) and takes the margins again from the examples in float64
  (TRL's collator builds them in float32);
* the metrics: ``accuracy``, ``margin`` (``c - r``) and ``mean_reward`` are sums over pairs on each rank, summed
  over ranks once per update (:class:`~hf_accum.trainer.trl_metrics.UnitMeans`) and logged as pair means over the
  logged updates (``mean_reward``: over both rewards of every pair, as TRL's mean over all rewards);
  ``min_reward`` / ``max_reward`` are the extremes over the logged updates and all ranks; ``num_tokens`` counts
  the attended tokens of every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from hf_accum.errors import InputError
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.trainer.trl_metrics import MODES, ExactTrlMetrics, UnitMeans, current_mode

try:
    from trl import RewardTrainer
except ImportError as error:  # TRL is an optional extra
    raise ImportError("AccumRewardTrainer needs TRL: pip install 'hf_accum[trl]'") from error

IGNORE_INDEX = -100
COUNTED = 1
"""``labels[p]`` of a pair the loss counts (-100: not counted)."""
_METRICS = ("accuracy", "margin", "mean_reward")


class RewardPairLoss:
    """``loss_sum_fn(outputs, labels, inputs)`` for micro-batches of reward-model pairs (module docstring).

    ``outputs.logits`` is ``[2P, 1]`` (or ``[2P]``): rows ``[0, P)`` the chosen, ``[P, 2P)`` the rejected
    completions' rewards; ``labels[P]`` marks the counted pairs (:data:`COUNTED`; -100: left out);
    ``inputs["margin"]`` (``[P]``, optional) is TRL's margin. Returns ``(sum over counted pairs of l_p, counted
    pairs)``; :attr:`last_stats` holds the micro-batch's detached metric sums."""

    non_model_keys = ("margin",)
    term_names = ("pair",)
    # The first-micro-batch probe compares the model's own ``forward(labels=...)`` loss with ours; a reward model's
    # own loss is a regression on the labels, not this pairwise loss: nothing to compare (hf_accum.losses.micro_batch).
    compares_model_loss = False

    def __init__(self, center_rewards_coefficient: float | None = None) -> None:
        self.center_rewards_coefficient = center_rewards_coefficient
        self.last_stats: dict[str, torch.Tensor] | None = None

    def count_units(self, labels: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
        """The pairs :meth:`__call__` counts, from the labels alone (before any forward)."""
        return labels.ne(IGNORE_INDEX).sum().to(torch.float64)

    def __call__(self, outputs: Any, labels: torch.Tensor,
                 inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        rewards = outputs.logits.reshape(-1)
        pairs = labels.shape[0]
        if rewards.shape[0] != 2 * pairs:
            raise ValueError(f"a reward micro-batch holds chosen rows then rejected rows (2 x {pairs} pairs); the "
                             f"model gave {rewards.shape[0]} rewards")
        chosen, rejected = rewards[:pairs], rewards[pairs:]
        counted = labels.to(rewards.device).ne(IGNORE_INDEX)
        losses = pair_reward_losses(chosen, rejected, inputs.get("margin"), self.center_rewards_coefficient)
        self.last_stats = reward_stats(chosen, rejected, counted)
        return losses.masked_fill(~counted, 0.0).sum(), counted.sum().to(torch.float64)


def pair_reward_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """TRL 1.16's per-pair reward-model loss ``Tensor[pairs]`` (module docstring)."""
    delta = chosen - rejected
    if margin is not None:
        delta = delta - torch.as_tensor(margin, device=delta.device).to(delta.dtype)
    losses = -F.logsigmoid(delta)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


@torch.no_grad()
def reward_stats(chosen: torch.Tensor, rejected: torch.Tensor, counted: torch.Tensor) -> dict[str, torch.Tensor]:
    """Detached float64 sums over the counted pairs of TRL's reward metrics, and their extremes (on the device)."""
    chosen, rejected = chosen.detach().double(), rejected.detach().double()
    weight = counted.double()
    both = torch.cat([chosen, rejected])[torch.cat([counted, counted])]
    return {
        "pairs": weight.sum(),
        "accuracy": ((chosen > rejected).double() * weight).sum(),
        "margin": ((chosen - rejected) * weight).sum(),
        "mean_reward": ((chosen + rejected) / 2 * weight).sum(),  # per pair: a mean over its two rewards
        "max_reward": both.max() if both.numel() else chosen.new_tensor(-torch.inf),
        "min_reward": both.min() if both.numel() else chosen.new_tensor(torch.inf),
    }


class RewardPairLabels:
    """Wraps TRL's reward collator: adds ``labels[P]`` (every pair counted) and takes ``margin`` again from the
    examples in float64 (TRL's collator builds it in float32, a ~1e-8 relative floor under float64 checks)."""

    def __init__(self, collator: Callable) -> None:
        self.collator = collator

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return with_pair_labels(self.collator(examples), examples)


def with_pair_labels(batch: dict[str, Any], examples: list[dict] | None = None) -> dict[str, Any]:
    """``batch`` in :class:`RewardPairLabels`' layout (``labels`` kept when present)."""
    if "labels" not in batch:
        pairs = batch["input_ids"].shape[0] // 2
        batch["labels"] = torch.full((pairs,), COUNTED, dtype=torch.long, device=batch["input_ids"].device)
    if examples and "margin" in batch and all("margin" in example for example in examples):
        batch["margin"] = torch.tensor([float(example["margin"]) for example in examples], dtype=torch.float64)
    return batch


class AccumRewardTrainer(ExactTrlMetrics, RewardTrainer):  # type: ignore[misc]  # TRL types loss_is_scaled_for_ga
    """``trl.RewardTrainer`` whose every update applies the exact big-batch gradient of the mean pair loss.

    Same constructor as ``RewardTrainer`` (a ``num_labels=1`` sequence-classification model or its name,
    ``RewardConfig``, datasets in TRL's preference formats, ``processing_class``, ``peft_config``, ...), plus
    AccumTrainer's options. The update's loss is the mean over ALL its pairs (all micro-batches, all ranks, short
    last windows, uneven ranks with ``accelerator_config={"even_batches": False}``) of
    ``-log sigmoid(c - r - margin) + center_rewards_coefficient * (c + r)^2``; TRL's metrics are exact over the
    logged updates (module docstring)."""

    metric_tallies: dict[str, _RewardMetrics]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data_collator = RewardPairLabels(self.data_collator)
        self.metric_tallies = {mode: _RewardMetrics(self.args.device) for mode in MODES}

    def _build_micro_batch_loss(self, loss_kind: Any, fused_loss: bool, normalization: str = "token") -> MicroBatchLoss:
        """Called by AccumTrainer's constructor: the pair loss on the model's rewards (the logits path)."""
        if normalization != "token":
            raise InputError(f"AccumRewardTrainer(normalization={normalization!r}): the reward loss is normalized "
                             "per pair (allowed: 'token', the default)")
        if loss_kind not in (None, "sequence"):
            raise InputError(f"AccumRewardTrainer(loss_kind={loss_kind!r}): a reward model scores sequences "
                             "(allowed: 'sequence')")
        self.reward_loss = RewardPairLoss(getattr(self.args, "center_rewards_coefficient", None))  # a RewardConfig
        return MicroBatchLoss("sequence", loss_sum_fn=self.reward_loss, fused=False)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """AccumTrainer's loss (the pair sum, scaled once per window); the metric sums recorded on the side."""
        inputs = {**with_pair_labels(dict(inputs)), "use_cache": False}  # as TRL: no cache in a training forward
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        stats = self.reward_loss.last_stats
        if stats is not None:
            tokens = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
            self.metric_tallies[current_mode(self)].add(stats, tokens)
        return result


class _RewardMetrics:
    """TRL's reward metrics of one mode: pair means (:class:`~hf_accum.trainer.trl_metrics.UnitMeans`) and the reward
    extremes ``(max, -min)``, per rank on the device until the update's end, then over all ranks since the last
    log line."""

    def __init__(self, device: torch.device | str) -> None:
        self._means = UnitMeans("pairs", {name: name for name in _METRICS}, device)
        self._pending = torch.full((2,), -torch.inf, dtype=torch.float64, device=device)
        self._logged = torch.full((2,), -torch.inf, dtype=torch.float64)

    def add(self, stats: dict[str, torch.Tensor], tokens: torch.Tensor | int) -> None:
        self._means.add(**{name: stats[name] for name in ("pairs", *_METRICS)}, tokens=tokens)
        extremes = torch.stack([stats["max_reward"], -stats["min_reward"]]).to(self._pending)
        self._pending = torch.maximum(self._pending, extremes)

    def reduce(self, accelerator: Any) -> float:
        """Fold this rank's pending values, over all ranks, into the logged ones; returns the update's tokens on
        all ranks. Collectives (one sum, one gather of two numbers): every rank must call it."""
        tokens = self._means.reduce(accelerator)
        gathered = accelerator.gather(self._pending.unsqueeze(0)).reshape(-1, 2)
        self._logged = torch.maximum(self._logged, gathered.amax(0).cpu())
        self._pending = torch.full_like(self._pending, -torch.inf)
        return tokens

    def take(self) -> dict[str, float]:
        """TRL's metrics over the logged updates (then cleared); empty when no pair was seen."""
        metrics = self._means.take()
        if metrics:
            metrics.update(max_reward=float(self._logged[0]), min_reward=-float(self._logged[1]))
        self._logged.fill_(-torch.inf)
        return metrics

    def reset(self) -> None:
        self._means.reset()
        self._pending = torch.full_like(self._pending, -torch.inf)
        self._logged.fill_(-torch.inf)
