"""Model FLOPs per update, achieved FLOP/s and MFU (model FLOPs utilization) of a training run.

**The convention** (documented in docs/measurements.md, "Utilization"). Model FLOPs are the matmul FLOPs that
one forward and one backward of the model need, counted analytically from its shapes, per update:

* every linear layer outside the output head, per real (non-padding) token: ``2 n`` forward, ``2 n`` for its
  input gradient, and ``2 n`` for its weight gradient only when the weight trains (``n = in x out``). Full
  fine-tuning gives the familiar ``6 N`` per token, a frozen base ``4 N`` plus ``6 N_lora`` for LoRA's adapters;
* the output head (``get_output_embeddings``, tied or not) the same way, but per *target* when the loss counts
  target tokens: the fused loss computes logits only where a target is (:mod:`hf_accum.fused.loss`), and the
  logits anywhere else do not serve training (a logits-path run does that extra work without it counting).
  With another unit (sequences, preference pairs) the head counts per real token;
* attention's two products (scores ``Q K^T`` and ``P V``) per softmax-attention layer and per sequence of
  length ``L``: ``2 L^2 (d_qk + d_v)`` forward and twice that backward (``d_qk`` / ``d_v`` = query heads x the
  query-key / value head dim; ``12 L^2 d`` for the usual ``d_qk = d_v = d``): the full square, as PaLM's MFU and
  ``torch.utils.flop_counter`` count it (no discount for the causal mask). Each layer is read from *its own*
  config where the model has per-layer values (Gemma 4's ``per_layer_config``: its full-attention layers have
  another head dim), and by its ``layer_types`` entry: linear attention / recurrent / convolution layers
  (Qwen3.5's and Qwen3-Next's ``linear_attention``, LFM2's ``conv``) have no ``L^2`` term (their projections are
  linear layers, counted above); a sliding-window or chunked layer of span ``w`` sees at most ``w`` keys per
  query, counted as ``min(sum L^2, w x tokens)`` over the window's sequences (exact when every sequence is
  shorter than ``w`` or every one is longer; otherwise an upper bound). A layer type of unknown cost (sparse or
  compressed attention: DeepSeek-V3.2's ``indexed_attention``) or a hybrid state-space config without
  ``layer_types`` is not counted (FLOPs reported missing, said once), never guessed;
* no recompute: activation checkpointing's second forward is hardware work, not model work (that would be HFU);
  norms, activations, softmax and the optimizer are not matmuls and are not counted.

One caveat of the convention: autograd skips the input gradient of a layer whose input needs none (LoRA without
input gradients: the first layer's projections read the frozen embeddings); the formula counts it, as the
``4 N`` convention does. ``tests/unit/test_utilization.py`` checks the formula against
``torch.utils.flop_counter.FlopCounterMode`` on a tiny Llama (full fine-tuning, LoRA, the fused loss).

**Analytic, not counted.** ``FlopCounterMode`` on the first micro-batch would measure what ran, recompute
included (gradient checkpointing would inflate MFU into HFU), would miss what it has no formula for (CPU's
``_scaled_dot_product_flash_attention_for_cpu`` counts 0 FLOPs in torch 2.13), would add a dispatch per op, and
would describe one micro-batch, not updates whose lengths vary (padding, packing, token budgets). The formula
costs nothing per step: the window tally already sums each micro-batch's real tokens and targets on the
device, and sums the squared sequence lengths in the same all-reduce
(:func:`hf_accum.accumulation.squared_sequence_lengths`), so each update's count is its own, on all ranks.

MFU = achieved model FLOP/s / (the peak of one device for the compute dtype x the processes):
:mod:`hf_accum.measure.peak_flops` says where the peak comes from.

**A meter never stops a run.** Every entry point the front-ends call (:func:`meter_run`, the count it installs at
the update boundary, :meth:`UtilizationMeter.lap` / ``observe`` / ``take_interval``, :func:`summarize`,
:func:`describe`) catches what goes wrong inside it: the run goes on, one warning (main process, once per run)
says which number is missing and why, and the number is reported as missing (``None``, "MFU n/a"), never
guessed. At the start :func:`meter_run` also says once when the run's half-precision compute is slower than
float32 on this CPU (:func:`hf_accum.measure.peak_flops.half_precision_slowdown`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeGuard

import torch

from hf_accum.measure.peak_flops import PeakFlops, device_peak_flops, half_precision_slowdown

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionLayer:
    """One softmax-attention layer's two products, per sequence of length ``L``: scores ``Q K^T`` and ``P V``."""

    score_width: int
    """Query heads x query-key head dim."""
    value_width: int
    """Query heads x value head dim."""
    window: int | None = None
    """The most keys a query sees (sliding window, attention chunk); None: the whole sequence."""

    def flops(self, tokens: float, squared_lengths: float) -> float:
        """Forward + backward FLOPs over sequences of ``tokens`` tokens in all with ``squared_lengths`` = sum
        of ``L^2``: ``6 (d_qk + d_v)`` per query-key pair (see the module docstring for the window's bound)."""
        pairs = squared_lengths if self.window is None else min(squared_lengths, self.window * tokens)
        return 6.0 * (self.score_width + self.value_width) * pairs


