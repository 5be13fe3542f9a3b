"""TRL's logged metrics made exact over the update, once for every TRL drop-in (SFT, DPO, reward).

TRL's trainers append one value per micro-batch to ``self._metrics[mode]`` and their ``log`` averages the list:
a mean of micro-batch means, which is not the update's mean when micro-batches (or ranks) hold different numbers
of units (tokens, pairs), and whose all-gather of per-micro-batch tensors fails (gloo size mismatch) when ranks
hold different numbers of micro-batches. Each drop-in instead keeps per-rank SUMS in a :class:`MetricTally` per
mode, filled by its own ``compute_loss``; :class:`ExactTrlMetrics` reduces them over ranks once per update (on
the window's last micro-batch, where AccumTrainer syncs) and hands TRL's ``log`` one exact value per metric.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch

from hf_accum.accumulation import LoggedMeans
from hf_accum.compat import add_trl_train_tokens, trl_metrics, trl_train_tokens
from hf_accum.trainer.core import AccumTrainer

MODES = ("train", "eval")


class MetricTally(Protocol):
    """One mode's metric sums on this rank, reduced over ranks once per update."""

    def reduce(self, accelerator: Any) -> float:
        """Fold this rank's pending sums, over all ranks, into the logged totals; returns the update's input
        tokens on all ranks. A collective: every rank must call it."""

    def take(self) -> dict[str, float]:
        """TRL's metric values over the totals since the last log line (then cleared); empty when nothing was
        counted."""

    def reset(self) -> None:
        """Forget everything pending and logged (a (re)try of the training loop starts clean)."""


class UnitMeans:
    """A :class:`MetricTally` of per-unit means: ``columns`` (a summed column -> the name TRL logs its mean
    under) divided by the summed ``unit`` count (targets, pairs), and the ``tokens`` column summed."""

    def __init__(self, unit: str, columns: Mapping[str, str], device: torch.device | str) -> None:
        self._names = dict(columns)
        self._means = LoggedMeans(unit, tuple(columns), device, extra=("tokens",))

    def add(self, **sums: Any) -> None:
        self._means.add(**sums)

    def reduce(self, accelerator: Any) -> float:
        return float(self._means.reduce(accelerator)["tokens"])

    def take(self) -> dict[str, float]:
        return {self._names[column]: value for column, value in self._means.take_means().items()}

    def reset(self) -> None:
        self._means.reset()


def current_mode(trainer: Any) -> str:
    """``"train"`` or ``"eval"``, as TRL decides it: from the model's training flag."""
    return "train" if trainer.model is not None and trainer.model.training else "eval"


class ExactTrlMetrics(AccumTrainer):
    """AccumTrainer for a TRL drop-in (``class AccumXTrainer(ExactTrlMetrics, XTrainer)``): the drop-in sets
    ``self.metric_tallies`` (one :class:`MetricTally` per mode) and adds each micro-batch's sums to it; this class
    resets, reduces and logs them. ``log_eval_tokens``: whether evaluation logs carry ``num_tokens`` (TRL's SFT
    and reward trainers log it there, its DPO trainer does not)."""

    metric_tallies: Mapping[str, MetricTally]
    log_eval_tokens = True

    def get_train_dataloader(self) -> Any:
        # Called at the start of every (re)try of the training loop: an auto_find_batch_size retry after an OOM
        # must not inherit a half-counted window (AccumTrainer resets its tallies too).
        self.metric_tallies["train"].reset()
        return super().get_train_dataloader()

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        # The window's last micro-batch (as in AccumTrainer): the metrics' collectives, once per update.
        if num_items_in_batch is not None and self.accelerator.sync_gradients:
            add_trl_train_tokens(self, int(self.metric_tallies["train"].reduce(self.accelerator)))
        return loss

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        self.metric_tallies["eval"].reset()
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        self.metric_tallies["eval"].reduce(self.accelerator)  # every rank runs the evaluation loop
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Hand TRL's ``log`` (which averages ``self._metrics[mode]`` and prefixes ``eval_``) one exact value per
        metric, in place of its per-micro-batch lists."""
        mode = current_mode(self)
        metrics = self.metric_tallies[mode].take()
        trl_logged = trl_metrics(self, mode)
        trl_logged.clear()
        if metrics:
            trl_logged.update({name: [value] for name, value in metrics.items()})
            if mode == "train" or self.log_eval_tokens:
                trl_logged["num_tokens"] = [trl_train_tokens(self)]
        super().log(logs, start_time)
