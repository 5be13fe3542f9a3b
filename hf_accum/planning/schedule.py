"""Data plan -> number of optimizer updates -> LR scheduler horizon; global-batch planning.

The LR contract: the learning rate at update ``n`` equals the big-batch run's learning rate at
update ``n``. The big-batch run makes one update per window of ``K`` micro-batches (the last
window of an epoch may be short and is still one update), so the horizon must be counted in
*updates*, computed before training from the data plan -- never in micro-batches (which
stretches warmup and decay ``K`` times) and never per process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and transformers only where a scheduler is built: `hf-accum plan` is arithmetic
    import torch


def updates_per_epoch(micro_batches_per_epoch: int, accumulation_steps: int) -> int:
    """Each full window of K micro-batches is one update, and so is the short last window."""
    _require_positive(accumulation_steps=accumulation_steps)
    return math.ceil(micro_batches_per_epoch / accumulation_steps)


def planned_updates(
    micro_batches_per_epoch: int, accumulation_steps: int, num_epochs: float = 1, max_steps: int = -1
) -> int:
    """Total optimizer updates of a run: ``max_steps`` when given (> 0), else epochs x updates/epoch.

    A fractional ``num_epochs`` rounds up to whole updates, as ``Trainer`` does
    (``ceil(num_epochs * updates_per_epoch)``; 1.1 x 10 is 11, not the 12 that splitting off the
    whole epochs gives through float rounding).
    """
    if max_steps is not None and max_steps > 0:
        return int(max_steps)
    return math.ceil(num_epochs * updates_per_epoch(micro_batches_per_epoch, accumulation_steps))


def epochs_needed(total_updates: int, micro_batches_per_epoch: int, accumulation_steps: int) -> int:
    """Passes over the data that ``total_updates`` updates take (``max_steps`` may span several)."""
    return math.ceil(total_updates / max(1, updates_per_epoch(micro_batches_per_epoch, accumulation_steps)))


def create_update_scheduler(
    optimizer: torch.optim.Optimizer,
    total_updates: int,
    name: str = "linear",
    warmup_steps: int = 0,
    warmup_ratio: float = 0.0,
    **scheduler_kwargs: Any,
) -> torch.optim.lr_scheduler.LRScheduler:
    """A transformers scheduler whose horizon is ``total_updates`` optimizer updates.

    Do *not* pass it through ``accelerator.prepare``: Accelerate would step it once per
    process per call. Step it once per applied update (see ``hf_accum.loop``).
    """
    warmup = warmup_steps if warmup_steps > 0 else math.ceil(warmup_ratio * total_updates)
    from transformers import get_scheduler

    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_updates,
        scheduler_specific_kwargs=scheduler_kwargs or None,
    )


@dataclass(frozen=True)
class BatchPlan:
    """``global_batch = micro_batch x accumulation_steps x num_processes`` (sequences per update),
    where ``num_processes = num_nodes x processes per node``."""

    micro_batch_size: int
    accumulation_steps: int
    num_processes: int
    num_nodes: int = field(default=1, compare=False)
    """Machines the processes run on. Says where the processes are, not how many: two plans with the
    same processes are the same batch arithmetic (a checkpoint may resume on another node layout)."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.num_processes % self.num_nodes:
            raise ValueError(
                f"num_processes={self.num_processes} is not a whole number of processes on each of "
                f"num_nodes={self.num_nodes} nodes"
            )

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.accumulation_steps * self.num_processes

    @property
    def processes_per_node(self) -> int:
        return self.num_processes // self.num_nodes

    def describe(self) -> str:
        line = (
            f"effective batch {self.global_batch_size} = {self.micro_batch_size} per device x "
            f"{self.accumulation_steps} accumulation x {self.num_processes} "
            f"process{'es' if self.num_processes != 1 else ''}"
        )
        if self.num_nodes > 1:
            line += f" ({self.num_nodes} nodes x {self.processes_per_node})"
        return line


def repeated_examples_warning(num_examples: int, plan: BatchPlan, even_batches: bool = True) -> str | None:
    """Accelerate's ``even_batches`` fills each rank's last micro-batch by *repeating* examples from
    the start of the dataset; the last update of each epoch then counts them twice and is no longer
    the big batch. Returns the warning to log, or None when nothing is repeated."""
    per_round = plan.micro_batch_size * plan.num_processes
    repeated = -num_examples % per_round
    if plan.num_processes < 2 or not even_batches or not repeated:
        return None
    return (
        f"{num_examples} examples do not fill {plan.num_processes} ranks x {plan.micro_batch_size}: Accelerate "
        f"(even_batches=True) repeats {repeated} examples in the last micro-batches, so the last update of each "
        f"epoch counts them twice. Use a multiple of {per_round} examples to keep every update exactly the big batch."
    )


def warn_repeated_examples(log: Any, dataset: Any, plan: BatchPlan, even_batches: bool = True) -> None:
    """Log :func:`repeated_examples_warning` for a dataset with a length (both front-ends, main process)."""
    try:
        num_examples = len(dataset)
    except TypeError:  # None, or a stream
        return
    message = repeated_examples_warning(num_examples, plan, even_batches)
    if message:
        log.warning(message)


def plan_global_batch(
    global_batch_size: int, micro_batch_size: int, num_processes: int = 1, num_nodes: int = 1
) -> BatchPlan:
    """Derive the accumulation steps from a global batch; refuse a global batch that does not divide.

    ``num_processes`` counts every process of every node (nodes x processes per node). The error
    names the nearest valid global batches so the user can pick one deliberately (silently
    rounding would change the effective batch and with it the LR rule).
    """
    _require_positive(
        global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, num_processes=num_processes,
        num_nodes=num_nodes,
    )
    per_window = micro_batch_size * num_processes
    if global_batch_size % per_window:
        lower = (global_batch_size // per_window) * per_window
        upper = lower + per_window
        options = [str(v) for v in (lower, upper) if v > 0]
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size x num_processes = "
            f"{micro_batch_size} x {num_processes} = {per_window}; nearest valid global_batch_size: "
            f"{' or '.join(options)} (or change micro_batch_size)"
        )
    return BatchPlan(micro_batch_size, global_batch_size // per_window, num_processes, num_nodes)


def scaled_learning_rate(base_lr: float, base_batch: int, new_batch: int, rule: str = "linear") -> float:
    """LR for a changed global batch: ``linear`` (Goyal et al.) or ``sqrt`` (Adam-style) scaling."""
    ratio = new_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ValueError(f"lr scaling rule={rule!r}; allowed: 'linear', 'sqrt', 'none'")


def _require_positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")
