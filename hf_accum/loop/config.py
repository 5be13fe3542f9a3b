"""LoopConfig: the Accelerate loop's settings, validated when built (:class:`LoopConfigError`).

The accumulation settings (how updates are formed, measured and guarded) are not declared here: ``LoopConfig``
*holds* an :class:`~hf_accum.settings.AccumulationSettings` as ``accumulation`` (composition, so the recipe's
``accumulation:`` section object itself reaches the loop; :mod:`hf_accum.settings` says why). The flat spelling
stays a thin adapter: ``LoopConfig(noise_scale=True)`` builds the held settings (errors name
``LoopConfig.noise_scale``), and ``config.noise_scale`` reads (and writes) through to them.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from hf_accum.errors import InputError
from hf_accum.settings import AccumulationSettings, naming

_STRATEGIES = ("no", "steps", "epoch")
_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# TrainingArguments field -> the LoopConfig field it sets (torch.compile's settings).
_COMPILE_ARGUMENTS = {"torch_compile": "compile", "torch_compile_backend": "compile_backend",
                      "torch_compile_mode": "compile_mode"}


class LoopConfigError(InputError):
    """A :class:`LoopConfig` field holds a value the loop cannot use (the message names field and allowed values)."""


_ACCUMULATION = AccumulationSettings.names()


@dataclass(init=False)
class LoopConfig:
    """Training-loop settings; names follow ``transformers.TrainingArguments`` where they overlap."""

    accumulation: AccumulationSettings = field(default_factory=AccumulationSettings)
    """How each update is formed, measured and guarded (:class:`hf_accum.settings.AccumulationSettings`)."""
    num_train_epochs: float = 1.0
    """Passes over the data (a fraction counts the started epoch's full windows)."""
    max_steps: int = -1
    """Optimizer updates to run; overrides ``num_train_epochs`` when > 0."""
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    max_grad_norm: float = 1.0
    """Clip the global gradient norm once per update (0 disables clipping)."""
    label_smoothing: float = 0.0
    disable_tqdm: bool = False
    output_dir: str | None = None
    """Where ``checkpoint-<update>`` directories go (one directory shared by all processes); None: no
    checkpoints."""
    save_strategy: str = "steps"
    """``"steps"`` (every ``save_steps`` updates), ``"epoch"`` (after each epoch's last update) or ``"no"``.
    With an ``output_dir``, a stop signal or request writes a checkpoint whatever the strategy."""
    save_steps: int = 500
    save_total_limit: int | None = None
    """Keep only this many newest checkpoints (older ones are deleted after the new one is complete)."""
    eval_strategy: str = "no"
    """With ``train(eval_dataloader=...)``: ``steps`` (every ``eval_steps`` updates and after the last),
    ``epoch`` (after each epoch's last update) or ``no``. Evaluates the exact per-token held-out loss."""
    eval_steps: float | None = None
    """Updates between evaluations for ``eval_strategy='steps'``."""
    ddp_find_unused_parameters: bool | None = None
    """DDP's ``find_unused_parameters`` (``TrainingArguments.ddp_find_unused_parameters``); None: as ``Trainer``
    decides it, on unless the model uses activation checkpointing, so a parameter that gets no gradient (a vision
    tower's unused norm) does not stop DDP (:mod:`hf_accum.loop.ddp`)."""

    compile: bool = False
    """``torch.compile`` the model's repeated blocks (decoder layers) in place before training
    (:mod:`hf_accum.compile`: embeddings, the head and the fused loss stay eager, evaluation runs eager; the
    gradients stay exact). ``TrainingArguments.torch_compile``."""
    compile_backend: str = "inductor"
    """``torch.compile``'s backend (``TrainingArguments.torch_compile_backend``)."""
    compile_mode: str | None = None
    """``torch.compile``'s mode, e.g. ``"max-autotune-no-cudagraphs"`` (``TrainingArguments.torch_compile_mode``)."""
    compile_dynamic: bool | None = None
    """``torch.compile``'s ``dynamic``: None compiles the first length statically and one dynamic-length graph at
    the second (bounded recompiles with variable lengths); True starts dynamic; False compiles one graph per
    length (pair it with a collator's ``pad_to_multiple_of``)."""

    def __init__(self, accumulation: AccumulationSettings | None = None, **values: Any) -> None:
        """Every field by name (keywords only); the accumulation settings as ``accumulation``, or flat
        (``noise_scale=True``: :meth:`AccumulationSettings.adapt`), not both."""
        self.accumulation = AccumulationSettings.adapt(accumulation, values, "LoopConfig.{}", LoopConfigError)
        for spec in fields(self):
            if spec.name != "accumulation":
                setattr(self, spec.name, values.pop(spec.name) if spec.name in values else _default(spec))
        if values:
            raise TypeError(f"LoopConfig() got an unexpected keyword argument {next(iter(values))!r}")
        self.validate()

    def __getattr__(self, name: str) -> Any:
        """A flat read of an accumulation setting (``config.noise_scale``): the held settings' value."""
        held = self.__dict__.get("accumulation")
        if name in _ACCUMULATION and held is not None:
            return getattr(held, name)
        raise AttributeError(f"'LoopConfig' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ACCUMULATION:  # a flat write: the held settings' field (checked by validate, as any)
            setattr(self.accumulation, name, value)
        else:
            super().__setattr__(name, value)

    def validate(self) -> LoopConfig:
        """Raise :class:`LoopConfigError` naming the first bad field and what it allows; returns ``self``."""
        with naming("LoopConfig.{}", LoopConfigError):  # the held settings' own checks, in the loop's terms
            self.accumulation.validate()
        _one_of(self, "save_strategy", _STRATEGIES)
        _one_of(self, "eval_strategy", _STRATEGIES)
        if self.save_strategy == "steps" and not _is_int(self.save_steps, 1):
            raise LoopConfigError(f"LoopConfig.save_steps={self.save_steps!r} must be an integer >= 1")
        if self.save_total_limit is not None and not _is_int(self.save_total_limit, 1):
            raise LoopConfigError(
                f"LoopConfig.save_total_limit={self.save_total_limit!r} must be None or an integer >= 1"
            )
        if not _is_int(self.max_steps, -1):
            raise LoopConfigError(f"LoopConfig.max_steps={self.max_steps!r} must be an integer (-1 or 0: no limit)")
        if not _is_int(self.warmup_steps, 0):
            raise LoopConfigError(f"LoopConfig.warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if self.ddp_find_unused_parameters not in (None, True, False):
            raise LoopConfigError(f"LoopConfig.ddp_find_unused_parameters={self.ddp_find_unused_parameters!r}; "
                                  "allowed: None (as Trainer decides), True, False")
        _in_range(self, "warmup_ratio", 0.0, 1.0, "between 0 and 1")
        _in_range(self, "label_smoothing", 0.0, 1.0, "at least 0 and below 1", closed=False)
        if self.max_grad_norm is not None:
            _in_range(self, "max_grad_norm", 0.0, float("inf"), ">= 0 (0 or None: no clipping)")
        if self.eval_steps is not None and self.eval_strategy == "steps":  # unused by the other strategies
            _in_range(self, "eval_steps", 0.0, float("inf"), "None or > 0", open_below=True)
        if self.accumulation.auto_ramp:
            self._validate_auto()
        self._validate_compile()
        return self

    def _validate_compile(self) -> None:
        if not isinstance(self.compile, bool):
            raise LoopConfigError(f"LoopConfig.compile={self.compile!r} must be True or False")
        if not any(self.compile_dynamic is allowed for allowed in (None, True, False)):
            raise LoopConfigError(f"LoopConfig.compile_dynamic={self.compile_dynamic!r} must be None, True or False")
        if self.compile_mode not in _COMPILE_MODES:
            raise LoopConfigError(f"LoopConfig.compile_mode={self.compile_mode!r}; allowed: "
                                  f"{', '.join(repr(mode) for mode in _COMPILE_MODES)}")
        if self.compile:  # the registry is read only when compiling (importing Dynamo costs a second)
            import torch._dynamo

            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile_backend not in backends:
                raise LoopConfigError(f"LoopConfig.compile_backend={self.compile_backend!r}; allowed: "
                                      f"{', '.join(repr(name) for name in backends)}")

    def _validate_auto(self) -> None:
        # The number of updates depends on the controller: a horizon in updates cannot be stated.
        if _is_int(self.max_steps, 1):
            raise LoopConfigError(f"LoopConfig.max_steps={self.max_steps} with rampup_batch_size='auto': the run's "
                                  "length is its data (num_train_epochs); allowed: -1")
        if self.warmup_steps:
            raise LoopConfigError(f"LoopConfig.warmup_steps={self.warmup_steps} with rampup_batch_size='auto': the "
                                  "LR schedule runs over consumed samples; allowed: 0 (use warmup_ratio)")

    @property
    def planned_windows(self) -> bool:
        """The window changes from update to update (ramp-up or a token budget)."""
        return self.accumulation.planned_windows

    @classmethod
    def from_training_arguments(cls, args: Any, **changes: Any) -> LoopConfig:
        """The loop settings a ``transformers.TrainingArguments`` holds (same names, except that
        ``label_smoothing_factor`` is ``label_smoothing``, ``torch_compile*`` are ``compile*`` and a ``warmup_steps``
        below 1 is a ratio)."""
        warmup = args.warmup_steps
        values = {name: getattr(args, name) for name in cls.training_argument_names() if hasattr(args, name)}
        for strategy in ("eval_strategy", "save_strategy"):  # TrainingArguments holds enums
            values[strategy] = str(getattr(getattr(args, strategy), "value", getattr(args, strategy)))
        if values["eval_strategy"] == "steps" and not args.eval_steps:
            values["eval_steps"] = args.logging_steps  # Trainer's rule: eval_steps defaults to logging_steps
        values.update(
            warmup_steps=int(warmup) if warmup >= 1 else 0,
            warmup_ratio=warmup if warmup < 1 else 0.0,
            label_smoothing=args.label_smoothing_factor,
        )
        values.pop("label_smoothing_factor", None)
        for argument, name in _COMPILE_ARGUMENTS.items():
            if argument in values:
                values[name] = values.pop(argument)
        values["compile_backend"] = values.get("compile_backend") or "inductor"  # TrainingArguments: None unless set
        return cls(**{**values, **changes})

    @classmethod
    def training_argument_names(cls) -> set[str]:
        """The ``TrainingArguments`` fields this config mirrors."""
        names = {f.name for f in fields(cls)} - {
            "accumulation", "label_smoothing", "warmup_ratio", "compile_dynamic", *_COMPILE_ARGUMENTS.values(),
        }
        return names | {"label_smoothing_factor", *_COMPILE_ARGUMENTS}


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _default(spec: Field[Any]) -> Any:
    if spec.default_factory is not MISSING:
        return spec.default_factory()
    return spec.default


def _one_of(config: LoopConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in allowed:
        raise LoopConfigError(f"LoopConfig.{name}={value!r}; allowed: {', '.join(repr(a) for a in allowed)}")


def _in_range(config: LoopConfig, name: str, low: float, high: float, allowed: str, closed: bool = True,
              open_below: bool = False) -> None:
    value = getattr(config, name)
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    above = number > low if open_below else number >= low
    below = number <= high if closed else number < high
    if not (above and below):
        raise LoopConfigError(f"LoopConfig.{name}={value!r} must be {allowed}")
