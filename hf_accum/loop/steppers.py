"""The loop's two ways to run an epoch: one :class:`Step` per optimizer update, built once per run.

* :class:`AccumulateStepper` (single process, DDP, FSDP): built on ``accelerator.accumulate(model)``, which
  decides per micro-batch whether it is the window's last (every K-th, or the epoch's last) and wraps the
  others in DDP's ``no_sync``, so gradients are all-reduced once per update. Every micro-batch backpropagates
  its *summed* token loss (no look-ahead: streams and short last windows work unchanged); at the boundary the
  gradients are scaled once by ``K * W / N``, clipped, and applied.
  A loss of several terms with different units (DPO's pair term + its ``sft`` term per chosen token) needs
  ``sum_j (W / N_j) grad(S_j)``: one factor after backward cannot weigh two terms differently, and scaling per
  term would need one gradient buffer per term. Its counts depend on the labels only (``count_units``), so
  such a window is counted *before* backward instead (one look-ahead over its K micro-batches, as Trainer and
  DeepSpeed do) and each micro-batch backpropagates ``K * sum_j (W / N_j) S_jk``
  (:func:`~hf_accum.accumulation.combine_terms`); nothing is rescaled after backward.
* :class:`DeepSpeedStepper`: the engine reduces, clips and steps inside ``backward`` of the window's last
  micro-batch, so nothing can be rescaled after backward. The window is counted *before* backward instead
  (as AccumTrainer does) and the loss carries the factor.

Both close every window through the one :class:`~hf_accum.boundary.UpdateBoundary`; the scale factor is
always :func:`~hf_accum.accumulation.exact_mean_factor`.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from hf_accum.accumulation import (
    Fp32GradientAccumulator,
    WindowTotals,
    combine_terms,
    exact_mean_factor,
    global_sum,
    low_precision_parameters,
    rescale_gradients_,
    term_factors,
)
from hf_accum.boundary import Decision, UpdateBoundary, count_window_units, discard_window_
from hf_accum.compat import set_sync_gradients
from hf_accum.loop.config import LoopConfig, LoopConfigError
from hf_accum.loop.windows import PlanDriftError, check_window_targets
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.losses.token_loss import infer_loss_kind
from hf_accum.measure.noise_probe import (
    NOT_UNDER_DEEPSPEED,
    NOT_UNDER_FSDP,
    MicroBatchGradNorms,
    micro_batch_grad_sq,
    small_batch_grad_sq,
    squared_norm,
)
from hf_accum.measure.noise_scale import NoiseScaleReading

logger = logging.getLogger(__name__)

# The LR scheduler is Any: a transformers/torch LRScheduler, the auto ramp's, or what the user's factory built
# (only get_last_lr() and step() are used). A micro-batch is a Mapping[str, Any] (the collator's batch).
Batch = Mapping[str, Any]


@dataclass
class Step:
    """One optimizer update, as a stepper yields it."""

    consumed: int
    """Micro-batches of the epoch's iterable consumed once this update closed."""
    decision: Decision
    grad_norm: float | None
    learning_rate: float
    """The LR this update used (read before the scheduler stepped)."""
    noise: NoiseScaleReading | None = None
    """With ``LoopConfig.noise_scale``: this update's noise-scale reading."""


