"""``rampup_batch_size='auto'``: the global batch grows when the measured gradient noise scale says it still pays.

What it owns: the *controller* (which window of micro-batches the next update takes) and the LR under a changing
batch. The micro-batch stays fixed; a change multiplies K (micro-batches per rank and update) and is decided only
between updates, so every update is still one exact big batch of its own rows (each is normalized by its own
target count, as a short last window always was).

**The controller** (:class:`BatchController`), fed one reading per update:

* the reading is the *smoothed* noise scale ``B_simple`` (targets; the moving averages of
  :class:`hf_accum.measure.noise_scale.NoiseScaleTracker`) and the update's targets ``N`` (all ranks). Both come from
  all-reduced values only: ``N`` and every rank's small-batch norm travel in the window's one all-reduce, and the
  big batch's norm is the norm of the already all-reduced gradient, so every rank computes the same reading and
  takes the same decision without another collective;
* a reading above ``margin x N`` counts one; a reading below ``release x N`` (``release <= margin``) resets the
  count; in between the count holds (hysteresis: a noisy reading near the threshold neither advances nor
  resets). Once ``patience`` readings in a row counted and at least ``min_updates`` updates ran at the current
  batch, K grows ``growth``-fold (capped at the configured K), and the count starts again;
* no reading (noise scale not yet defined, a skipped update, the epoch's short last window, whose smaller ``N``
  would inflate the ratio) changes nothing;
* it only grows: the configured global batch is the ceiling, the stated minimum the start.

The minimum defaults to two micro-batches per process: the noise scale compares the window's first micro-batch
with the update, so a window of one micro-batch measures nothing (on one process it *is* the update; under DDP
its backward already all-reduced it), and a controller that never measures never grows.

**The LR under a changing batch** (``lr_rule``), a factor on the schedule's LR of the update, applied from the
first update at the new batch (the LR is set when its window opens):

* ``constant``: the schedule alone (the batch does not touch the LR);
* ``sqrt``: ``sqrt(B / B_max)``: the LR is tuned for the configured global batch ``B_max`` and a smaller batch
  takes the square-root-scaled LR (the Adam rule; Malladi et al. 2022);
* ``seesaw``: ``sqrt(B_min / B)``: each doubling of the batch cuts the LR by ``1/sqrt(2)`` (Meterez et al. 2025,
  arXiv 2510.14717, "Seesaw"). Seesaw's equivalence, for normalized SGD as a proxy of Adam in the
  variance-dominated regime: where a schedule would cut the LR by ``a``, cutting it by ``sqrt(a)`` and
  multiplying the batch by ``a`` keeps the loss at equal samples. The paper derives the batch schedule *from* the
  LR schedule (double where cosine would halve); here the noise scale decides when to double, and the rule keeps
  the coupling (``1/sqrt(2)`` per doubling). It replaces decay: pair it with a schedule that holds the LR
  (``constant_with_warmup``), or the cuts come on top of the schedule's own decay.

**The schedule** (:class:`RampSchedule`) runs over *consumed samples* (sequences), not updates: the number of
updates depends on what the controller does, but the run's samples (micro-batches x micro-batch x processes, every
epoch) are known before training, so warmup and decay are defined whatever the batch did (Megatron's LR over
consumed samples). The shapes are transformers' (``get_scheduler``: linear, cosine, constant_with_warmup, ...),
evaluated at the samples consumed before the update. ``RampSchedule`` is the loop's LR scheduler: the stepper
reads its LR before the update and steps it once per *applied* update; its ``state_dict`` holds the samples
consumed and the controller's state, so a resumed run continues the same decisions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

from hf_accum.errors import InputError

LR_RULES = ("constant", "sqrt", "seesaw")
AUTO = "auto"


class AutoRampError(InputError):
    """A ``rampup_batch_size='auto'`` setting the run cannot use (the message names the key and what is allowed)."""


@dataclass(frozen=True)
class AutoRampSettings:
    """The controller's and the LR rule's settings (``LoopConfig.rampup_auto``, the recipe's
    ``accumulation.rampup_auto``)."""

    min_batch_size: int | None = None
    """Sequences per update at the start (a multiple of micro-batch x processes); None: two micro-batches per
    process, the smallest window the noise scale is measured in."""
    margin: float = 2.0
    """Grow when the smoothed noise scale exceeds ``margin`` x the update's targets."""
    release: float = 1.0
    """A reading below ``release`` x the targets resets the count (hysteresis; between the two it holds)."""
    patience: int = 3
    """Readings above the margin in a row before the batch grows."""
    min_updates: int = 10
    """Updates at a batch before it may change again (the start batch included)."""
    growth: int = 2
    """K is multiplied by this at each change (capped at the configured K)."""
    lr_rule: str = "constant"
    """``constant``, ``sqrt`` or ``seesaw`` (see the module docstring)."""

    @classmethod
    def of(cls, value: Any, key: str = "rampup_auto") -> AutoRampSettings:
        """From None (the defaults), a dict of these fields, or an instance; checked."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value.checked(key)
        if not isinstance(value, dict):
            raise AutoRampError(f"{key}={value!r}; allowed: a mapping of {', '.join(f.name for f in fields(cls))}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise AutoRampError(f"{key}.{unknown[0]}: unknown key; allowed: {', '.join(f.name for f in fields(cls))}")
        return cls(**value).checked(key)

    def checked(self, key: str = "rampup_auto") -> AutoRampSettings:
        if self.min_batch_size is not None and not _is_int(self.min_batch_size, 1):
            raise AutoRampError(f"{key}.min_batch_size={self.min_batch_size!r} must be null or an integer >= 1")
        for name in ("margin", "release"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise AutoRampError(f"{key}.{name}={value!r} must be a number > 0")
        if self.release > self.margin:
            raise AutoRampError(f"{key}.release={self.release} must be <= margin={self.margin} (the reset threshold "
                                "lies below the growth threshold)")
        for name, minimum in (("patience", 1), ("min_updates", 1), ("growth", 2)):
            if not _is_int(getattr(self, name), minimum):
                raise AutoRampError(f"{key}.{name}={getattr(self, name)!r} must be an integer >= {minimum}")
        if self.lr_rule not in LR_RULES:
            raise AutoRampError(f"{key}.lr_rule={self.lr_rule!r}; allowed: {', '.join(LR_RULES)}")
        return self

    def start_accumulation(self, per_round: int, max_accumulation: int, key: str = "rampup_auto") -> int:
        """K of the first update: ``min_batch_size / per_round`` (checked), else 2 (capped at the configured K)."""
        if self.min_batch_size is None:
            return min(2, max_accumulation)
        if self.min_batch_size % per_round or self.min_batch_size > per_round * max_accumulation:
            lower = max(per_round, self.min_batch_size // per_round * per_round)
            raise AutoRampError(
                f"{key}.min_batch_size={self.min_batch_size} must be a multiple of micro-batch x processes = "
                f"{per_round} (the micro-batch stays fixed, K changes) and at most the global batch "
                f"{per_round * max_accumulation}; nearest valid: {min(lower, per_round * max_accumulation)}"
            )
        return self.min_batch_size // per_round


@dataclass(frozen=True)
class BatchChange:
    """One decision to grow, with its reason: what was measured and the threshold it crossed."""

    update: int
    """The update whose reading decided it; the new batch starts with the next update."""
    old_batch: int
    new_batch: int
    """Sequences per update (all processes)."""
    noise_scale: float
    targets: float
    """The deciding update's targets (all ranks)."""
    threshold: float
    """``margin x targets``: what the smoothed noise scale exceeded ``patience`` times in a row."""
    patience: int

    def reason(self) -> str:
        return (f"batch {self.old_batch} -> {self.new_batch} sequences after update {self.update}: smoothed noise "
                f"scale {self.noise_scale:.0f} targets > threshold {self.threshold:.0f} (margin x {self.targets:.0f} "
                f"targets per update) for {self.patience} updates in a row")


