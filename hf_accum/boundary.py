"""The update boundary: what every front-end does, once per optimizer update, between the window's last
backward and the optimizer step. One implementation for the Accelerate loop (DDP and DeepSpeed steppers),
:class:`hf_accum.AccumTrainer` and :class:`hf_accum.AccumSFTTrainer`.

At the boundary (:meth:`UpdateBoundary.close`), on every rank, in lockstep:

1. mark this rank's flags in the window tally: an inf/NaN gradient, a pending stop or checkpoint request
   (:mod:`hf_accum.control`);
2. reduce the window's sums over ranks -- the ONE all-reduce of the update (loss, targets, sequences,
   padding, flags: :class:`hf_accum.accumulation.WindowTally`);
3. check that the loss counted the units the normalization was computed from (the targets of
   :func:`hf_accum.losses.token_loss.count_targets`, or the units a loss counts itself: ``count_units``, each term's);
4. decide (:func:`decide`, the only place a skip reason is chosen): apply or skip the update (no targets,
   inf/NaN), write a checkpoint (a request, a stop, the inf/NaN limit), halt (:class:`Halt`);
5. warn once, on the main process, about a skipped update.

After the step the front-end turns the decision into an :class:`~hf_accum.records.UpdateLog`
(:meth:`UpdateBoundary.record`). Every rank takes the same decision because it comes from all-reduced sums.

Before the window, front-ends that must know ``N`` ahead of backward (DeepSpeed, Trainer, the loop for a
loss of several terms) count it with :func:`count_window_units` (one all-reduce too). The scaling itself stays in
:func:`hf_accum.accumulation.exact_mean_factor`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from hf_accum.accumulation import (
    Fp32GradientAccumulator,
    WindowTally,
    WindowTotals,
    drop_gradients_,
    global_sum,
    nonfinite_flag,
)
from hf_accum.control import NonFiniteGuard, NonFiniteLossError, TrainingControl, TrainingStopped
from hf_accum.losses.sequence_norm import count_sequences
from hf_accum.losses.token_loss import LossKind, count_targets
from hf_accum.measure.noise_scale import (
    NoiseScaleReading,
    NoiseScaleTracker,
    SmallBatch,
    batch_size_advice,
    pooled_estimate,
    update_estimates,
)
from hf_accum.records import UpdateLog

NO_TARGETS = "no targets in window"
FP16_OVERFLOW = "inf/nan gradients (fp16 loss scale lowered)"
OTHER_RANK_STOP = "stop requested on another process"


class Halt(enum.Enum):
    """Why a run ends after this update (every rank agrees: it comes from the all-reduced window)."""

    STOP = "stop"
    """A stop signal or request on some rank: checkpoint, then :class:`~hf_accum.control.TrainingStopped`."""
    NONFINITE_LIMIT = "nonfinite limit"
    """``max_consecutive_nonfinite`` skipped updates in a row: checkpoint, then
    :class:`~hf_accum.control.NonFiniteLossError`."""


@dataclass(frozen=True)
class Decision:
    """What the boundary decided for one update."""

    totals: WindowTotals
    skip_reason: str = ""
    """Why no gradient is applied ('' when the update applies)."""
    save: bool = False
    """A checkpoint is due now, whatever the save schedule says (a request, a stop, the inf/NaN limit)."""
    halt: Halt | None = None
    stop_reason: str = ""
    """For :attr:`Halt.STOP`: the signal or request, as this rank knows it."""

    @property
    def applied(self) -> bool:
        return not self.skip_reason

    def overflowed(self) -> Decision:
        """The same update, skipped after the fact by fp16's GradScaler (it found inf/NaN gradients)."""
        return replace(self, skip_reason=FP16_OVERFLOW)

    def halt_error(self, guard: NonFiniteGuard, update: int, checkpoint: str | None) -> BaseException | None:
        """The exception that ends the run after this update (None when it goes on)."""
        if self.halt is Halt.NONFINITE_LIMIT:
            return guard.error(update, checkpoint)
        if self.halt is Halt.STOP:
            return TrainingStopped(self.stop_reason, update, checkpoint)
        return None


