"""LoopConfig: the Accelerate loop's settings, validated when built (:class:`LoopConfigError`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from hf_accum.control import DEFAULT_MAX_CONSECUTIVE_NONFINITE
from hf_accum.errors import InputError
from hf_accum.losses.sequence_norm import check_normalization
from hf_accum.losses.token_loss import LossKind
from hf_accum.measure.noise_probe import check_micro_batch_mode
from hf_accum.measure.peak_flops import check_peak_flops
from hf_accum.planning.auto_ramp import AutoRampError, AutoRampSettings, is_auto

_STRATEGIES = ("no", "steps", "epoch")
_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# TrainingArguments field -> the LoopConfig field it sets (torch.compile's settings).
_COMPILE_ARGUMENTS = {"torch_compile": "compile", "torch_compile_backend": "compile_backend",
                      "torch_compile_mode": "compile_mode"}


class LoopConfigError(InputError):
    """A :class:`LoopConfig` field holds a value the loop cannot use (the message names field and allowed values)."""


@dataclass
class LoopConfig:
    """Training-loop settings; names follow ``transformers.TrainingArguments`` where they overlap."""

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
    loss_kind: LossKind | None = None
    """``causal_lm``, ``token`` or ``sequence`` (:data:`hf_accum.losses.token_loss.LOSS_KIND_SPECS`); when None,
    inferred from the model class, else from the model's own loss on the first micro-batch."""
    fused_loss: bool = True
    """Causal LMs: sum the loss from the last hidden states and the output layer, chunk by chunk,
    never holding the (tokens x vocab) logits (:mod:`hf_accum.fused.loss`). Heads that are not a plain
    linear map (soft-capping, logit scale, ...) and a custom ``loss_sum_fn`` keep the logits path."""
    disable_tqdm: bool = False
    fp32_grad_accumulation: bool = True
    """Sum the micro-batch gradients of bf16/fp16 *weights* in fp32 (single process; with
    mixed_precision='bf16' and fp32 weights, gradients are fp32 anyway)."""
    output_dir: str | None = None
    """Where ``checkpoint-<update>`` directories go (one directory shared by all processes); None: no
    checkpoints."""
    save_strategy: str = "steps"
    """``"steps"`` (every ``save_steps`` updates), ``"epoch"`` (after each epoch's last update) or ``"no"``.
    With an ``output_dir``, a stop signal or request writes a checkpoint whatever the strategy."""
    save_steps: int = 500
    save_total_limit: int | None = None
    """Keep only this many newest checkpoints (older ones are deleted after the new one is complete)."""
    max_consecutive_nonfinite: int = DEFAULT_MAX_CONSECUTIVE_NONFINITE
    """Updates skipped for inf/NaN losses or gradients in a row before the run writes a checkpoint and raises
    :class:`hf_accum.control.NonFiniteLossError`."""
    stop_on_signals: bool = True
    """SIGTERM/SIGUSR1/SIGINT during ``train``: finish the update, checkpoint, raise
    :class:`hf_accum.control.TrainingStopped` (exit code 75, or 130 for Ctrl-C)."""
    eval_strategy: str = "no"
    """With ``train(eval_dataloader=...)``: ``steps`` (every ``eval_steps`` updates and after the last),
    ``epoch`` (after each epoch's last update) or ``no``. Evaluates the exact per-token held-out loss."""
    eval_steps: float | None = None
    """Updates between evaluations for ``eval_strategy='steps'``."""
    rampup_batch_size: list[int] | str | None = None
    """``[start, increment, samples]`` (Megatron's ``--rampup-batch-size``): the global batch starts at ``start``
    sequences and grows by ``increment`` towards ``micro x processes x K`` (K: the Accelerator's
    ``gradient_accumulation_steps``) over ``samples`` sequences; the window changes, the micro-batch stays
    (:mod:`hf_accum.loop.windows`). ``"auto"``: the batch grows from a minimum towards that global batch when the
    measured noise scale says it pays (:mod:`hf_accum.planning.auto_ramp`; turns ``noise_scale`` on; the LR schedule
    then runs over consumed samples, so ``max_steps`` and ``warmup_steps`` are refused: use ``warmup_ratio``)."""
    rampup_auto: Any = None
    """With ``rampup_batch_size="auto"``: :class:`hf_accum.planning.auto_ramp.AutoRampSettings` or a dict of its fields
    (``min_batch_size``, ``margin``, ``release``, ``patience``, ``min_updates``, ``growth``, ``lr_rule``)."""
    tokens_per_update: int | None = None
    """Close an update once its window holds at least this many targets on all ranks (planned before each
    epoch from the data order). The Accelerator's ``gradient_accumulation_steps`` then sizes no window (the
fixed ``1 / K`` of ``Accelerator.backward`` is undone at the boundary as always)."""
    normalization: str = "token"
    """``"token"``: the update's loss is the mean over its targets; ``"sequence"``: the mean over its sequences of
    each sequence's mean token loss (causal LMs; packed rows count one sequence per restart of
    ``position_ids``; :mod:`hf_accum.losses.sequence_norm`). Sequence mode takes the logits path (logged)."""
    noise_scale: bool = False
    """Track the gradient noise scale (``UpdateLog.noise_scale``, ``grad_sq``, ``trace_cov``; an end-of-run line
    on the batch size): micro-batches are the small batches, the update the big one
    (:mod:`hf_accum.measure.noise_probe`). Needs >= 2 micro-batches per update (over all ranks); not under DeepSpeed or
    FSDP."""
    noise_scale_micro_batches: str = "every"
    """With ``noise_scale``: ``"every"`` micro-batch of the window is a small batch (hooks on the parameters, no
    extra memory; ~18x fewer updates to the same precision at K=4), or only each window's ``"first"`` per rank
    (one norm per update; works with reentrant checkpointing of shared parameters)."""
    peak_flops: float | None = None
    """One device's peak FLOP/s for the model's compute dtype, the denominator of MFU (``UpdateLog.mfu``); None:
    ``$HF_ACCUM_PEAK_FLOPS``, else a GPU's data-sheet peak by name, else a GEMM measured on the CPU
    (:mod:`hf_accum.measure.peak_flops`)."""

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

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> LoopConfig:
        """Raise :class:`LoopConfigError` naming the first bad field and what it allows; returns ``self``."""
        _one_of(self, "save_strategy", _STRATEGIES)
        _one_of(self, "eval_strategy", _STRATEGIES)
        if self.save_strategy == "steps" and not _is_int(self.save_steps, 1):
            raise LoopConfigError(f"LoopConfig.save_steps={self.save_steps!r} must be an integer >= 1")
        if self.save_total_limit is not None and not _is_int(self.save_total_limit, 1):
            raise LoopConfigError(
                f"LoopConfig.save_total_limit={self.save_total_limit!r} must be None or an integer >= 1"
            )
        if not _is_int(self.max_consecutive_nonfinite, 1):
            raise LoopConfigError(
                f"LoopConfig.max_consecutive_nonfinite={self.max_consecutive_nonfinite!r} must be an integer >= 1"
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
        try:
            check_normalization(self.normalization, "LoopConfig.normalization", self.loss_kind)
        except ValueError as error:
            raise LoopConfigError(str(error)) from None
        if not isinstance(self.noise_scale, bool):
            raise LoopConfigError(f"LoopConfig.noise_scale={self.noise_scale!r} must be True or False")
        try:
            check_micro_batch_mode(self.noise_scale_micro_batches, "LoopConfig.noise_scale_micro_batches")
        except ValueError as error:
            raise LoopConfigError(str(error)) from None
        if (problem := check_peak_flops(self.peak_flops, "LoopConfig.peak_flops")) is not None:
            raise LoopConfigError(problem)
        if self.eval_steps is not None and self.eval_strategy == "steps":  # unused by the other strategies
            _in_range(self, "eval_steps", 0.0, float("inf"), "None or > 0", open_below=True)
        self._validate_windows()
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

    def _validate_windows(self) -> None:
        ramp, budget = self.rampup_batch_size, self.tokens_per_update
        if ramp is not None and budget is not None:
            raise LoopConfigError(
                "LoopConfig.rampup_batch_size and LoopConfig.tokens_per_update both set; allowed: one of them"
            )
        if is_auto(ramp):
            self._validate_auto()
        elif self.rampup_auto is not None:
            raise LoopConfigError("LoopConfig.rampup_auto is set but rampup_batch_size is not 'auto'; allowed: None")
        elif ramp is not None:
            values: list[Any] = list(ramp) if isinstance(ramp, (list, tuple)) else [ramp]
            if len(values) != 3 or not all(_is_int(v, 1) for v in values):
                raise LoopConfigError(
                    f"LoopConfig.rampup_batch_size={ramp!r} must be three integers >= 1 [start, increment, samples] "
                    "or 'auto'"
                )
            self.rampup_batch_size = values
        if budget is not None and not _is_int(budget, 1):
            raise LoopConfigError(f"LoopConfig.tokens_per_update={budget!r} must be None or an integer >= 1")
        if budget is not None and self.normalization != "token":
            raise LoopConfigError(
                f"LoopConfig.tokens_per_update with normalization={self.normalization!r}: a token budget counts "
                "target tokens; allowed: normalization='token'"
            )

    def _validate_auto(self) -> None:
        try:
            self.rampup_auto = AutoRampSettings.of(self.rampup_auto, "LoopConfig.rampup_auto")
        except AutoRampError as error:
            raise LoopConfigError(str(error)) from None
        # The number of updates depends on the controller: a horizon in updates cannot be stated.
        if _is_int(self.max_steps, 1):
            raise LoopConfigError(f"LoopConfig.max_steps={self.max_steps} with rampup_batch_size='auto': the run's "
                                  "length is its data (num_train_epochs); allowed: -1")
        if self.warmup_steps:
            raise LoopConfigError(f"LoopConfig.warmup_steps={self.warmup_steps} with rampup_batch_size='auto': the "
                                  "LR schedule runs over consumed samples; allowed: 0 (use warmup_ratio)")
        self.noise_scale = True  # the controller's measurement

    @property
    def planned_windows(self) -> bool:
        """The window changes from update to update (ramp-up or a token budget)."""
        return self.rampup_batch_size is not None or self.tokens_per_update is not None

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
            "label_smoothing", "loss_kind", "fp32_grad_accumulation", "warmup_ratio", "fused_loss",
            "max_consecutive_nonfinite", "stop_on_signals", "rampup_batch_size", "tokens_per_update",
            "noise_scale", "normalization", "rampup_auto", "noise_scale_micro_batches", "peak_flops",
            "compile_dynamic", *_COMPILE_ARGUMENTS.values(),
        }
        return names | {"label_smoothing_factor", *_COMPILE_ARGUMENTS}


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


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
