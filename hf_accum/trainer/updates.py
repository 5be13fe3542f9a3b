"""AccumTrainer's update records: every update as an :class:`~hf_accum.records.UpdateLog`, whatever
``logging_steps`` is, built by the boundary from its decision.

Trainer closes an update in ``_maybe_log_save_evaluate`` (log, evaluate, save), after the optimizer step. The
record is made *after* that call, so that an evaluation it ran is part of the record -- and a checkpoint it
wrote includes the update being closed (:meth:`UpdateRecorder.history`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import torch

from hf_accum.boundary import Decision, UpdateBoundary
from hf_accum.measure.noise_scale import NoiseScaleReading
from hf_accum.measure.utilization import UtilizationMeter
from hf_accum.records import UpdateLog


class UpdateRecorder:
    def __init__(self, boundary: UpdateBoundary, on_update: Callable[[UpdateLog], None] | None) -> None:
        self.boundary = boundary
        self.on_update = on_update
        self.updates: list[UpdateLog] = []
        """Every update of the run; a resumed run's include those before its checkpoint."""
        self._closing: Decision | None = None
        self._grad_norm: float | None = None
        self._learning_rate: float | None = None
        self.eval_loss: float | None = None
        """The exact held-out loss an evaluation of the update being closed found."""
        self.noise: NoiseScaleReading | None = None
        """The noise-scale reading of the update being closed (None when not tracked)."""
        self.meter: UtilizationMeter | None = None
        """Times every update and fills its FLOP/s and MFU (set by ``AccumTrainer.train``)."""
        self._timing: dict[str, float | None] = {}
        """The closing update's time, FLOP/s and MFU (taken when it starts closing, before Trainer logs)."""

    def window_opened(self) -> None:
        """A window's micro-batches were fetched: the first one starts the meter's clock."""
        if self.meter is not None and not self.meter.started:
            self.meter.start()

    def utilization_logs(self) -> dict[str, float]:
        """FLOP/s and MFU over the updates since the last log line, for Trainer's log line."""
        return self.meter.take_interval() if self.meter is not None else {}

    def start(self, resumed: list[dict]) -> None:
        self.updates = [UpdateLog(**update) for update in resumed]
        self._closing, self._timing = None, {}

    def window_closed(self, decision: Decision) -> None:
        """The boundary decided on the window Trainer is about to step (or skip)."""
        self._closing = decision

    def closing(self, grad_norm: torch.Tensor | float | None, learning_rate: float | None,
                unclipped_grad_sq: float | None = None) -> None:
        """Trainer starts closing the update (its norm before clipping and LR are known now); the noise
        scale folds the update in once (the big batch: that norm, or ``unclipped_grad_sq`` without clipping)."""
        grad_norm = float(grad_norm) if grad_norm is not None else None
        self._grad_norm, self._learning_rate = grad_norm, learning_rate
        self.eval_loss = None
        if self._closing is not None:
            big = grad_norm ** 2 if grad_norm is not None else unclipped_grad_sq
            self.noise = self.boundary.measure_noise(self._closing, big)
            self._lap(self._closing)

    def _lap(self, decision: Decision) -> None:
        """Time the closing update now (its optimizer step is done), so Trainer's log line can carry its MFU."""
        if self.meter is None:
            return
        count = self.boundary.model_flops
        self._timing = self.meter.lap(count(decision.totals) if count is not None else None)

    def noise_logs(self) -> dict[str, float]:
        """The noise-scale numbers of the update being closed, for Trainer's log line."""
        if self.noise is None:
            return {}
        values = {"noise_scale": self.noise.noise_scale, "grad_sq": self.noise.grad_sq,
                  "trace_cov": self.noise.trace_cov}
        return {name: value for name, value in values.items() if value is not None}

    def closing_update(self, step: int, epoch: float, current_lr: Callable[[], float]) -> UpdateLog | None:
        """The log of the update Trainer is closing (None at an epoch end without a new window)."""
        if self._closing is None:
            return None
        learning_rate = self._learning_rate if self._learning_rate is not None else current_lr()
        update = self.boundary.record(self._closing, step=step, epoch=epoch, learning_rate=learning_rate,
                                      grad_norm=self._grad_norm, eval_loss=self.eval_loss, noise=self.noise)
        for name, value in self._timing.items():
            setattr(update, name, value)
        return update

    def commit(self, step: int, epoch: float, current_lr: Callable[[], float]) -> None:
        """Record the update Trainer just closed, and hand it to ``on_update``."""
        update = self.closing_update(step, epoch, current_lr)
        self._closing, self._timing = None, {}
        if update is not None:
            self.updates.append(update)
            if self.on_update is not None:
                self.on_update(update)

    def history(self, step: int, epoch: float, current_lr: Callable[[], float]) -> list[dict]:
        """Every update so far, the one being closed included (a checkpoint is written before it is recorded)."""
        closing = self.closing_update(step, epoch, current_lr)
        return [asdict(update) for update in self.updates + ([closing] if closing is not None else [])]
