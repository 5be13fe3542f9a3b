"""Planned windows: how many micro-batches each update of each epoch takes, decided before training.

Two settings make the window change from update to update (the micro-batch stays whatever the dataloader
yields; only the number of micro-batches per update moves):

* ``LoopConfig(rampup_batch_size=[start, increment, samples])`` -- Megatron's batch ramp-up
  (:mod:`hf_accum.planning.rampup`): the window follows the samples consumed so far;
* ``LoopConfig(rampup_batch_size="auto")`` -- the window is *decided* between updates by the noise-scale controller
  (:mod:`hf_accum.planning.auto_ramp`), not planned: :class:`AutoRampPlan` yields each window's size lazily, after the
  previous update was observed;
* ``LoopConfig(tokens_per_update=N)`` -- an update closes once its window holds at least ``N`` targets on
  all ranks. The targets of every micro-batch are counted in one pass over each epoch's data before training
  (the epoch's order is drawn from its seed, ``set_epoch``), summed over ranks with one all-reduce of the
  vector, so every rank holds the same plan.

Both are exact without any new normalization: every update divides by its own target count, as a short last
window always did. What the plan adds is the number of updates, hence the LR horizon, before the first
micro-batch; a resumed run recomputes the same plan (a function of the data order) and continues from the
window its checkpoint closed (:meth:`WindowPlan.windows_from`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from itertools import count
from typing import Any, Iterator

import torch

from hf_accum.checkpointing.checkpoint import ResumeMismatchError
from hf_accum.checkpointing.loop_checkpoint import capture_random_states, data_generators, restore_random_states
from hf_accum.losses.token_loss import count_targets
from hf_accum.planning.auto_ramp import AutoRampSettings, BatchChange, BatchController, RampSchedule
from hf_accum.planning.rampup import RampUp, describe_stages, plan_windows


class PlanDriftError(RuntimeError):
    """Training saw other micro-batches than the planning pass counted (a non-deterministic data order)."""


@dataclass(frozen=True)
class WindowPlan:
    """Window sizes (micro-batches per rank) of every planned update, epoch by epoch."""

    epochs: tuple[tuple[int, ...], ...]
    description: str
    targets: tuple[tuple[int, ...], ...] | None = None
    """Token budgets: every window's targets on all ranks, as counted by the planning pass (checked in training)."""

    @property
    def total_updates(self) -> int:
        return sum(len(epoch) for epoch in self.epochs)

    def digest(self) -> str:
        """A fingerprint stored in checkpoints: a resume under another plan is refused."""
        return hashlib.sha256(json.dumps([list(e) for e in self.epochs]).encode()).hexdigest()[:16]

    def windows_from(self, epoch: int, consumed: int) -> list[int]:
        """The windows of ``epoch`` after its first ``consumed`` micro-batches (a window boundary)."""
        if epoch >= len(self.epochs):
            return []
        sizes, done = list(self.epochs[epoch]), 0
        for index, size in enumerate(sizes):
            if done == consumed:
                return sizes[index:]
            done += size
        if done == consumed:
            return []
        raise ResumeMismatchError(
            f"{consumed} micro-batches of epoch {epoch} consumed is not a window boundary of this run's plan "
            "(other rampup_batch_size / tokens_per_update or other data?); resume with the checkpoint's settings"
        )

    def window_targets(self, epoch: int, consumed: int) -> list[int] | None:
        """Planned targets (all ranks) of the windows :meth:`windows_from` returns; None without a token budget."""
        if self.targets is None:
            return None
        skipped = len(self.epochs[epoch]) - len(self.windows_from(epoch, consumed))
        return list(self.targets[epoch][skipped:])


def ramp_plan(values: list[int], micro_batches: int, micro_batch_size: int, accumulation: int,
              num_processes: int, num_epochs: float, max_steps: int) -> WindowPlan:
    """Megatron's ramp-up towards the global batch ``micro x processes x accumulation``."""
    ramp = RampUp.from_list(list(values), micro_batch_size * num_processes * accumulation, micro_batch_size,
                            num_processes, key="LoopConfig.rampup_batch_size")
    epochs = plan_windows(micro_batches, ramp, num_epochs, max_steps)
    return WindowPlan(tuple(tuple(e) for e in epochs), describe_stages(epochs, ramp))


