"""AccumulationSettings: every accumulation setting, declared once (a field, its type, its docstring) and checked
once (:meth:`AccumulationSettings.validate`, run by ``__post_init__``).

Three front-ends hold the same object, by composition, never a copy:

* ``LoopConfig.accumulation`` (:class:`hf_accum.loop.LoopConfig`, the Accelerate loop's settings);
* ``AccumTrainer(accumulation=...)`` / ``trainer.accumulation`` (:class:`hf_accum.trainer.AccumTrainer`);
* the recipe's ``accumulation:`` section (``RecipeConfig.accumulation`` *is* an instance: its keys, types and
  documentation are these fields), which the recipe hands to either engine as is.

Composition, not inheritance: the recipe's section object itself reaches the loop or the Trainer (nothing is
copied field by field, so a value cannot be lost or checked twice on the way), and the class stays free of the
loop's own settings (epochs, LR, checkpoints). The flat keyword arguments of the older API
(``LoopConfig(noise_scale=True)``, ``AccumTrainer(noise_scale=True)``) stay as a thin adapter,
:meth:`AccumulationSettings.adapt`, which builds this class from them; ``loop_config.noise_scale`` reads through.

A new accumulation setting is one field here: the loop, AccumTrainer and the recipe (a key, its type checked by
pydantic, its documentation) take it from this class. This module imports no torch (the recipe's config schema
reads it before anything heavy loads).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, fields
from typing import Any, Iterator

from hf_accum.errors import InputError
from hf_accum.planning.auto_ramp import AutoRampError, AutoRampSettings, is_auto

DEFAULT_MAX_CONSECUTIVE_NONFINITE = 5
"""Skipped inf/NaN updates in a row before the run stops: an isolated bad micro-batch is survivable, five
consecutive updates mean the run has diverged."""
NORMALIZATIONS = ("token", "sequence")
"""``normalization``: the unit an update's loss is the mean over (:mod:`hf_accum.losses.sequence_norm`)."""
MICRO_BATCH_MODES = ("every", "first")
"""``noise_scale_micro_batches``: which micro-batches are the noise scale's small batches
(:mod:`hf_accum.measure.noise_probe`)."""


class AccumulationSettingsError(InputError):
    """A setting of :class:`AccumulationSettings` holds a value the engines cannot use (the message names it)."""


# How checks name a setting (``accumulation.noise_scale``, ``LoopConfig.noise_scale``, ``AccumTrainer(noise_scale)``)
# and the error they raise: each front-end's own terms.
_NAMING: contextvars.ContextVar[tuple[str, type[InputError]]] = contextvars.ContextVar(
    "accumulation_naming", default=("accumulation.{}", AccumulationSettingsError)
)


@contextlib.contextmanager
def naming(pattern: str, error: type[InputError] = AccumulationSettingsError) -> Iterator[None]:
    """Within the block, checks name a setting ``pattern.format(name)`` and raise ``error`` (a front-end's own)."""
    token = _NAMING.set((pattern, error))
    try:
        yield
    finally:
        _NAMING.reset(token)


def key(name: str) -> str:
    """The name of setting ``name`` in the current front-end's terms (:func:`naming`)."""
    return _NAMING.get()[0].format(name)


def _refuse(message: str) -> InputError:
    return _NAMING.get()[1](message)