def decide(totals: WindowTotals, guard: NonFiniteGuard, control: TrainingControl | None) -> Decision:
    """Skip / save / halt for one reduced window. The only place these decisions (and skip reasons) are made."""
    if totals.nonfinite:
        # An inf/NaN loss or gradient on some rank: nothing of the window may reach the weights.
        skip_reason = totals.nonfinite_reason
    elif totals.targets == 0:
        # No mean exists; zero gradients would still let AdamW move weights via momentum and decay.
        skip_reason = NO_TARGETS
    else:
        skip_reason = ""
    halt = None
    if guard.record(totals.nonfinite):
        halt = Halt.NONFINITE_LIMIT
    elif totals.stop_requests:
        halt = Halt.STOP
    stop_reason = ((control.stop_reason if control is not None else None) or OTHER_RANK_STOP) if halt else ""
    save = bool(totals.checkpoint_requests or halt is not None)
    return Decision(totals, skip_reason, save, halt, stop_reason)


class UpdateBoundary:
    """One run's boundary state: the window tally, the inf/NaN guard, the control the requests come from.

    ``count_source`` names the user-replaceable function that counts targets (in the count check's message);
    ``steps_in_backward``: the engine applies the update inside backward (DeepSpeed), so a window with
    inf/NaN cannot be skipped and stops the run instead; ``no_targets_note`` completes the warning about
    a window without targets where the front-end cannot keep it entirely out of the weights.
    ``noise_scale``: track the gradient noise scale (:mod:`hf_accum.measure.noise_probe` measures, the window's
    all-reduce gathers every rank's small batches, :attr:`noise` keeps the moving averages);
    ``noise_micro_batches``: ``"every"`` micro-batch is a small batch, or each window's ``"first"``.
    ``extra_terms``: the names of a multi-term loss's terms after the primary one (tallied in the same all-reduce).
    """

    def __init__(
        self,
        accelerator: Any,
        control: TrainingControl,
        guard: NonFiniteGuard,
        logger: logging.Logger,
        *,
        count_source: str,
        steps_in_backward: bool = False,
        no_targets_note: str = "",
        noise_scale: bool = False,
        extra_terms: Sequence[str] = (),
        noise_micro_batches: str = "every",
    ) -> None:
        self.accelerator = accelerator
        self.control = control
        self.guard = guard
        self.logger = logger
        self.count_source = count_source
        self.steps_in_backward = steps_in_backward
        self.no_targets_note = no_targets_note
        self.noise_every = noise_scale and noise_micro_batches == "every"
        """The noise scale's small batches are every micro-batch (else each window's first, per rank)."""
        slots = accelerator.num_processes if noise_scale and not self.noise_every else 0
        self.tally = WindowTally(device=accelerator.device, small_batch_slots=slots, extra_terms=extra_terms,
                                 pooled_small_batches=self.noise_every)
        self.noise: NoiseScaleTracker | None = NoiseScaleTracker() if noise_scale else None
        self.model_flops: Callable[[WindowTotals], float] | None = None
        """The front-end's ``totals -> model FLOPs`` (:meth:`hf_accum.measure.utilization.ModelFlops.window_flops`);
        each record carries the update's count (None: not counted)."""

    def add(self, loss_sum: torch.Tensor, n_targets: torch.Tensor, batch: Mapping[str, Any],
            aux_sum: torch.Tensor | None = None) -> None:
        """One micro-batch's summed loss, its target count and its shape (on the device: no host sync);
        ``aux_sum``: the part of ``loss_sum`` that is the model's extra terms (MoE router loss), logged apart."""
        self.tally.add(loss_sum, n_targets, batch, aux_sum=aux_sum)

    def add_small_batch(self, n_targets: torch.Tensor | int, grad_sq: torch.Tensor) -> None:
        """This rank's noise-scale small batch of the window
        (:func:`hf_accum.measure.noise_probe.small_batch_grad_sq`)."""
        targets = torch.as_tensor(n_targets).to(self.tally.device, torch.float64)
        self.tally.add_small_batch(self.accelerator.process_index, targets, grad_sq)

    def add_micro_batch_small(self, n_targets: torch.Tensor | int, grad_sq: torch.Tensor) -> None:
        """Every-micro-batch mode: one micro-batch of this rank
        (:func:`hf_accum.measure.noise_probe.micro_batch_grad_sq`)."""
        targets = torch.as_tensor(n_targets).to(self.tally.device, torch.float64)
        self.tally.add_micro_batch_small(targets, grad_sq)

    def measure_noise(self, decision: Decision, big_grad_sq: float | None) -> NoiseScaleReading | None:
        """Fold one update into the noise-scale averages: its small batches (every rank's, from the window's
        all-reduce) against the applied gradient (``big_grad_sq``: its squared norm before clipping, ``B = N``).
        None when not tracking; an update that applied nothing measures nothing."""
        if self.noise is None:
            return None
        estimate = None
        if decision.applied and big_grad_sq is not None and self.noise_every:
            micro_batches, weighted = decision.totals.pooled_small_batches
            estimate = pooled_estimate(micro_batches, weighted, decision.totals.targets, big_grad_sq)
        elif decision.applied and big_grad_sq is not None:
            small = [SmallBatch(targets, grad_sq) for targets, grad_sq in decision.totals.small_batches]
            estimate = update_estimates(small, decision.totals.targets, big_grad_sq)
        return self.noise.observe(estimate)

    def noise_advice(self, updates: Iterable[UpdateLog]) -> str | None:
        """The end-of-run line comparing the applied updates' mean size with the measured noise scale."""
        if self.noise is None:
            return None
        sizes = [update.targets for update in updates if update.applied]
        return batch_size_advice(sum(sizes) / max(1, len(sizes)), self.noise.noise_scale)

    def reset(self) -> None:
        """Forget a half-tallied window (a retry of the training loop)."""
        self.tally.reset()

    def close(self, update: int, gradients: list[torch.Tensor | None] | None = None,
              counted: int | Sequence[int] | None = None) -> Decision:
        """The boundary of update number ``update`` (see the module docstring). ``gradients``: this rank's
        gradients to check for inf/NaN (None where the front-end cannot or need not: fp16's GradScaler checks
        them itself, DeepSpeed keeps them). ``counted``: the window's unit count the normalization used (a list:
        one per term of a multi-term loss)."""
        flag: torch.Tensor | bool = False if gradients is None else nonfinite_flag(gradients, self.tally.device)
        self.tally.mark_boundary(
            nonfinite_gradients=flag,
            stop_requested=self.control.stop_reason is not None,
            checkpoint_requested=self.control.take_checkpoint_request(),
        )
        totals = self.tally.reduce(self.accelerator)  # the update's one all-reduce
        if counted is not None:
            _check_counted(totals, counted, self.count_source)
        decision = decide(totals, self.guard, self.control)
        if totals.nonfinite and self.steps_in_backward:
            raise NonFiniteLossError(
                f"update {update}: {totals.nonfinite_reason}; DeepSpeed applies the update inside backward, so it "
                "cannot be skipped; stopping (resume from the last checkpoint after checking the data)"
            )
        self._warn(decision, update)
        return decision

    def _warn(self, decision: Decision, update: int) -> None:
        if not self.accelerator.is_main_process or decision.applied:
            return
        if decision.totals.nonfinite:
            self.logger.warning(
                "update %d: %s; skipped (weights, optimizer state and LR schedule untouched), %d in a row "
                "(limit max_consecutive_nonfinite=%d)", update, decision.skip_reason, self.guard.consecutive,
                self.guard.max_consecutive,
            )
        else:
            self.logger.warning("update %d: no prediction targets in the window; no gradient applied%s",
                                update, self.no_targets_note)

    def record(self, decision: Decision, *, step: int, epoch: float, learning_rate: float,
               grad_norm: float | None, eval_loss: float | None = None,
               noise: NoiseScaleReading | None = None) -> UpdateLog:
        """The update's log line, as every front-end reports it (``noise``: from :meth:`measure_noise`)."""
        totals = decision.totals
        noise = noise or NoiseScaleReading()
        return UpdateLog(
            step=step, epoch=epoch, loss=totals.mean_loss, learning_rate=float(learning_rate),
            grad_norm=float(grad_norm) if grad_norm is not None and decision.applied else None,
            targets=totals.targets, sequences=totals.sequences, padding_fraction=totals.padding_fraction,
            micro_batches=totals.micro_batches, applied=decision.applied, skip_reason=decision.skip_reason,
            nonfinite=totals.nonfinite, eval_loss=eval_loss,
            aux_loss=totals.mean_aux_loss if totals.aux_loss_sum else None,
            noise_scale=noise.noise_scale, grad_sq=noise.grad_sq, trace_cov=noise.trace_cov,
            flops=self.model_flops(totals) if self.model_flops is not None else None,
        )