def token_plan(dataloader: Any, accelerator: Any, kind: str, budget: int, num_epochs: float,
               max_steps: int) -> WindowPlan:
    """Windows closing at ``budget`` targets (all ranks), from one counting pass per planned epoch."""
    states = capture_random_states(data_generators(dataloader))
    try:
        return _token_plan(dataloader, accelerator, kind, budget, num_epochs, max_steps)
    finally:
        # Training then draws every epoch's order from where the planning pass started.
        restore_random_states(states, data_generators(dataloader))


def _token_plan(dataloader: Any, accelerator: Any, kind: str, budget: int, num_epochs: float,
                max_steps: int) -> WindowPlan:
    counts = (_epoch_counts(dataloader, accelerator, kind, epoch) for epoch in count())
    epochs, targets = [], []
    updates_left = max_steps if max_steps and max_steps > 0 else None
    for epoch, per_micro_batch in enumerate(counts):
        sizes, sums = budget_windows(per_micro_batch, budget)
        if updates_left is None and epoch + 1 > num_epochs:  # a fractional last epoch: its share of the updates
            keep = math.ceil((num_epochs - epoch) * len(sizes))
            sizes, sums = sizes[:keep], sums[:keep]
        if updates_left is not None:
            sizes, sums = sizes[:updates_left], sums[:updates_left]
            updates_left -= len(sizes)
        epochs.append(tuple(sizes))
        targets.append(tuple(sums))
        if (updates_left is not None and updates_left <= 0) or (updates_left is None and epoch + 1 >= num_epochs):
            break
    plan = WindowPlan(tuple(epochs), "", tuple(targets))
    return WindowPlan(plan.epochs, describe_budget(plan, budget), plan.targets)


