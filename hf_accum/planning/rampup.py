"""Batch-size ramp-up with Megatron's meaning, planned in windows of micro-batches before training.

``rampup_batch_size = [start, increment, samples]`` (Megatron-LM's ``--rampup-batch-size``): the global
batch starts at ``start`` sequences and grows by ``increment`` every ``samples / ((global - start) /
increment)`` consumed samples until it reaches the configured global batch. Megatron decides each
update's batch from the samples consumed *before* it::

    global_n = global                                    if consumed_n > samples
             = start + floor(consumed_n / per_increment) * increment   otherwise

With accumulation, ramping the batch is changing K: the micro-batch stays fixed and update ``n`` takes
``K_n = global_n / (micro x processes)`` micro-batches per rank. Every update stays exact (each is
normalized by its own target count, as a short last window already is); what ramp-up adds is the
*plan*: the number of updates, hence the LR horizon, is counted here before training from the data
(micro-batches per epoch; the epoch's last window keeps its short count) so that the LR at update n is
the LR a run feeding batch ``global_n`` directly would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from hf_accum.errors import InputError


class RampUpError(InputError):
    """A ramp-up that cannot be run with this micro-batch, process count or global batch."""


@dataclass(frozen=True)
class RampUp:
    """``[start, increment, samples]`` in sequences, checked against the run's batch arithmetic."""

    start: int
    increment: int
    samples: int
    global_batch_size: int
    micro_batch_size: int
    num_processes: int = 1

    @classmethod
    def from_list(cls, values: Sequence[int], global_batch_size: int, micro_batch_size: int,
                  num_processes: int = 1, key: str = "rampup_batch_size") -> RampUp:
        if len(values) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise RampUpError(f"{key}={list(values)!r}: expected three integers [start, increment, samples]")
        ramp = cls(int(values[0]), int(values[1]), int(values[2]), global_batch_size, micro_batch_size,
                   num_processes)
        ramp.check(key)
        return ramp

    @property
    def per_round(self) -> int:
        """Sequences one micro-batch on every rank adds: every batch of the ramp is a multiple of it."""
        return self.micro_batch_size * self.num_processes

    @property
    def samples_per_increment(self) -> float:
        return self.samples / ((self.global_batch_size - self.start) // self.increment)

    def check(self, key: str = "rampup_batch_size") -> None:
        """Refuse, naming the nearest valid values, what Megatron (or fixed micro-batches) cannot run."""
        where = f"{key}=[{self.start}, {self.increment}, {self.samples}]"
        if self.start < 1 or self.increment < 1 or self.samples < 1:
            raise RampUpError(f"{where}: start, increment and samples must be >= 1")
        if self.start >= self.global_batch_size:
            raise RampUpError(f"{where}: start must be below the global batch {self.global_batch_size}")
        for name, value in (("start", self.start), ("increment", self.increment)):
            if value % self.per_round:
                lower = value // self.per_round * self.per_round
                nearest = " or ".join(str(v) for v in (lower, lower + self.per_round) if v > 0)
                raise RampUpError(
                    f"{where}: {name}={value} is not a multiple of micro_batch_size x processes = "
                    f"{self.micro_batch_size} x {self.num_processes} = {self.per_round} (the micro-batch stays "
                    f"fixed, K changes); nearest valid {name}: {nearest}"
                )
        if (self.global_batch_size - self.start) % self.increment:
            raise RampUpError(
                f"{where}: global batch {self.global_batch_size} - start {self.start} is not a multiple of "
                f"increment {self.increment} (Megatron's rule: the ramp must end exactly at the global batch)"
            )

    def global_batch_at(self, consumed_samples: int) -> int:
        """Megatron's ``RampupBatchsizeNumMicroBatches.update``: the batch of the next update."""
        if consumed_samples > self.samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.samples_per_increment)
        return min(self.global_batch_size, self.start + steps * self.increment)

    def accumulation_at(self, consumed_samples: int) -> int:
        """Micro-batches per rank of the next update."""
        return self.global_batch_at(consumed_samples) // self.per_round


def plan_windows(
    micro_batches_per_epoch: int, ramp: RampUp, num_epochs: float = 1.0, max_steps: int = -1, consumed: int = 0,
) -> list[list[int]]:
    """Window sizes (micro-batches per rank) of every update, epoch by epoch.

    An epoch's last window holds what is left of the epoch (short, normalized by its own count, like
    any short last window). ``max_steps`` (> 0) ends the plan after that many updates, spanning epochs;
    else ``num_epochs`` whole epochs (a fraction keeps that share of the epoch's updates, rounded up).
    ``consumed``: samples consumed before the first planned window (0 for a fresh run).
    """
    if micro_batches_per_epoch < 1:
        raise ValueError("a ramp-up needs a dataloader with a length (micro_batches_per_epoch >= 1)")
    epochs: list[list[int]] = []
    updates_left = max_steps if max_steps and max_steps > 0 else None
    epoch = 0
    while True:
        windows, consumed = _epoch_windows(micro_batches_per_epoch, ramp, consumed)
        if updates_left is None:
            if epoch + 1 > num_epochs:  # a fractional last epoch: its share of the updates
                share = num_epochs - epoch
                if share > 0:
                    epochs.append(windows[: math.ceil(share * len(windows))])
                return epochs
            epochs.append(windows)
            epoch += 1
            if epoch >= num_epochs:
                return epochs
            continue
        epochs.append(windows[:updates_left])
        updates_left -= len(epochs[-1])
        epoch += 1
        if updates_left <= 0:
            return epochs


def _epoch_windows(micro_batches: int, ramp: RampUp, consumed: int) -> tuple[list[int], int]:
    windows, left = [], micro_batches
    while left > 0:
        size = min(ramp.accumulation_at(consumed), left)
        windows.append(size)
        left -= size
        consumed += size * ramp.per_round
    return windows, consumed


def total_updates(plan: list[list[int]]) -> int:
    return sum(len(epoch) for epoch in plan)


def describe_stages(plan: list[list[int]], ramp: RampUp) -> str:
    """``8 seqs x 34 updates -> 16 x 17 -> ...``: what the start line and ``hf-accum plan`` print."""
    stages: list[list[int]] = []
    for window in (w for epoch in plan for w in epoch):
        sequences = window * ramp.per_round
        if stages and stages[-1][0] == sequences:
            stages[-1][1] += 1
        else:
            stages.append([sequences, 1])
    parts = [f"{sequences} seqs x {count} update{'s' if count != 1 else ''}" for sequences, count in stages]
    return f"batch ramp-up [{ramp.start}, {ramp.increment}, {ramp.samples}]: " + " -> ".join(parts)