@dataclass(frozen=True)
class ModelFlops:
    """A model's matmul sizes, from which :meth:`update_flops` counts any window's model FLOPs."""

    body: int
    """``in x out`` summed over the linear layers outside the output head (LoRA's A and B included)."""
    body_trainable: int
    """The part of ``body`` whose weights train."""
    head: int
    """``in x out`` of the output head's linear layers (its LoRA adapter included)."""
    head_trainable: int
    attention: tuple[AttentionLayer, ...] = ()
    """The softmax-attention layers (none: a config without ``num_hidden_layers`` / ``num_attention_heads``)."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelFlops:
        """Read from the model's linear layers (PEFT wrappers included) and its config."""
        base = _base_model(model)
        head_module = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        head_ids = {id(m) for m in head_module.modules()} if isinstance(head_module, torch.nn.Module) else set()
        sizes = {"body": 0, "body_trainable": 0, "head": 0, "head_trainable": 0}
        for name, module in model.named_modules():
            size = _matmul_size(module)
            if size is None or "original_module" in name.split("."):  # PEFT modules_to_save keeps an unused copy
                continue
            part = "head" if id(module) in head_ids else "body"
            sizes[part] += size
            if module.weight.requires_grad:
                sizes[f"{part}_trainable"] += size
        return cls(**sizes, attention=attention_layers(getattr(base, "config", None)))

    def update_flops(self, tokens: float, head_rows: float, squared_lengths: float) -> float:
        """Model FLOPs of a window of ``tokens`` real tokens, ``head_rows`` positions through the output head and
        ``squared_lengths`` = sum over its sequences of length^2 (see the module docstring)."""
        body = (4 * self.body + 2 * self.body_trainable) * tokens
        head = (4 * self.head + 2 * self.head_trainable) * head_rows
        attention = sum(layer.flops(tokens, squared_lengths) for layer in self.attention)
        return float(body + head + attention)

    def window_flops(self, head_on_targets: bool) -> Callable[[Any], float]:
        """``totals -> FLOPs`` for :attr:`hf_accum.boundary.UpdateBoundary.model_flops` (a
        :class:`~hf_accum.accumulation.WindowTotals` reduced over ranks); ``head_on_targets``: the loss counts
        target tokens (the head's rows are the targets), else every real token goes through the head."""
        def flops(totals: Any) -> float:
            rows = totals.targets if head_on_targets else totals.real_tokens
            return self.update_flops(totals.real_tokens, rows, totals.squared_lengths)

        return flops


def _base_model(model: torch.nn.Module) -> Any:
    """The transformers model under DDP / PEFT / compile wrappers."""
    inner: Any = model
    for _ in range(4):
        if hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):  # DDP, DeepSpeed
            inner = inner.module
        elif hasattr(inner, "_orig_mod"):  # torch.compile
            inner = inner._orig_mod
        elif hasattr(inner, "get_base_model"):  # PEFT
            inner = inner.get_base_model()
        else:
            break
    return inner


def _matmul_size(module: torch.nn.Module) -> int | None:
    """``in x out`` of a linear layer (``nn.Linear`` and its quantized subclasses, GPT-2's ``Conv1D``)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if isinstance(module, torch.nn.Linear):
        return int(module.in_features) * int(module.out_features)  # not weight.numel(): 4-bit weights are packed
    if type(module).__name__ == "Conv1D" and weight.dim() == 2:
        return int(weight.numel())
    return None


# Layer types (a config's ``layer_types``) by what their attention costs; any other type is not counted (the
# FLOPs are then not reported) rather than guessed: sparse / compressed attention (DeepSeek-V3.2's
# ``indexed_attention``, V4's) does not compute the square, a type this code has never seen may not either.
FULL_ATTENTION = {"full_attention", "attention", "noncausal_full_attention", "multihead_attention",
                  "multiquery_attention"}
WINDOWED_ATTENTION = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
NO_SQUARE = {"linear_attention", "conv", "mamba", "mamba2", "ssm", "recurrent"}
"""Layers without a softmax over the sequence: their cost is their projections (linear layers, counted)."""
HYBRID_MARKERS = ("mamba_d_state", "ssm_state_size", "mamba_n_heads", "hybrid_override_pattern", "attn_layer_period",
                  "layers_block_type")
"""Config keys of hybrid state-space models whose attention layers a config without ``layer_types`` does not
place (Jamba, Bamba, Nemotron-H, Granite hybrid): counting every layer as attention would inflate MFU."""


class CannotCountAttention(ValueError):
    """The config does not say what some layer's attention costs."""