def budget_windows(per_micro_batch: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Greedy windows: close as soon as the window holds ``>= budget`` targets (so each holds less than the budget
    plus its last micro-batch); the epoch's last window keeps what is left. Returns sizes and their targets."""
    sizes, sums, size, held = [], [], 0, 0
    for targets in per_micro_batch:
        size, held = size + 1, held + targets
        if held >= budget:
            sizes.append(size)
            sums.append(held)
            size, held = 0, 0
    if size:
        sizes.append(size)
        sums.append(held)
    return sizes, sums


def describe_budget(plan: WindowPlan, budget: int) -> str:
    """``token budget 2048: 37 updates, 3-9 micro-batches each (median 5), 2048-2391 targets``."""
    sizes = sorted(s for e in plan.epochs for s in e)
    targets = sorted(t for e in plan.targets or () for t in e)
    if not sizes:
        return f"token budget {budget}: no updates"
    return (f"token budget {budget} targets/update: {len(sizes)} updates, {sizes[0]}-{sizes[-1]} micro-batches "
            f"per rank each (median {sizes[len(sizes) // 2]}), {targets[0]}-{targets[-1]} targets")


def _epoch_counts(dataloader: Any, accelerator: Any, kind: str, epoch: int) -> list[int]:
    """Targets of each micro-batch of ``epoch`` summed over ranks (one all-reduce of the vector).

    The epochs are counted in order from the random states training starts from (restored afterwards by
    :func:`token_plan`): a seedable sampler draws each epoch's order from its seed and ``set_epoch``, and a
    sampler with its own generator draws epoch after epoch as training will. A sampler drawing from the global
    RNG between dropout draws cannot be predicted: training checks every window's targets against the plan
    (:class:`PlanDriftError`)."""
    if hasattr(dataloader, "set_epoch"):
        dataloader.set_epoch(epoch)
    local = [int(count_targets(_labels(batch), kind)) for batch in dataloader]
    vector = torch.tensor(local, dtype=torch.int64, device=accelerator.device)
    if accelerator.num_processes > 1:
        vector = accelerator.reduce(vector, reduction="sum")
    return [int(v) for v in vector.tolist()]


def _labels(batch: Any) -> torch.Tensor:
    if "labels" not in batch:
        raise KeyError(f"batch has no 'labels' (keys: {sorted(batch)}); the collator must provide them")
    return batch["labels"]


def check_window_targets(planned: int | None, counted: int, step: int) -> None:
    """Training must see the windows the planning pass counted."""
    if planned is not None and planned != counted:
        raise PlanDriftError(
            f"update {step}: the window holds {counted} targets but the token-budget plan counted {planned}: the "
            "dataloader's order differs between the planning pass and training; use a dataloader prepared by "
            "accelerator.prepare with a seedable sampler (Accelerator(dataloader_config=DataLoaderConfiguration("
            "use_seedable_sampler=True))) or shuffle=False"
        )



@dataclass
class AutoRampPlan:
    """The auto ramp in a loop run: the controller, the run's micro-batches per epoch (its horizon in samples,
    known before training) and the window each update takes, decided when its window opens."""

    controller: BatchController
    epoch_micro_batches: tuple[int, ...]
    """Micro-batches per process of every epoch to run (a fractional last epoch: its share, rounded up)."""
    last_window: int = 0

    @property
    def horizon_samples(self) -> int:
        return sum(self.epoch_micro_batches) * self.controller.per_round

    @property
    def max_updates(self) -> int:
        """An upper bound on the run's updates: every window at the start batch."""
        return sum(math.ceil(m / self.controller.min_accumulation) for m in self.epoch_micro_batches)

    def schedule(self, optimizer: Any, name: str, warmup_ratio: float) -> RampSchedule:
        horizon = self.horizon_samples
        return RampSchedule(optimizer, self.controller, horizon, name, math.ceil(warmup_ratio * horizon))

    def windows(self, epoch: int, consumed: int, schedule: RampSchedule) -> Iterator[int]:
        """The sizes of ``epoch``'s windows after its first ``consumed`` micro-batches, each read when its window
        opens: the steppers pull the next size only after the previous update was yielded, recorded and
        observed (:meth:`observe`), so it is the size the controller decided from that update."""
        left = self.epoch_micro_batches[epoch] - consumed
        while left > 0:
            size = min(self.controller.accumulation, left)  # the epoch's last window keeps what is left
            schedule.open_window(size)
            self.last_window = size
            yield size
            left -= size

    def ends_run(self, epoch: int, consumed: int) -> bool:
        """The update that closed at ``consumed`` micro-batches of ``epoch`` is the run's last."""
        return epoch == len(self.epoch_micro_batches) - 1 and consumed >= self.epoch_micro_batches[-1]

    def observe(self, step: int, noise_scale: float | None, targets: float, applied: bool) -> BatchChange | None:
        """Feed one update's reading to the controller (a skipped update or a short window gives none)."""
        full = self.last_window == self.controller.accumulation
        return self.controller.observe(step, noise_scale if applied else None, targets, full_window=full)

    def describe(self, schedule: RampSchedule | None = None) -> str:
        line = "; ".join([self.controller.describe(), *self.controller.notes()])
        if schedule is not None:
            line += (f"; LR schedule over {schedule.horizon} samples (warmup {schedule.warmup}), "
                     f"at most {self.max_updates} updates")
        return line


def auto_plan(settings: Any, micro_batches: int, micro_batch_size: int, accumulation: int, num_processes: int,
              num_epochs: float) -> AutoRampPlan:
    """The auto ramp towards the global batch ``micro x processes x accumulation`` (the configured K)."""
    settings = AutoRampSettings.of(settings, "LoopConfig.rampup_auto")
    controller = BatchController(settings, micro_batch_size * num_processes, accumulation, "LoopConfig.rampup_auto")
    whole = int(num_epochs)
    epochs = [micro_batches] * whole
    if num_epochs > whole:
        epochs.append(math.ceil((num_epochs - whole) * micro_batches))
    return AutoRampPlan(controller, tuple(epochs))