class BatchController:
    """Decides, from one reading per update, the K of the next update (see the module docstring). Pure and
    deterministic: the same readings give the same decisions on every rank and after a resume."""

    def __init__(self, settings: AutoRampSettings, per_round: int, max_accumulation: int,
                 key: str = "rampup_auto") -> None:
        self.settings = settings
        self.per_round = per_round
        """Sequences one micro-batch on every process adds: micro-batch x processes."""
        self.max_accumulation = max_accumulation
        self.min_accumulation = settings.start_accumulation(per_round, max_accumulation, key)
        self.accumulation = self.min_accumulation
        self.above = 0
        """Readings above the margin in a row (held between the thresholds)."""
        self.since_change = 0
        """Updates run at the current batch."""
        self.changes: list[BatchChange] = []

    @property
    def batch(self) -> int:
        return self.accumulation * self.per_round

    @property
    def min_batch(self) -> int:
        return self.min_accumulation * self.per_round

    @property
    def max_batch(self) -> int:
        return self.max_accumulation * self.per_round

    def observe(self, update: int, noise_scale: float | None, targets: float, full_window: bool = True
                ) -> BatchChange | None:
        """Fold one update's reading in; returns the change it decided (the next update's batch), or None."""
        self.since_change += 1
        if noise_scale is None or not full_window or targets <= 0 or self.accumulation >= self.max_accumulation:
            return None
        settings = self.settings
        if noise_scale > settings.margin * targets:
            self.above += 1
        elif noise_scale < settings.release * targets:
            self.above = 0
        if self.above < settings.patience or self.since_change < settings.min_updates:
            return None
        old = self.batch
        self.accumulation = min(self.max_accumulation, self.accumulation * settings.growth)
        self.above = self.since_change = 0
        change = BatchChange(update, old, self.batch, noise_scale, targets, settings.margin * targets,
                             settings.patience)
        self.changes.append(change)
        return change

    def lr_factor(self, batch: int | None = None) -> float:
        """The LR rule's factor at ``batch`` sequences (default: the current batch)."""
        batch = self.batch if batch is None else batch
        rule = self.settings.lr_rule
        if rule == "sqrt":
            return math.sqrt(batch / self.max_batch)
        if rule == "seesaw":
            return math.sqrt(self.min_batch / batch)
        return 1.0

    def describe(self) -> str:
        """What the start line and ``hf-accum plan`` say the controller will do."""
        s = self.settings
        return (f"auto batch ramp: {self.min_batch} -> at most {self.max_batch} sequences per update (K "
                f"{self.min_accumulation}..{self.max_accumulation} x {self.per_round} sequences per round), "
                f"K x{s.growth} when the smoothed noise scale exceeds {s.margin:g} x the update's targets for "
                f"{s.patience} updates in a row (count reset below {s.release:g} x), at least {s.min_updates} "
                f"updates apart; LR rule {s.lr_rule}")

    def notes(self) -> list[str]:
        """What makes this controller unable to do anything (said at the start and by ``hf-accum plan``)."""
        if self.min_batch == self.max_batch:
            return [f"note: the start batch is the global batch ({self.max_batch} sequences): nothing to ramp; raise "
                    "the global batch or lower rampup_auto.min_batch_size"]
        if self.min_accumulation < 2:
            return ["note: one micro-batch per process measures no noise scale, so the batch will not grow; use a "
                    "rampup_auto.min_batch_size of at least 2 micro-batches per process"]
        return []

    def state_dict(self) -> dict[str, Any]:
        return {"accumulation": self.accumulation, "above": self.above, "since_change": self.since_change,
                "changes": [asdict(c) for c in self.changes]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accumulation, self.above = int(state["accumulation"]), int(state["above"])
        self.since_change = int(state["since_change"])
        self.changes = [BatchChange(**c) for c in state["changes"]]


class RampSchedule:
    """The loop's LR scheduler under the auto ramp: ``lr = base_lr x shape(consumed samples) x rule(batch)``.

    ``shape`` is a transformers schedule over ``horizon`` samples (warmup over ``warmup`` samples); ``consumed``
    counts the samples of applied updates (a skipped update does not advance the schedule, as in every
    front-end). :meth:`open_window` sets the LR of the update about to run (its batch is the controller's).
    """

    def __init__(self, optimizer: Any, controller: BatchController, horizon: int, name: str = "linear",
                 warmup: int = 0) -> None:
        self.optimizer = optimizer
        self.controller = controller
        self.horizon = horizon
        self.warmup = warmup
        self.shape = schedule_shape(name, warmup, horizon)
        self.base_lrs = [group.setdefault("initial_lr", group["lr"]) for group in optimizer.param_groups]
        self.consumed = 0
        self.window_samples = 0
        self._set_lr()

    def lr_at(self, consumed: int, batch: int) -> list[float]:
        factor = self.shape(consumed) * self.controller.lr_factor(batch)
        return [base * factor for base in self.base_lrs]

    def open_window(self, micro_batches: int) -> None:
        """The next update takes ``micro_batches`` per rank: its samples, and its LR set now."""
        self.window_samples = micro_batches * self.controller.per_round
        self._set_lr()

    def step(self) -> None:
        """After an applied update: its samples are consumed."""
        self.consumed += self.window_samples
        self.window_samples = 0
        self._set_lr()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def _set_lr(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.lr_at(self.consumed, self.controller.batch)):
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "base_lrs": list(self.base_lrs), "horizon": self.horizon,
                "warmup": self.warmup, "controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "controller" not in state:
            raise AutoRampError("the checkpoint was written by a run without rampup_batch_size='auto' (its LR "
                                "scheduler counts updates); resume it with the checkpoint's settings")
        self.consumed, self.base_lrs = int(state["consumed"]), list(state["base_lrs"])
        self.controller.load_state_dict(state["controller"])
        self._set_lr()


def describe_auto_plan(settings: Any, plan: Any, train_examples: int | None = None, epochs: float = 1.0) -> str:
    """``hf-accum plan``'s lines for the auto ramp on ``plan`` (a :class:`hf_accum.planning.schedule.BatchPlan`: its K
    is the ceiling); with ``train_examples``, the LR schedule's horizon in samples."""
    per_round = plan.micro_batch_size * plan.num_processes
    key = "accumulation.rampup_auto"
    controller = BatchController(AutoRampSettings.of(settings, key), per_round, plan.accumulation_steps, key)
    lines = [controller.describe(), *controller.notes()]
    if train_examples:
        micro_batches = math.ceil(train_examples / per_round)  # per process and epoch (even_batches fills the last)
        horizon = math.ceil(epochs * micro_batches) * per_round
        lines.append(f"LR schedule over {horizon} samples ({epochs:g} epochs of {micro_batches * per_round}), between "
                     f"{math.ceil(horizon / controller.max_batch)} and {math.ceil(horizon / controller.min_batch)} "
                     "updates depending on the measured noise scale")
    return "\n".join(lines)


def schedule_shape(name: str, warmup: int, horizon: int) -> Callable[[int], float]:
    """transformers' LR multiplier ``shape(samples)`` for ``name`` with ``warmup`` and ``horizon`` in samples."""
    import torch
    from transformers import get_scheduler

    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(name, probe, num_warmup_steps=warmup, num_training_steps=horizon)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if not lambdas:
        raise AutoRampError(f"lr_scheduler_type={name!r} with rampup_batch_size='auto': the schedule runs over "
                            "consumed samples and needs a transformers LambdaLR shape (linear, cosine, constant, "
                            "constant_with_warmup, polynomial, ...)")
    return lambdas[0]


def is_auto(rampup_batch_size: Any) -> bool:
    """``rampup_batch_size`` asks for the auto ramp."""
    return isinstance(rampup_batch_size, str) and rampup_batch_size == AUTO


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