def _check_counted(totals: WindowTotals, counted: int | Sequence[int], count_source: str) -> None:
    """The loss's own counts (summed by the tally) must be the ones the window was normalized by."""
    expected = [counted] if isinstance(counted, int) else list(counted)
    if len(expected) == 1 and totals.targets != expected[0]:
        raise ValueError(
            f"{count_source} counted {totals.targets} targets in this window but count_targets counted "
            f"{expected[0]}; the normalization uses the latter, so {count_source} must return the same count "
            "(a sum over exactly the targets of hf_accum.losses.token_loss.count_targets)"
        )
    if totals.term_counts != expected:
        raise ValueError(
            f"{count_source} counted {totals.term_counts} units (one per term) in this window but the loss's "
            f"count_units counted {expected}; the normalization uses the latter, so both must count the same units"
        )


def discard_window_(parameters: Iterable[torch.nn.Parameter], fp32_sums: Fp32GradientAccumulator | None) -> None:
    """Keep a skipped window out of the weights: no gradient anywhere, so the optimizer touches no parameter
    (AdamW's moments, step count and weight decay included)."""
    if fp32_sums is not None:
        fp32_sums.clear()
    drop_gradients_(parameters)


UnitCounter = Callable[[Mapping[str, Any]], torch.Tensor]
"""``batch -> count`` (0-d) or ``counts[J]`` (one per term of a multi-term loss), from the batch alone."""


