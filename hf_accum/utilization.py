"""Model FLOPs per update, achieved FLOP/s and MFU (model FLOPs utilization) of a training run.

**The convention** (documented in docs/measurements.md, "Utilization"). Model FLOPs are the matmul FLOPs that
one forward and one backward of the model need, counted analytically from its shapes, per update:

* every linear layer outside the output head, per real (non-padding) token: ``2 n`` forward, ``2 n`` for its
  input gradient, and ``2 n`` for its weight gradient only when the weight trains (``n = in x out``). Full
  fine-tuning gives the familiar ``6 N`` per token, a frozen base ``4 N`` plus ``6 N_lora`` for LoRA's adapters;
* the output head (``get_output_embeddings``, tied or not) the same way, but per *target* when the loss counts
  target tokens: the fused loss computes logits only where a target is (:mod:`hf_accum.fused_loss`), and the
  logits anywhere else do not serve training (a logits-path run does that extra work without it counting).
  With another unit (sequences, preference pairs) the head counts per real token;
* attention's two products (scores ``Q K^T`` and ``P V``) per layer and per sequence of length ``L``: ``4 L^2 d``
  forward and ``8 L^2 d`` backward (``d`` = query heads x head dim): the full square, as PaLM's MFU and
  ``torch.utils.flop_counter`` count it (no discount for the causal mask; a sliding window is not applied);
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
:mod:`hf_accum.peak_flops` says where the peak comes from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from hf_accum.peak_flops import PeakFlops, device_peak_flops


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
    layers: int
    """Attention layers (0: no attention term, e.g. a config without ``num_hidden_layers``)."""
    attention_width: int
    """Query heads x head dim."""

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
        layers, width = _attention_shape(getattr(base, "config", None))
        return cls(**sizes, layers=layers, attention_width=width)

    def update_flops(self, tokens: float, head_rows: float, squared_lengths: float) -> float:
        """Model FLOPs of a window of ``tokens`` real tokens, ``head_rows`` positions through the output head and
        ``squared_lengths`` = sum over its sequences of length^2 (see the module docstring)."""
        body = (4 * self.body + 2 * self.body_trainable) * tokens
        head = (4 * self.head + 2 * self.head_trainable) * head_rows
        attention = 12 * self.layers * self.attention_width * squared_lengths
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


def _attention_shape(config: Any) -> tuple[int, int]:
    """(layers, query heads x head dim) of a transformers config (its text part for multimodal ones)."""
    config = getattr(config, "text_config", None) or config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        return 0, 0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(layers), int(heads) * int(head_dim)


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


class UtilizationMeter:
    """Times each update and fills its ``seconds``, ``flops_per_second`` and ``mfu`` (its ``flops`` come from the
    boundary); :meth:`take_interval` gives a logging interval's numbers, :func:`summarize` the run's."""

    def __init__(self, peak: PeakFlops, world_size: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.peak = peak
        self.world_size = world_size
        self.clock = clock
        self._last: float | None = None
        self._interval = [0.0, 0.0]  # flops, seconds since the last take_interval()

    @classmethod
    def for_run(cls, model: torch.nn.Module, device: Any, mixed_precision: str | None, world_size: int,
                configured: float | None, key: str) -> UtilizationMeter:
        """A run on ``world_size`` processes of ``device`` (the peak of one: :mod:`hf_accum.peak_flops`)."""
        return cls(device_peak_flops(device, compute_dtype(model, mixed_precision), configured, key), world_size)

    @property
    def total_peak(self) -> float | None:
        return self.peak.flops * self.world_size if self.peak.flops else None

    @property
    def started(self) -> bool:
        return self._last is not None

    def start(self) -> None:
        """Training starts now (the first update's time runs from here)."""
        self._last = self.clock()

    def observe(self, update: Any) -> None:
        """``update`` (an :class:`~hf_accum.records.UpdateLog`) just closed: its time, FLOP/s and MFU."""
        for name, value in self.lap(update.flops).items():
            setattr(update, name, value)

    def lap(self, flops: float | None) -> dict[str, float | None]:
        """An update of ``flops`` model FLOPs closed now: ``{"seconds", "flops_per_second", "mfu"}`` since the
        last lap (or :meth:`start`; empty before it)."""
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
        flops, seconds = self._interval
        self._interval = [0.0, 0.0]
        if not seconds:
            return {}
        values = {"flops_per_second": flops / seconds}
        mfu = self.mfu(flops / seconds)
        return values | ({"mfu": mfu} if mfu is not None else {})


def summarize(updates: Iterable[Any], peak: PeakFlops, world_size: int) -> dict[str, Any]:
    """The run's utilization for ``metrics.json``: ``flops_per_update`` (the mean over its updates),
    ``flops_per_second`` (all FLOPs over the updates' time), ``mfu``, the peak and its source. ``updates``:
    :class:`~hf_accum.records.UpdateLog` objects or their dicts (a resumed run's earlier ones included)."""
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
    if summary.get("flops_per_update") is None:
        return "model FLOPs not counted"
    achieved = summary.get("flops_per_second")
    rate = f", {achieved / 1e9:,.1f} GFLOP/s" if achieved is not None else ""
    mfu = summary.get("mfu")
    mfu_text = f"MFU {mfu:.1%}" if mfu is not None else "MFU n/a"
    return f"model FLOPs {summary['flops_per_update']:.3g}/update{rate}, {mfu_text} ({summary['peak_flops_source']})"


def meter_run(boundary: Any, model: torch.nn.Module, unit: str, *, device: Any, mixed_precision: str | None,
              world_size: int, configured: float | None, key: str) -> UtilizationMeter:
    """Count every update's model FLOPs at ``boundary`` (an :class:`~hf_accum.boundary.UpdateBoundary`) and
    return the meter that times them. ``unit``: what the loss counts (``"target"``: the head runs per target)."""
    boundary.model_flops = ModelFlops.of(model).window_flops(head_on_targets=unit == "target")
    return UtilizationMeter.for_run(model, device, mixed_precision, world_size, configured, key)
