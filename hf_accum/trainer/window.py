"""AccumTrainer's window: counting it before any forward, scaling each micro-batch's loss, closing it through
the one :class:`~hf_accum.boundary.UpdateBoundary`, and keeping a skipped window out of the weights.

Trainer pre-fetches the window's K micro-batches (``get_batch_samples``), so ``N`` is known before the first
backward: every micro-batch backpropagates ``loss_sum * W / N``. DDP averages over ``W`` ranks, so the applied
gradient is ``grad(sum of every target's loss) / N`` -- one big batch -- and because the loss is scaled *before*
backward (not the gradients after), this also holds under DeepSpeed/FSDP, which keep gradients out of reach.
The unit is whatever the loss counts (targets, sequences, preference pairs: ``count_units``); a loss of several
terms backpropagates ``sum_j S_jk * W / N_j`` (:func:`hf_accum.accumulation.combine_terms`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from hf_accum.accumulation import (
    Fp32GradientAccumulator,
    WindowTotals,
    combine_terms,
    exact_mean_factor,
    low_precision_parameters,
    rescale_gradients_,
    term_factors,
)
from hf_accum.boundary import Decision, UnitCounter, UpdateBoundary, count_window_units, discard_window_
from hf_accum.control import NonFiniteGuard, TrainingControl
from hf_accum.measure.noise_probe import MicroBatchGradNorms, micro_batch_grad_sq, small_batch_grad_sq, squared_norm
from hf_accum.settings import AccumulationSettings

logger = logging.getLogger("hf_accum.trainer")

_DEEPSPEED_NO_TARGETS = (
    # The engine steps inside backward, before the boundary: it applied a zero gradient.
    " (DeepSpeed stepped with a zero gradient: momentum and weight decay still moved the weights, and "
    "the LR schedule advanced one step)"
)


class TrainerWindow:
    """One run's window state: the target count of the window in flight, the boundary, the fp32 sums of
    low-precision weights, and the totals the logs report."""

    def __init__(self, accelerator: Any, control: TrainingControl, settings: AccumulationSettings, deepspeed: bool,
                 fsdp: bool, clips: bool = True, extra_terms: tuple[str, ...] = (), unit: str = "target") -> None:
        self.accelerator = accelerator
        self.deepspeed = deepspeed
        self.fsdp = fsdp
        self.boundary = UpdateBoundary(
            accelerator, control, NonFiniteGuard(settings.max_consecutive_nonfinite), logger,
            count_source="loss_sum_and_count", steps_in_backward=deepspeed,
            no_targets_note=_DEEPSPEED_NO_TARGETS if deepspeed else "", noise_scale=settings.noise_scale,
            extra_terms=extra_terms, noise_micro_batches=settings.noise_scale_micro_batches,
        )
        self.micro_norms: MicroBatchGradNorms | None = None
        """Noise scale from every micro-batch: the hooks measuring each backward's own gradient."""
        self.clips = clips
        """Trainer clips (``max_grad_norm`` > 0), so its norm before clipping is the noise scale's big batch."""
        self.normalization = settings.normalization
        """``token`` or ``sequence``: the unit the window is counted in (:mod:`hf_accum.losses.sequence_norm`)."""
        self.first_pending = False
        """Noise scale: the window's first micro-batch has not been measured yet."""
        self.micro_batch_targets: torch.Tensor | int = 0
        """The targets of the micro-batch whose backward just ran."""
        self.unclipped_grad_sq: float | None = None
        """Noise scale without clipping: the applied gradient's squared norm (measured at the boundary)."""
        self.targets = 0
        """The window's global target count (``num_items_in_batch``; a multi-term loss: its primary term's)."""
        self.counts: list[int] = [0]
        """Every term's global count of the window (one entry for a single-term loss)."""
        self.fp32_sums: Fp32GradientAccumulator | None = None
        self.skip_step = False
        """This update's window was skipped (no targets, inf/NaN): Trainer must not step the LR scheduler."""
        self.unit = unit
        """The primary term's unit (``target``, ``sequence``, ``pair``): names the logged update size."""
        self.interval = LogInterval(unit)
        self.run_totals = WindowTotals()
        """Every window trained by this ``train()`` call: the exact final ``train_loss``."""
        self.decision: Decision | None = None
        """The boundary's decision on the window being stepped, until Trainer's step ends."""
        self.halting: Decision | None = None
        """The decision that ends the run (a stop, the inf/NaN limit), once one did."""

    def new_run(self) -> None:
        """At ``train()``: no halt, no pending decision, no inf/NaN streak carried from an earlier call."""
        self.decision = self.halting = None
        self.skip_step = False
        self.boundary.guard.consecutive = 0

    def step_ended(self) -> Decision | None:
        """Trainer's step is over: the decision it carried out (what to save or stop), cleared."""
        decision, self.decision = self.decision, None
        return decision

    def start(self) -> None:
        """At the start of every (re)try of the training loop: an OOM retry must not inherit a half-tallied window."""
        self.boundary.reset()
        self.interval = LogInterval(self.unit)
        self.run_totals = WindowTotals()
        if self.fp32_sums is not None:
            self.fp32_sums.clear()
        if self.micro_norms is not None:
            self.micro_norms.reset()

    # -- before and during the window ---------------------------------------------------------------------
    def count(self, batches: list[dict[str, Any]], count_units: UnitCounter) -> int:
        """The window's units on all ranks -- ALWAYS summed over ranks, also when
        ``average_tokens_across_devices=False`` (where stock Trainer divides by each rank's own count and DDP
        then averages differently-normalized gradients). Every rank joins this all-reduce once per window."""
        self.counts = count_window_units(batches, count_units, self.accelerator)
        self.targets = self.counts[0]
        self.first_pending = True
        return self.targets  # a Python int: no device sync per micro-batch in compute_loss

    def loss_factor(self, window_targets: int | torch.Tensor) -> float:
        """What a micro-batch's summed loss is multiplied by before backward."""
        return self._backward_scale(self._window_scale(window_targets))

    def scaled_loss(self, loss_sum: torch.Tensor, window_targets: int | torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss to backpropagate: ``loss_sum * W / N`` (:meth:`loss_factor`), or for a loss of
        several terms ``sum_j S_j * W / N_j`` (exact factors: no fp32-sum remainder, :meth:`_write_fp32_sums`)."""
        if loss_sum.dim() == 0:
            return loss_sum * self.loss_factor(window_targets)
        if not self.targets:  # no mean: zero keeps every rank's backward (and DDP's collectives) in step
            return loss_sum.sum() * 0.0
        return combine_terms(loss_sum, term_factors(self.counts, self.accelerator.num_processes))

    def _window_scale(self, window_targets: int | torch.Tensor) -> float:
        """``W / N`` from the core; 0 for a window without targets (its gradients are dropped later,
        multiplying by 0 keeps every rank's backward -- and DDP's collectives -- in step)."""
        n = int(window_targets)
        return exact_mean_factor(n, self.accelerator.num_processes) if n > 0 else 0.0

    def _backward_scale(self, window_scale: float) -> float:
        """``W / N`` itself, except with fp32 gradient sums, where the power of two nearest to it (exact in any
        binary float, so the bf16 backward rounds exactly as it would for the plain sum) and the remaining
        factor is applied to the fp32 sums when the window closes -- the loop's arithmetic, and mean-sized
        gradients for fp16."""
        if self.fp32_sums is None or window_scale == 0.0:
            return window_scale
        return 2.0 ** round(math.log2(window_scale))

    def after_backward(self, model: torch.nn.Module) -> None:
        """Noise scale. A micro-batch's gradient (as the hooks summed it, or alone in the buffers) is
        ``loss_factor * grad(loss_sum)`` (Trainer's Accelerator has K = 1, so backward adds no ``1 / K``; fp16 adds
        the GradScaler's scale), so dividing by that factor times ``n_k`` gives its per-target mean gradient.
        ``"every"``: each micro-batch, from the hooks (:meth:`attach_noise_hooks`). ``"first"``: the window's first
        micro-batch, alone in this rank's buffers (Trainer runs it in ``no_sync``); a window of one micro-batch on
        this rank measures nothing."""
        if self.boundary.noise is None:
            return
        scale = self.loss_factor(self.targets)
        if self.accelerator.scaler is not None:
            scale *= float(self.accelerator.scaler.get_scale())
        if self.micro_norms is not None:
            grad_sq = micro_batch_grad_sq(self.micro_norms.take(), scale, self.micro_batch_targets,
                                          self.accelerator.device)
            self.boundary.add_micro_batch_small(self.micro_batch_targets, grad_sq)
            return
        if not self.first_pending:
            return
        self.first_pending = False
        if self.accelerator.sync_gradients:
            return
        buffers = [p.grad for p in model.parameters()]
        if self.fp32_sums is not None:  # bf16 weights: the micro-batch's gradient sits in the fp32 sums
            buffers += self.fp32_sums.pending_sums()
        grad_sq = small_batch_grad_sq(buffers, scale, self.micro_batch_targets, self.accelerator.device)
        self.boundary.add_small_batch(self.micro_batch_targets, grad_sq)

    # -- at the boundary ----------------------------------------------------------------------------------
    def close(self, model: torch.nn.Module, update: int) -> Decision:
        """The window's last micro-batch: the boundary decides; a skipped window is kept out of the weights."""
        gradients = None
        if self.accelerator.scaler is None and not self.deepspeed:
            # fp16's GradScaler skips inf/NaN gradients itself; DeepSpeed keeps gradients inside its engine.
            gradients = [p.grad for p in model.parameters()]
        decision = self.boundary.close(update, gradients, counted=self.counts if len(self.counts) > 1 else self.targets)
        self.decision = decision
        if decision.halt is not None:
            self.halting = decision
        self.unclipped_grad_sq = None
        if decision.applied:
            if self.fp32_sums is not None:
                self._write_fp32_sums(model)
            if self.boundary.noise is not None and not self.clips:  # no clip computes the norm for us
                self.unclipped_grad_sq = float(squared_norm([p.grad for p in model.parameters()],
                                                            self.accelerator.device))
        else:
            self._keep_out_of_weights(model)
        if decision.totals.nonfinite:
            self.interval.add_nonfinite()
        else:
            self.interval.add(decision.totals)
            self.run_totals.add(decision.totals)
        return decision

    def _write_fp32_sums(self, model: torch.nn.Module) -> None:
        """The window's fp32 gradient sums -> ``.grad``, times what ``_backward_scale`` left of ``W / N``."""
        window_scale = self._window_scale(self.targets)
        remainder = window_scale / self._backward_scale(window_scale) if len(self.counts) == 1 else 1.0
        assert self.fp32_sums is not None  # called when the window has fp32 sums
        self.fp32_sums.write_gradients_(remainder)  # rounded once to the weights' dtype
        rescale_gradients_(self.fp32_sums.other_parameters(model.parameters()), remainder)

    def _keep_out_of_weights(self, model: torch.nn.Module) -> None:
        """Without a GradScaler: drop the gradients (the optimizer then touches no parameter: AdamW's moments
        and step count stay) and tell Trainer the step was skipped (no LR scheduler step). Under fp16 the
        GradScaler insists on seeing gradients: it gets the window as an overflow and skips the step and the
        scheduler itself (and lowers its scale, as after any overflow)."""
        if self.accelerator.scaler is not None:
            if self.fp32_sums is not None:
                self.fp32_sums.clear()
            poison_gradients_(model)
        else:
            discard_window_(model.parameters(), self.fp32_sums)
            self.skip_step = True

    def take_interval_logs(self) -> dict[str, float]:
        """The exact loss and shape of the updates since the last log line ({} when none), then start over."""
        if not self.interval.updates:
            return {}
        logs, self.interval = self.interval.as_logs(), LogInterval(self.unit)
        return logs

    # -- fp32 sums of low-precision weights ---------------------------------------------------------------
    def attach_fp32_sums(self, model: torch.nn.Module) -> None:
        """bf16/fp16 weights: sum the window's micro-batch gradients in fp32, round once at its end (as the loop
        does). Not under DDP/DeepSpeed/FSDP, which own the gradient buffers."""
        if self.fp32_sums is not None or not low_precision_parameters(model.parameters()):
            return
        if self.accelerator.num_processes > 1 or self.deepspeed or self.fsdp:
            logger.info("low-precision weights: gradients accumulate in their own dtype (fp32 accumulation is "
                        "single-process only)")
            return
        self.fp32_sums = Fp32GradientAccumulator(p for p in model.parameters() if p.requires_grad)

    def attach_noise_hooks(self, model: torch.nn.Module) -> None:
        """Noise scale from every micro-batch: hooks on the trainable parameters, for the whole ``train()``."""
        if self.boundary.noise_every and self.micro_norms is None:
            self.micro_norms = MicroBatchGradNorms(model.parameters(), self.accelerator.device)

    def detach_noise_hooks(self) -> None:
        if self.micro_norms is not None:
            self.micro_norms.remove()
            self.micro_norms = None

    def detach_fp32_sums(self) -> None:
        if self.fp32_sums is not None:
            self.fp32_sums.remove()
            self.fp32_sums = None


def poison_gradients_(model: torch.nn.Module) -> None:
    """fp16: make sure the GradScaler sees the window as an overflow (an inf/NaN loss nearly always leaves
    inf/NaN gradients already) so that it skips the step and the scheduler, as for any overflow. With no
    gradient at all it would refuse to step ("No inf checks were recorded"): one NaN gradient is made."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in trainable:
        if parameter.grad is not None:
            parameter.grad.fill_(float("nan"))
            return
    if trainable:
        trainable[0].grad = torch.full_like(trainable[0], float("nan"))


class LogInterval:
    """Window totals (already summed over ranks) since the last log line."""

    def __init__(self, unit: str = "target") -> None:
        self.unit = unit
        self.totals = WindowTotals()
        self.updates = 0
        self.skipped = 0
        self.skipped_nonfinite = 0

    def add(self, window: WindowTotals) -> None:
        self.totals.add(window)
        self.updates += 1
        self.skipped += window.targets == 0

    def add_nonfinite(self) -> None:
        """A window skipped for inf/NaN: counted, its (inf/nan) loss kept out of the interval's mean."""
        self.updates += 1
        self.skipped_nonfinite += 1

    def as_logs(self) -> dict[str, float]:
        logs = {
            # Token-weighted over the interval: with logging_steps=1, the exact mean of the window.
            "loss": self.totals.mean_loss,
            # The update's size in its primary unit (targets and sequence-mode sequences log as tokens, as always).
            _size_key(self.unit): self.totals.targets / self.updates,
            "sequences_per_update": self.totals.sequences / self.updates,
            "padding_fraction": self.totals.padding_fraction,
        }
        for name, mean in self.totals.term_means().items():  # each extra term's own mean (its part of "loss")
            logs[f"{name}_loss"] = mean
        if self.totals.aux_loss_sum:  # MoE router loss, logged apart from the cross-entropy "loss"
            logs["aux_loss"] = self.totals.mean_aux_loss
        if self.skipped:
            logs["updates_without_targets"] = self.skipped
        if self.skipped_nonfinite:
            logs["updates_skipped_nonfinite"] = self.skipped_nonfinite
        return logs


def _size_key(unit: str) -> str:
    return "tokens_per_update" if unit in ("target", "sequence") else f"{unit}s_per_update"