def default_unit_counter(kind: LossKind, normalization: str = "token") -> UnitCounter:
    """The units of the built-in losses: prediction targets (``token``), or sequences with at least one target
    (``sequence``, what the sequence-weighted loss reports, :mod:`hf_accum.losses.sequence_norm`)."""
    if normalization == "sequence":
        return count_sequences
    return lambda batch: count_targets(batch["labels"], kind)


def count_window_units(batches: Iterable[Mapping[str, Any]], count_units: UnitCounter, accelerator: Any) -> list[int]:
    """Each term's units in the window's micro-batches on every rank, counted before any forward: one
    all-reduce per window (summed on the device, one host sync). One entry per term (one for a single-term loss)."""
    local: torch.Tensor | None = None
    for batch in batches:
        if "labels" not in batch:
            raise KeyError(f"batch has no 'labels' (keys: {sorted(batch)}); the collator must provide them")
        count = torch.as_tensor(count_units(batch)).to(accelerator.device, torch.float64).reshape(-1)
        local = count if local is None else local + count
    if local is None:
        local = torch.zeros(1, dtype=torch.float64, device=accelerator.device)
    return [int(round(value)) for value in global_sum(local, accelerator).tolist()]


def count_window_targets(batches: Iterable[Mapping[str, Any]], kind: LossKind, accelerator: Any,
                         normalization: str = "token") -> int:
    """Targets (sequences with ``normalization='sequence'``) in the window's micro-batches on every rank:
    :func:`count_window_units` with the built-in losses' unit."""
    return count_window_units(batches, default_unit_counter(kind, normalization), accelerator)[0]