def attention_layers(config: Any) -> tuple[AttentionLayer, ...]:
    """The softmax-attention layers of a transformers config (its text part for multimodal ones), each from its
    own per-layer config where the model has them (see the module docstring). Raises
    :class:`CannotCountAttention` where a layer's cost is unknown (the meter then reports no FLOPs)."""
    config = getattr(config, "text_config", None) or config
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int) or count <= 0:
        return ()
    types = getattr(config, "layer_types", None)
    if not types and any(getattr(config, key, None) is not None for key in HYBRID_MARKERS):
        raise CannotCountAttention(f"{type(config).__name__} mixes attention with state-space layers and has no "
                                   "layer_types to say which layer is which")
    per_layer = _per_layer_configs(config, count)
    layers = (_attention_layer(per_layer[i], types[i] if types else None, i) for i in range(count))
    return tuple(layer for layer in layers if layer is not None)


def _per_layer_configs(config: Any, count: int) -> list[Any]:
    """One config per layer: a heterogeneous config's resolved per-layer views (Gemma 4: the full-attention layers'
    ``head_dim`` differs, and reading it from the global config raises), else the config itself ``count`` times."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config] * count


def _attention_layer(config: Any, layer_type: str | None, index: int) -> AttentionLayer | None:
    """Layer ``index``'s attention products; None for a layer without softmax attention (by its ``layer_types``
    entry) or a config without attention heads."""
    if layer_type in NO_SQUARE:
        return None
    if layer_type is not None and layer_type not in FULL_ATTENTION and layer_type not in WINDOWED_ATTENTION:
        raise CannotCountAttention(f"layer {index} is {layer_type!r}, a layer type whose attention cost is not "
                                   "known here")
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    query_key = nope + rope if nope and rope else head_dim  # MLA (DeepSeek-V3): head_dim is the rope part only
    value = getattr(config, "v_head_dim", None) or head_dim
    return AttentionLayer(int(heads) * int(query_key), int(heads) * int(value), _window(config, layer_type, index))


def _window(config: Any, layer_type: str | None, index: int) -> int | None:
    """The keys a query of this layer sees at most: its sliding window or attention chunk (None: all)."""
    if layer_type in WINDOWED_ATTENTION:
        key = WINDOWED_ATTENTION[layer_type]
        span = getattr(config, key, None)
        if not _positive_int(span):
            raise CannotCountAttention(f"layer {index} is {layer_type!r} but the config's {key} is {span!r}")
        return int(span)
    if layer_type is None and getattr(config, "use_sliding_window", True):
        span = getattr(config, "sliding_window", None)  # no layer_types (Mistral): the window is every layer's
        return int(span) if _positive_int(span) else None
    return None


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def compute_dtype(model: torch.nn.Module, mixed_precision: str | None = None) -> torch.dtype:
    """The dtype the model's matmuls run in: the autocast dtype of ``mixed_precision`` (``bf16`` / ``fp16``),
    else the dtype most linear weights are stored in (4-bit layers: their ``compute_dtype``)."""
    if mixed_precision in ("bf16", "fp16"):
        return torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    counts: dict[torch.dtype, int] = {}
    for module in model.modules():
        size = _matmul_size(module)
        if size is None:
            continue
        dtype = getattr(module, "compute_dtype", None) or module.weight.dtype
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            counts[dtype] = counts.get(dtype, 0) + size
    return max(counts, key=lambda d: counts[d]) if counts else torch.get_default_dtype()


# What MissingNumbers names as missing.
TIMING = "update time, FLOP/s and MFU"
FLOPS = "model FLOPs (and so FLOP/s and MFU)"
MFU = "MFU"
SUMMARY = "the run's utilization summary"


_said: set[str] = set()
"""What this process has said (the recipe's memory probes run ``train`` too: one line, not one per probe run)."""


def _say_once(message: str) -> None:
    if message not in _said and _main_process():
        _said.add(message)
        logger.warning("%s", message)


class MissingNumbers:
    """Says once (main process, a logger warning) which number the meter cannot give and why."""

    def __init__(self) -> None:
        self.said: dict[str, str] = {}

    def say(self, number: str, why: object) -> None:
        if number in self.said:
            return
        self.said[number] = reason = _reason(why)
        _say_once(f"{number} not reported: {reason} (training goes on without it)")


def _reason(why: object) -> str:
    return f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else str(why)


def _main_process() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
        torch.distributed.get_rank() == 0


class UtilizationMeter:
    """Times each update and fills its ``seconds``, ``flops_per_second`` and ``mfu`` (its ``flops`` come from the
    boundary); :meth:`take_interval` gives a logging interval's numbers, :func:`summarize` the run's. Nothing it
    does raises: what fails is said once (:class:`MissingNumbers`) and left out."""

    def __init__(self, peak: PeakFlops, world_size: int, clock: Callable[[], float] = time.perf_counter,
                 missing: MissingNumbers | None = None) -> None:
        self.peak = peak
        self.world_size = world_size
        self.clock = clock
        self.missing = missing or MissingNumbers()
        self._last: float | None = None
        self._interval = [0.0, 0.0]  # flops, seconds since the last take_interval()

    @property
    def total_peak(self) -> float | None:
        return self.peak.flops * self.world_size if self.peak.flops else None

    @property
    def started(self) -> bool:
        return self._last is not None

    def start(self) -> None:
        """Training starts now (the first update's time runs from here)."""
        try:
            self._last = self.clock()
        except Exception as error:
            self.missing.say(TIMING, error)

    def observe(self, update: Any) -> None:
        """``update`` (an :class:`~hf_accum.records.UpdateLog`) just closed: its time, FLOP/s and MFU."""
        try:
            for name, value in self.lap(update.flops).items():
                setattr(update, name, value)
        except Exception as error:
            self.missing.say(TIMING, error)

    def lap(self, flops: float | None) -> dict[str, float | None]:
        """An update of ``flops`` model FLOPs closed now: ``{"seconds", "flops_per_second", "mfu"}`` since the
        last lap (or :meth:`start`; empty before it, and where timing fails)."""
        try:
            return self._lap(flops)
        except Exception as error:
            self.missing.say(TIMING, error)
            return {}

    def _lap(self, flops: float | None) -> dict[str, float | None]:
        now = self.clock()
        if self._last is None:
            self._last = now
            return {}
        seconds, self._last = now - self._last, now
        if flops is None or seconds <= 0:
            return {"seconds": seconds}
        self._interval[0] += flops
        self._interval[1] += seconds
        return {"seconds": seconds, "flops_per_second": flops / seconds, "mfu": self.mfu(flops / seconds)}

    def mfu(self, flops_per_second: float) -> float | None:
        peak = self.total_peak
        return flops_per_second / peak if peak else None

    def take_interval(self) -> dict[str, float]:
        """``{"flops_per_second", "mfu"}`` over the updates since the last call (for Trainer's log lines)."""
        try:
            flops, seconds = self._interval
            self._interval = [0.0, 0.0]
            if not seconds:
                return {}
            values = {"flops_per_second": flops / seconds}
            mfu = self.mfu(flops / seconds)
            return values | ({"mfu": mfu} if mfu is not None else {})
        except Exception as error:
            self.missing.say(TIMING, error)
            return {}


def summarize(updates: Iterable[Any], peak: PeakFlops, world_size: int) -> dict[str, Any]:
    """The run's utilization for ``metrics.json``: ``flops_per_update`` (the mean over its updates),
    ``flops_per_second`` (all FLOPs over the updates' time), ``mfu``, the peak and its source. ``updates``:
    :class:`~hf_accum.records.UpdateLog` objects or their dicts (a resumed run's earlier ones included).
    Where that fails: every number None, the source saying why (and a warning)."""
    try:
        return _summarize(updates, peak, world_size)
    except Exception as error:
        MissingNumbers().say(SUMMARY, error)
        return {"flops_per_update": None, "flops_per_second": None, "mfu": None, "peak_flops": None,
                "peak_flops_source": f"not summarized ({_reason(error)})", "compute_dtype": None}


def _summarize(updates: Iterable[Any], peak: PeakFlops, world_size: int) -> dict[str, Any]:
    rows = [u if isinstance(u, Mapping) else vars(u) for u in updates]
    counted = [u for u in rows if u.get("flops") is not None]
    timed = [u for u in counted if u.get("seconds")]
    flops = sum(u["flops"] for u in timed)
    seconds = sum(u["seconds"] for u in timed)
    achieved = flops / seconds if seconds else None
    total_peak = peak.flops * world_size if peak.flops else None
    return {
        "flops_per_update": sum(u["flops"] for u in counted) / len(counted) if counted else None,
        "flops_per_second": achieved,
        "mfu": achieved / total_peak if achieved is not None and total_peak else None,
        "peak_flops": total_peak,
        "peak_flops_source": f"{peak.describe()} x {world_size} process(es)",
        "compute_dtype": peak.dtype,
    }


def describe(summary: Mapping[str, Any]) -> str:
    """The end line's words: ``model FLOPs 1.2e+11/update, 85.3 GFLOP/s, MFU 42.1% (peak ...)``."""
    try:
        if summary.get("flops_per_update") is None:
            return "model FLOPs not counted"
        achieved = summary.get("flops_per_second")
        rate = f", {achieved / 1e9:,.1f} GFLOP/s" if achieved is not None else ""
        mfu = summary.get("mfu")
        mfu_text = f"MFU {mfu:.1%}" if mfu is not None else "MFU n/a"
        return (f"model FLOPs {summary['flops_per_update']:.3g}/update{rate}, {mfu_text} "
                f"({summary['peak_flops_source']})")
    except Exception as error:
        return f"utilization not reported ({_reason(error)})"


def meter_run(boundary: Any, model: torch.nn.Module, unit: str, *, device: Any, mixed_precision: str | None,
              world_size: int, configured: float | None, key: str) -> UtilizationMeter:
    """Count every update's model FLOPs at ``boundary`` (an :class:`~hf_accum.boundary.UpdateBoundary`) and
    return the meter that times them. ``unit``: what the loss counts (``"target"``: the head runs per target).
    Never raises: a count or a peak that cannot be had is left out and said once (:class:`MissingNumbers`); a
    half-precision compute slower than float32 on this CPU is said once too."""
    missing = MissingNumbers()
    boundary.model_flops = _flops_counter(model, unit, missing)
    meter = UtilizationMeter(_peak(model, device, mixed_precision, configured, key, missing), world_size,
                             missing=missing)
    _say_if_half_precision_is_slow(model, device, mixed_precision)
    return meter


def _flops_counter(model: torch.nn.Module, unit: str, missing: MissingNumbers) -> Callable[[Any], float | None] | None:
    """The boundary's ``totals -> FLOPs``, returning None (said once) where counting fails; None where the model's
    FLOPs cannot be read at all."""
    try:
        count = ModelFlops.of(model).window_flops(head_on_targets=unit == "target")
    except Exception as error:
        missing.say(FLOPS, f"cannot count {type(_base_model(model)).__name__}'s: {_reason(error)}")
        return None

    def soft_count(totals: Any) -> float | None:
        try:
            return count(totals)
        except Exception as error:
            missing.say(FLOPS, error)
            return None

    return soft_count


def _peak(model: torch.nn.Module, device: Any, mixed_precision: str | None, configured: float | None, key: str,
          missing: MissingNumbers) -> PeakFlops:
    """One device's peak (:mod:`hf_accum.measure.peak_flops`); unknown (said once: no MFU) where it cannot be had."""
    try:
        peak = device_peak_flops(device, compute_dtype(model, mixed_precision), configured, key)
    except Exception as error:
        peak = PeakFlops(None, f"not found: {_reason(error)}; set {key}")
    if peak.flops is None:
        missing.say(MFU, peak.describe())
    elif _main_process():
        logger.info("MFU against %s", peak.describe())  # where the denominator comes from, before the first step
    return peak


def _say_if_half_precision_is_slow(model: torch.nn.Module, device: Any, mixed_precision: str | None) -> None:
    """One line (main process) when the run computes in bf16 / fp16 on a CPU whose half-precision GEMMs are
    slower than its float32 ones, with the measured ratio and what to set instead."""
    try:
        dtype = compute_dtype(model, mixed_precision)
        slowdown = half_precision_slowdown(device, dtype)
    except Exception as error:  # the check is advice: it may not stop the run either
        logger.debug("half-precision speed not checked: %s", _reason(error))
        return
    if slowdown is not None:
        _say_once(f"{slowdown}: {_precision_advice(mixed_precision)}")


def _precision_advice(mixed_precision: str | None) -> str:
    if mixed_precision in ("bf16", "fp16"):
        return (f"turn {mixed_precision} autocast off (recipe: training.{mixed_precision}=false; Trainer: "
                f"TrainingArguments({mixed_precision}=False); loop: Accelerator(mixed_precision='no'))")
    return "load the model in float32 (recipe: model.dtype=float32; from_pretrained(..., dtype=torch.float32))"