@dataclass
class AccumulationSettings:
    """How each optimizer update is formed, measured and guarded (every field checked by :meth:`validate`)."""

    loss_kind: str | None = None
    """``causal_lm``, ``token`` or ``sequence`` (:data:`hf_accum.losses.token_loss.LOSS_KIND_SPECS`); None: inferred
    from the model class, else from the model's own loss on the first micro-batch."""
    fused_loss: bool = True
    """Causal LMs: sum the loss from the last hidden states and the output layer, chunk by chunk, never holding the
    (tokens x vocab) logits (:mod:`hf_accum.fused.loss`). Heads that are not a plain linear map (soft-capping, logit
    scale, ...) and a custom loss keep the logits path."""
    fp32_grad_accumulation: bool = True
    """Sum the micro-batch gradients of bf16/fp16 *weights* in fp32 (single process; with mixed precision bf16 and
    fp32 weights, gradients are fp32 anyway)."""
    normalization: str = "token"
    """``token``: the update's loss is the mean over its target tokens; ``sequence``: the mean over its sequences of
    each sequence's mean token loss (causal LMs; long answers do not dominate; packed rows count one sequence per
    restart of ``position_ids``; :mod:`hf_accum.losses.sequence_norm`). Sequence mode takes the logits path."""
    rampup_batch_size: list[int] | str | None = None
    """``[start, increment, samples]`` (Megatron's ``--rampup-batch-size``; loop engine): the global batch starts at
    ``start`` sequences and grows by ``increment`` towards ``micro x processes x K`` over ``samples`` sequences; the
    window changes, the micro-batch stays (:mod:`hf_accum.loop.windows`). ``auto``: the batch grows from a minimum
    towards that global batch when the measured noise scale says it pays (:mod:`hf_accum.planning.auto_ramp`; turns
    ``noise_scale`` on; the LR schedule then runs over consumed samples, so ``max_steps`` and ``warmup_steps`` are
    refused: use a warmup ratio)."""
    rampup_auto: dict[str, Any] | AutoRampSettings | None = None
    """With ``rampup_batch_size: auto``: the controller's settings
    (:class:`hf_accum.planning.auto_ramp.AutoRampSettings` or a mapping of its fields: ``min_batch_size``,
    ``margin``, ``release``, ``patience``, ``min_updates``, ``growth``, ``lr_rule``: constant | sqrt | seesaw)."""
    tokens_per_update: int | None = None
    """Close an update once its window holds at least this many targets on all ranks (loop engine; planned before
    each epoch from the data order); replaces the global batch (the Accelerator's K then sizes no window)."""
    noise_scale: bool = False
    """Track the gradient noise scale (``UpdateLog.noise_scale``, ``grad_sq``, ``trace_cov``; an end-of-run line on
    the batch size): micro-batches are the small batches, the update the big one (:mod:`hf_accum.measure.noise_probe`).
    Needs >= 2 micro-batches per update (over all ranks); not under DeepSpeed or FSDP."""
    noise_scale_micro_batches: str = "every"
    """With ``noise_scale``: ``every`` micro-batch of the window is a small batch (hooks on the parameters, no extra
    memory; ~18x fewer updates to the same precision at K=4), or only each window's ``first`` per rank (one norm per
    update; works with reentrant checkpointing of shared parameters)."""
    peak_flops: float | None = None
    """One device's peak FLOP/s for the model's compute dtype, the denominator of MFU (``UpdateLog.mfu``); None:
    ``$HF_ACCUM_PEAK_FLOPS``, else a GPU's data-sheet peak by name, else a GEMM measured on the CPU
    (:mod:`hf_accum.measure.peak_flops`)."""
    max_consecutive_nonfinite: int = DEFAULT_MAX_CONSECUTIVE_NONFINITE
    """Updates skipped for inf/NaN losses or gradients in a row before the run writes a checkpoint and raises
    :class:`hf_accum.control.NonFiniteLossError`."""
    stop_on_signals: bool = True
    """SIGTERM/SIGUSR1/SIGINT during training: finish the update, checkpoint, raise
    :class:`hf_accum.control.TrainingStopped` (exit code 75, or 130 for Ctrl-C)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> AccumulationSettings:
        """Raise naming the first bad setting and what it allows (:func:`naming`); returns ``self``. With
        ``rampup_batch_size='auto'``, ``noise_scale`` is turned on (the controller's measurement)."""
        for name in ("fused_loss", "fp32_grad_accumulation", "noise_scale", "stop_on_signals"):
            if not isinstance(getattr(self, name), bool):
                raise _refuse(f"{key(name)}={getattr(self, name)!r} must be True or False")
        try:
            check_normalization(self.normalization, key("normalization"), self.loss_kind)
            check_micro_batch_mode(self.noise_scale_micro_batches, key("noise_scale_micro_batches"))
        except ValueError as error:
            raise _refuse(str(error)) from None
        if (problem := check_peak_flops(self.peak_flops, key("peak_flops"))) is not None:
            raise _refuse(problem)
        if not _is_int(self.max_consecutive_nonfinite, 1):
            raise _refuse(f"{key('max_consecutive_nonfinite')}={self.max_consecutive_nonfinite!r} must be an "
                          "integer >= 1")
        self._validate_windows()
        return self

    def _validate_windows(self) -> None:
        ramp, budget = self.rampup_batch_size, self.tokens_per_update
        if ramp is not None and budget is not None:
            raise _refuse(f"{key('rampup_batch_size')} and {key('tokens_per_update')} both set; allowed: one of them")
        if is_auto(ramp):
            try:  # checked, kept as given (a mapping stays one: the recipe saves it)
                AutoRampSettings.of(self.rampup_auto, key("rampup_auto"))
            except AutoRampError as error:
                raise _refuse(str(error)) from None
            self.noise_scale = True  # the controller's measurement
        elif self.rampup_auto is not None:
            raise _refuse(f"{key('rampup_auto')} is set but rampup_batch_size is not 'auto'; allowed: None")
        elif ramp is not None:
            values: list[Any] = list(ramp) if isinstance(ramp, (list, tuple)) else [ramp]
            if len(values) != 3 or not all(_is_int(v, 1) for v in values):
                raise _refuse(f"{key('rampup_batch_size')}={ramp!r} must be three integers >= 1 [start, increment, "
                              "samples] or 'auto'")
            self.rampup_batch_size = values
        if budget is not None and not _is_int(budget, 1):
            raise _refuse(f"{key('tokens_per_update')}={budget!r} must be None or an integer >= 1")
        if budget is not None and self.normalization != "token":
            raise _refuse(f"{key('tokens_per_update')} with normalization={self.normalization!r}: a token budget "
                          "counts target tokens; allowed: normalization='token'")

    @property
    def auto_ramp(self) -> bool:
        """``rampup_batch_size='auto'``: the window is decided between updates by the noise-scale controller."""
        return is_auto(self.rampup_batch_size)

    @property
    def planned_windows(self) -> bool:
        """The window changes from update to update (ramp-up or a token budget)."""
        return self.rampup_batch_size is not None or self.tokens_per_update is not None

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every setting's name (the flat keyword arguments the front-ends accept)."""
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def adapt(cls, settings: AccumulationSettings | None, flat: dict[str, Any], pattern: str,
              error: type[InputError] = AccumulationSettingsError) -> AccumulationSettings:
        """The thin adapter of the flat keyword arguments: ``settings`` as given, or built from the setting names
        popped out of ``flat`` (checked, errors named ``pattern.format(name)``); both at once is refused."""
        given = {name: flat.pop(name) for name in sorted(cls.names() & flat.keys())}
        if settings is not None and given:
            raise error(f"{pattern.format(next(iter(given)))} given beside {pattern.format('accumulation')}: set "
                        "each accumulation setting in one place; allowed: one of them")
        if settings is None:
            with naming(pattern, error):
                return cls(**given)
        if not isinstance(settings, AccumulationSettings):
            raise error(f"{pattern.format('accumulation')}={settings!r} must be an AccumulationSettings")
        with naming(pattern.format("accumulation") + ".{}", error):  # changed since it was built? checked again
            return settings.validate()


def check_normalization(value: Any, key: str, loss_kind: str | None = "causal_lm") -> None:
    """One line naming ``key`` and what it allows; sequence mode is for causal LMs (token targets)."""
    if value not in NORMALIZATIONS:
        raise ValueError(f"{key}={value!r}; allowed: {', '.join(repr(n) for n in NORMALIZATIONS)}")
    if value == "sequence" and loss_kind not in (None, "causal_lm"):
        raise ValueError(f"{key}='sequence' needs loss_kind 'causal_lm' (got {loss_kind!r}); a sequence head's "
                         "loss is already one term per sequence: use 'token'")


def check_micro_batch_mode(value: object, where: str) -> str:
    """``value`` if it is one of :data:`MICRO_BATCH_MODES`, else a ValueError naming ``where`` and the choices."""
    if value not in MICRO_BATCH_MODES:
        raise ValueError(f"{where}={value!r}; allowed: {', '.join(MICRO_BATCH_MODES)}")
    return str(value)


def check_peak_flops(value: object, key: str) -> str | None:
    """Why ``value`` cannot be a configured peak (None: it can): a number > 0 (FLOP/s per device) or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        return f"{key}={value!r} must be None or a number of FLOP/s per device > 0 (e.g. 989e12)"
    return None


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