class LossMagnitude:
    """The fp16 magnitude hint: a constant of the window that multiplies every micro-batch's summed loss and
    that the boundary divides out again, so it never changes the applied gradient.

    It exists for fp16's GradScaler only: a summed loss is ~N/K times a mean, and its gradients overflow fp16
    at scales a mean's would not -- each overflow skips a whole window. It is the previous window's
    ``K * W / N`` (the same on every rank, since N is all-reduced), which makes each micro-batch's loss about a
    per-token mean; the first window takes ``W / n`` from the very first micro-batch (one extra all-reduce).
    """

    def __init__(self, active: bool) -> None:
        self.active = active
        """A GradScaler is active (fp16): it also finds and skips inf/NaN gradients itself."""
        self.value: float | None = None

    def scaled(self, loss_sum: torch.Tensor, n_targets: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
        """The loss to backpropagate: the sum, times the window's magnitude when fp16 needs one."""
        if not self.active:
            return loss_sum
        if self.value is None:  # first micro-batch of the run: every rank is here together
            first = global_sum(torch.as_tensor(n_targets, dtype=torch.float64, device=accelerator.device), accelerator)
            self.value = accelerator.num_processes / max(1.0, float(first))
        return loss_sum * self.value

    def unscale_factor(self) -> float:
        if not self.active:
            return 1.0
        assert self.value is not None  # set by the run's first scaled() micro-batch
        return 1.0 / self.value

    def follow(self, totals: WindowTotals, accelerator: Accelerator) -> None:
        if self.active and totals.targets > 0:
            self.value = accelerator.gradient_accumulation_steps * accelerator.num_processes / totals.targets


class Stepper:
    """What both steppers hold: the prepared objects, the micro-batch loss and the boundary."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, accelerator: Accelerator,
                 config: LoopConfig, micro_batch_loss: MicroBatchLoss, boundary: UpdateBoundary) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.accelerator = accelerator
        self.config = config
        self.loss = micro_batch_loss
        self.boundary = boundary
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.magnitude = LossMagnitude(active=False)
        self.fp32_sums: Fp32GradientAccumulator | None = None
        self.micro_norms: MicroBatchGradNorms | None = None
        """Noise scale from every micro-batch: the hooks measuring each backward's own gradient."""

    def epoch(self, batches: Iterable[Batch], done: int, windows: Iterable[int] | None = None,
              targets: list[int] | None = None) -> Iterator[Step]:
        raise NotImplementedError

    @contextlib.contextmanager
    def running(self) -> Iterator[Stepper]:
        """While training: the fp32 accumulation hooks and the noise scale's gradient-norm hooks are live
        (removed on exit: the model may be used without the loop afterwards)."""
        self.fp32_sums = self._fp32_accumulator()
        if self.boundary.noise_every and not self.loss.extra_terms:
            self.micro_norms = MicroBatchGradNorms(self.params, self.accelerator.device)
        try:
            yield self
        finally:
            if self.fp32_sums is not None:
                self.fp32_sums.remove()
                self.fp32_sums = None
            if self.micro_norms is not None:
                self.micro_norms.remove()
                self.micro_norms = None

    def _fp32_accumulator(self) -> Fp32GradientAccumulator | None:
        return None  # DeepSpeed accumulates in its own buffers (its config's data_types.grad_accum_dtype)

    def _learning_rate(self) -> float:
        return self.scheduler.get_last_lr()[0]


class AccumulateStepper(Stepper):
    """Single process, DDP and FSDP: sum, then scale once at the boundary (fairseq's scheme)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.magnitude = LossMagnitude(active=self.accelerator.scaler is not None)

    def epoch(self, batches: Iterable[Batch], done: int, windows: Iterable[int] | None = None,
              targets: list[int] | None = None) -> Iterator[Step]:
        if self.loss.extra_terms:
            yield from self._counted_epoch(batches, done, windows, targets)
            return
        if windows is not None:
            yield from self._planned_epoch(batches, done, windows, targets)
            return
        accelerator = self.accelerator
        first = True
        for step, batch in enumerate(batches, start=1):
            with accelerator.accumulate(self.model):
                self._micro_batch(batch, first)
                first = accelerator.sync_gradients  # the next micro-batch opens a window
                if not accelerator.sync_gradients:
                    continue
                done += 1
                decision, grad_norm, learning_rate, noise = self._close(done)
            yield Step(step, decision, grad_norm, learning_rate, noise)

    def _gradient_scale(self) -> float:
        """``c``: what a micro-batch's backward multiplied ``grad(loss_sum)`` by -- the fp16 magnitude hint,
        ``accelerator.backward``'s ``1 / K``, and the GradScaler's scale (fp16). Dividing a micro-batch's measured
        gradient by ``c * n_k`` gives its per-target mean gradient: a small batch of the noise scale."""
        accelerator = self.accelerator
        scale = (self.magnitude.value if self.magnitude.active else 1.0) / accelerator.gradient_accumulation_steps
        if accelerator.scaler is not None:
            scale *= float(accelerator.scaler.get_scale())
        return scale

    def _measure_small_batch(self, n_targets: torch.Tensor) -> None:
        """``noise_scale_micro_batches='first'``: the window's first micro-batch, alone in this rank's buffers
        (DDP: inside ``no_sync``)."""
        buffers = [p.grad for p in self.params]
        if self.fp32_sums is not None:  # bf16 weights: the micro-batch's gradient sits in the fp32 sums
            buffers += self.fp32_sums.pending_sums()
        grad_sq = small_batch_grad_sq(buffers, self._gradient_scale(), n_targets, self.accelerator.device)
        self.boundary.add_small_batch(n_targets, grad_sq)

    def _measure_micro_batch(self, micro_norms: MicroBatchGradNorms, n_targets: torch.Tensor) -> None:
        """``noise_scale_micro_batches='every'``: this micro-batch's own gradient, summed by the hooks during its
        backward (the window's last one too: the hooks run before DDP's all-reduce)."""
        grad_sq = micro_batch_grad_sq(micro_norms.take(), self._gradient_scale(), n_targets, self.accelerator.device)
        self.boundary.add_micro_batch_small(n_targets, grad_sq)

    def _planned_epoch(self, batches: Iterable[Batch], done: int, windows: Iterable[int],
                       targets: list[int] | None) -> Iterator[Step]:
        """Windows of the planned sizes (ramp-up, token budget) instead of every K-th micro-batch: the sync flag
        is set per micro-batch here and DDP's ``no_sync`` wraps all but the window's last, so gradients are still
        all-reduced once per update. ``Accelerator.backward`` keeps dividing by its fixed K; the boundary's
        ``K * W / N`` undoes exactly that K whatever the window's length."""
        accelerator = self.accelerator
        planned = iter(targets) if targets is not None else None
        first = True
        for step, (batch, closes) in enumerate(in_windows(batches, windows), start=1):
            set_sync_gradients(accelerator, closes)
            with contextlib.nullcontext() if closes else accelerator.no_sync(self.model):
                self._micro_batch(batch, first)
            first = closes  # the next micro-batch opens a window
            if not closes:
                continue
            done += 1
            decision, grad_norm, learning_rate, noise = self._close(done)
            check_window_targets(next(planned) if planned else None, round(decision.totals.targets), done)
            yield Step(step, decision, grad_norm, learning_rate, noise)

    def _counted_epoch(self, batches: Iterable[Batch], done: int, windows: Iterable[int] | None,
                       targets: list[int] | None) -> Iterator[Step]:
        """A loss of several terms (module docstring): every window counted before backward, each micro-batch's
        terms weighted by their own ``W / N_j``; DDP's ``no_sync`` wraps all but the window's last micro-batch."""
        accelerator = self.accelerator
        K = accelerator.gradient_accumulation_steps
        planned = iter(targets) if targets is not None else None
        step = 0
        for window in _windows(batches, windows if windows is not None else K):
            step += len(window)
            done += 1
            counts = count_window_units(window, self.loss.count_units, accelerator)
            check_window_targets(next(planned) if planned else None, counts[0], done)
            if counts[0]:
                # K undoes accelerator.backward's fixed 1 / K; W / N_j is each term's exact mean over ranks.
                factors = [K * factor for factor in term_factors(counts, accelerator.num_processes)]
                for index, batch in enumerate(window):
                    closes = index == len(window) - 1
                    set_sync_gradients(accelerator, closes)
                    with contextlib.nullcontext() if closes else accelerator.no_sync(self.model):
                        labels, inputs = split_labels(batch)
                        _, loss_sum, n_units = self.loss(self.model, inputs, labels)
                        accelerator.backward(combine_terms(loss_sum, factors))
                        self.boundary.add(loss_sum, n_units, batch, aux_sum=self.loss.aux_sum)
            else:  # no primary unit anywhere: no mean, no forward; tally the window's shape only
                for batch in window:
                    self.boundary.add(*_zero_terms(counts, accelerator.device), batch)
            decision = self.boundary.close(done, self._gradients(), counted=counts)
            learning_rate = self._learning_rate()
            grad_norm, decision, _ = self._apply(decision, factor=1.0)  # scaled before backward
            yield Step(step, decision, grad_norm, learning_rate)

    def _micro_batch(self, batch: Batch, first: bool) -> None:
        """One micro-batch; ``first``: it opens its window (the noise scale's small batch, when measured)."""
        labels, inputs = split_labels(batch)
        _, loss_sum, n_targets = self.loss(self.model, inputs, labels)
        # Backward of the *sum* (times a constant of the window): the one normalization is at the boundary.
        self.accelerator.backward(self.magnitude.scaled(loss_sum, n_targets, self.accelerator))
        self.boundary.add(loss_sum, n_targets, batch, aux_sum=self.loss.aux_sum)
        if self.micro_norms is not None:
            self._measure_micro_batch(self.micro_norms, n_targets)
        elif first and not self.accelerator.sync_gradients and self.boundary.noise is not None:
            self._measure_small_batch(n_targets)

    def _close(self, done: int) -> tuple[Decision, float | None, float, NoiseScaleReading | None]:
        decision = self.boundary.close(done, self._gradients())
        learning_rate = self._learning_rate()
        grad_norm, decision, big_grad_sq = self._apply(decision)
        noise = self.boundary.measure_noise(decision, big_grad_sq)
        self.magnitude.follow(decision.totals, self.accelerator)
        return decision, grad_norm, learning_rate, noise

    def _gradients(self) -> list[torch.Tensor | None] | None:
        """What the boundary checks for inf/NaN; None under fp16, whose GradScaler checks (and skips) itself."""
        if self.magnitude.active:
            return None
        pending = self.fp32_sums.pending_sums() if self.fp32_sums is not None else []
        return [p.grad for p in self.params] + pending

    def _apply(self, decision: Decision, factor: float | None = None) -> tuple[float | None, Decision, float | None]:
        """Scale to the exact mean, clip, step -- or keep a skipped window out of the weights entirely (no
        optimizer step: its moments and step count stay; no scheduler step). Also returns the applied
        gradient's squared norm before clipping when the noise scale needs it (else None). ``factor``: given
        when the window was scaled before backward (1.0), else the window's ``K * W / N``."""
        if not decision.applied:
            discard_window_(self.params, self.fp32_sums)
            return None, decision, None
        accelerator = self.accelerator
        if factor is None:
            # accelerator.backward divided each micro-batch by K (and we multiplied by the magnitude hint):
            # replace both by the exact W / N.
            factor = accelerator.gradient_accumulation_steps * exact_mean_factor(
                decision.totals.targets, accelerator.num_processes
            )
            factor *= self.magnitude.unscale_factor()
        params = self.params
        if self.fp32_sums is not None:
            self.fp32_sums.write_gradients_(factor)  # low-precision weights: scaled in fp32, rounded once
            params = self.fp32_sums.other_parameters(self.params)
        rescale_gradients_(params, factor)
        grad_norm = None
        if self.config.max_grad_norm and self.config.max_grad_norm > 0:
            grad_norm = float(accelerator.clip_grad_norm_(self.params, self.config.max_grad_norm))
        big_grad_sq = None
        if self.boundary.noise is not None:  # the clip's norm is the one before clipping: reuse it
            big_grad_sq = grad_norm ** 2 if grad_norm is not None else float(
                squared_norm([p.grad for p in self.params], accelerator.device))
        self.optimizer.step()
        if accelerator.optimizer_step_was_skipped:  # fp16 overflow: no update, so no scheduler step
            decision = decision.overflowed()
        else:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, decision, big_grad_sq

    def _fp32_accumulator(self) -> Fp32GradientAccumulator | None:
        if not self.config.fp32_grad_accumulation or not low_precision_parameters(self.params):
            return None
        if self.accelerator.num_processes > 1:
            raise NotImplementedError(
                "fp32 gradient accumulation for bf16/fp16 weights is single-process only (DDP all-reduces .grad "
                "buckets itself). Keep fp32 weights with Accelerator(mixed_precision='bf16') -- gradients are then "
                "fp32 -- or pass LoopConfig(fp32_grad_accumulation=False) to accept bf16 accumulation."
            )
        return Fp32GradientAccumulator(self.params)


class DeepSpeedStepper(Stepper):
    """The engine applies the update inside ``accelerator.backward`` of the window's last micro-batch
    (reduce, clip at its ``gradient_clipping``, step), so the normalization goes into the loss:
    ``loss_sum * K * W / N`` with ``N`` counted over the window's micro-batches on all ranks before any
    backward. ``engine.backward`` divides every loss by its ``gradient_accumulation_steps`` (``scale_wrt_gas``,
    the engine's own K) and ZeRO averages gradients over the ``W`` data-parallel ranks; ``K * W / N`` undoes
    both and leaves ``grad(sum of all targets' losses) / N``. A window without targets is skipped whole: no
    forward, no engine step, no scheduler step. DeepSpeed accumulates in its own buffers (its config's
    ``data_types.grad_accum_dtype``): no fp32 sums here.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        if self.config.noise_scale:
            raise LoopConfigError(f"LoopConfig.noise_scale: {NOT_UNDER_DEEPSPEED}")
        self.engine = self.accelerator.deepspeed_engine_wrapped.engine
        clipping = float(self.engine.gradient_clipping() or 0.0)
        if clipping != float(self.config.max_grad_norm or 0.0):
            raise LoopConfigError(
                f"DeepSpeed clips at gradient_clipping={clipping} but LoopConfig.max_grad_norm="
                f"{self.config.max_grad_norm}; build the Accelerator with hf_accum.recipe.launch.loop_accelerator (it "
                "fills the config's \"auto\" from max_grad_norm) or make the two equal"
            )

    def epoch(self, batches: Iterable[Batch], done: int, windows: Iterable[int] | None = None,
              targets: list[int] | None = None) -> Iterator[Step]:
        """``windows``: planned sizes (ramp-up, token budget); the factor uses the engine's own K, which
        ``engine.backward`` divides by whatever the window's length, so planned windows need nothing more."""
        if self.loss.kind is None:  # the count below needs the layout before the first forward
            self.loss.kind = infer_loss_kind(self.model)
        step = 0
        planned = iter(targets) if targets is not None else None
        sizes = windows if windows is not None else self.accelerator.gradient_accumulation_steps
        for window in _windows(batches, sizes):
            step += len(window)
            done += 1
            counts = count_window_units(window, self.loss.count_units, self.accelerator)
            check_window_targets(next(planned) if planned else None, counts[0], done)
            learning_rate = self._learning_rate()
            if counts[0]:
                self._forward_backward(window, counts)
            else:  # tally the window's shape only: no forward at all
                for batch in window:
                    self.boundary.add(*_zero_terms(counts, self.accelerator.device), batch)
            decision = self.boundary.close(done, gradients=None, counted=counts if len(counts) > 1 else counts[0])
            if decision.applied:
                decision = self._step_scheduler(decision)
            grad_norm = self.engine.get_global_grad_norm() if decision.applied else None
            yield Step(step, decision, float(grad_norm) if grad_norm is not None else None, learning_rate)

    def _forward_backward(self, window: list[Batch], counts: list[int]) -> None:
        """Forward and backward every micro-batch of one window; the engine steps on the last one."""
        # K undoes the engine's own 1/K (engine.backward's scale_wrt_gas); W / N_j is each term's exact mean over
        # ranks (one term: W / N).
        K = self.engine.gradient_accumulation_steps()
        factors = [K * factor for factor in term_factors(counts, self.accelerator.num_processes)]
        for index, batch in enumerate(window):
            # The engine's boundary (reduce + step) is the window's last micro-batch, short windows included.
            # Set by hand, as Trainer._run_epoch does for its prefetched windows: accumulate() would see
            # the dataloader's end while the last window's first micro-batch is still being processed.
            set_sync_gradients(self.accelerator, index == len(window) - 1)
            labels, inputs = split_labels(batch)
            _, loss_sum, n_targets = self.loss(self.model, inputs, labels)
            self.accelerator.backward(combine_terms(loss_sum, factors))
            self.boundary.add(loss_sum, n_targets, batch, aux_sum=self.loss.aux_sum)

    def _step_scheduler(self, decision: Decision) -> Decision:
        if self.accelerator.optimizer_step_was_skipped:  # fp16 overflow: the engine skipped the step
            return decision.overflowed()
        with warnings.catch_warnings():
            # The engine stepped its own copy of the optimizer, not the object the scheduler
            # wraps, so torch believes the scheduler runs first. It does not: the LR at update n
            # is the big batch's (tested), so the "skipping the first value" warning is false here.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.scheduler.step()
        return decision


def _zero_terms(counts: list[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)`` of a micro-batch that was not forwarded, shaped like the loss's terms."""
    shape = () if len(counts) == 1 else (len(counts),)
    return torch.zeros(shape, device=device), torch.zeros(shape)


def build_stepper(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, accelerator: Accelerator,
                  config: LoopConfig, micro_batch_loss: MicroBatchLoss, boundary: UpdateBoundary) -> Stepper:
    kind = DeepSpeedStepper if is_deepspeed(accelerator) else AccumulateStepper
    if config.noise_scale and accelerator.distributed_type == DistributedType.FSDP:
        raise LoopConfigError(f"LoopConfig.noise_scale: {NOT_UNDER_FSDP}")
    if config.noise_scale and micro_batch_loss.extra_terms:
        raise LoopConfigError(f"LoopConfig.noise_scale: not measured for a loss of several terms "
                              f"{micro_batch_loss.term_names} (its small batch has no single unit)")
    return kind(model, optimizer, scheduler, accelerator, config, micro_batch_loss, boundary)


def is_deepspeed(accelerator: Accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def split_labels(batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
    """Labels stay out of the forward: the model would otherwise compute its own (discarded) loss."""
    if "labels" not in batch:
        raise KeyError(f"batch has no 'labels' (keys: {sorted(batch)}); the collator must provide them")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return batch["labels"], inputs


def _windows(dataloader: Iterable[Batch], sizes: int | Iterable[int]) -> Iterator[list[Batch]]:
    """The dataloader's micro-batches in windows of ``sizes`` (an int: every window that size, the epoch's last
    may be shorter; a list: the planned sizes)."""
    window: list[Batch] = []
    if not isinstance(sizes, int):
        for batch, closes in in_windows(dataloader, sizes):
            window.append(batch)
            if closes:
                yield window
                window = []
        return
    for batch in dataloader:
        window.append(batch)
        if len(window) == sizes:
            yield window
            window = []
    if window:
        yield window


def in_windows(batches: Iterable[Any], sizes: Iterable[int]) -> Iterator[tuple[Any, bool]]:
    """``(micro-batch, closes its window)`` for windows of the planned ``sizes``; the plan ends the epoch (a
    truncated last epoch leaves the rest of the dataloader unread)."""
    iterator = iter(batches)
    for size in sizes:
        for position in range(size):
            batch = next(iterator, _END)
            if batch is _END:
                raise PlanDriftError("the dataloader ended before the planned windows did (other data than planned?)")
            yield batch, position == size - 1


_END = object()
