"""Peak tensor memory of training, measured, and the micro-batch a memory budget allows.

**Measuring** (:func:`measure_memory`): the peak, over a block of code, of the bytes of tensors allocated
in it and still held. On CUDA from the allocator's own counters (``max_memory_allocated``); on CPU from
the allocation and free events the c10 CPU allocator reports to ``torch.profiler`` (``profile_memory``):
exact tensor bytes, replayed in order. Not the process RSS, which the Python heap, libraries and the
allocator's caching blur. Parameters allocated before the block are added by the caller.

**Planning** (:func:`plan_micro_batch`, ``hf-accum plan --auto``): peak memory of a training step is
close to a line in the micro-batch size ``m`` (parameters, gradients and optimizer state are the
intercept; activations and the loss step the slope). So: measure two or three sizes on the real
device, fit the line, predict, take the largest micro-batch that divides the per-process batch and fits
the budget, then *run that size once* to confirm (and step down if the measurement disagrees), and check
the next larger divisor is really over. The accumulation steps follow: ``K = per-process batch / m``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from hf_accum.errors import InputError

if TYPE_CHECKING:  # torch is imported where it is used: hf-accum plan --auto's planner process never loads it
    import torch

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class MemoryBudgetError(InputError):
    """A budget that cannot be parsed, or that no micro-batch fits."""


def parse_bytes(text: str, key: str = "--memory-budget") -> int:
    """``70GiB``, ``512MiB``, ``1.5GB``, ``123456`` -> bytes; refuses anything else, naming the units."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise MemoryBudgetError(f"{key}={text!r}: expected a number with an optional unit "
                                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 70GiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise MemoryBudgetError(f"{key}={text!r}: must be positive")
    return value


def format_bytes(value: float) -> str:
    text = f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"
    return f"> {text} (stopped)" if isinstance(value, OverBudget) else text


class OverBudget(int):
    """A measurement that was stopped before the end, at this many bytes, because it was crossing the budget:
    the true peak is larger, and it does not fit whatever its value (formatted ``> 1.10 GiB (stopped)``)."""


def within(peak: float, budget: int) -> bool:
    """Whether a measured (or predicted) peak fits the budget; a stopped measurement never does."""
    return not isinstance(peak, OverBudget) and peak <= budget


def default_budget(device: torch.device, margin: float = 0.1) -> int:
    """The device's free memory minus a margin: CUDA's free bytes, else the machine's available RAM."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return int(free * (1 - margin))


@dataclass
class MemoryReading:
    peak_bytes: int = 0
    """Peak over the block of bytes allocated in it and still held (the block's start is 0)."""
    largest_allocation: int | None = None
    """Largest single tensor allocation in the block (None: none reported)."""


@contextlib.contextmanager
def measure_memory(device: torch.device) -> Iterator[MemoryReading]:
    """Yield a :class:`MemoryReading`, filled in when the block ends (see the module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    reading = MemoryReading()
    gc.collect()  # frees of earlier garbage must not land inside the window
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # kineto prints "USDT: ... profiler_start/stop" lines straight to fd 2
        prof.__enter__()
    try:
        yield reading
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    reading.peak_bytes, reading.largest_allocation = profiler_peak(prof, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        reading.peak_bytes = torch.cuda.max_memory_allocated(device) - start


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C++ code writes there directly, past ``sys.stderr``)."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profiler_peak(prof: Any, device: torch.device) -> tuple[int, int | None]:
    """(peak of the running allocation total, largest single allocation) for ``device``'s memory events."""
    events = [
        e for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name.lower() == device.type
    ]
    current = peak = 0
    largest: int | None = None
    for event in sorted(events, key=lambda e: e.start_ns()):
        size = event.nbytes()
        current += size
        peak = max(peak, current)
        largest = max(largest or 0, size)
    return peak, largest


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (allocated before any measured block)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------------------------
# Planning the micro-batch from measurements
# ----------------------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    budget_bytes: int
    per_process_batch: int
    measured: dict[int, int] = field(default_factory=dict)
    """Micro-batch -> measured peak bytes of one training step."""
    intercept: float = 0.0
    slope: float = 0.0
    micro_batch: int | None = None

    @property
    def accumulation_steps(self) -> int | None:
        return None if self.micro_batch is None else self.per_process_batch // self.micro_batch

    def predicted(self, micro_batch: int) -> float:
        return self.intercept + self.slope * micro_batch

    def table(self) -> str:
        """Every candidate micro-batch with K, the predicted and (where run) the measured peak."""
        rows = [f"{'micro':>6} {'K':>4} {'predicted':>12} {'measured':>12}  fits {format_bytes(self.budget_bytes)}?"]
        for m in divisors(self.per_process_batch):
            measured = self.measured.get(m)
            peak = measured if measured is not None else self.predicted(m)
            chosen = "  <- chosen" if m == self.micro_batch else ""
            skipped = measured is None and any(k < m and not within(v, self.budget_bytes)
                                               for k, v in self.measured.items())
            verdict = "no (not probed: a smaller one is over)" if skipped else (
                "yes" if within(peak, self.budget_bytes) else "no")
            rows.append(f"{m:>6} {self.per_process_batch // m:>4} {format_bytes(self.predicted(m)):>12} "
                        f"{format_bytes(measured) if measured is not None else '-':>12}  {verdict}{chosen}")
        return "\n".join(rows)


def divisors(n: int) -> list[int]:
    return [m for m in range(1, n + 1) if n % m == 0]


def fit_line(points: dict[int, int]) -> tuple[float, float]:
    """Least-squares ``peak = intercept + slope * m`` through the measured points."""
    xs, ys = list(points), [float(v) for v in points.values()]
    if len(xs) == 1:
        return ys[0], 0.0
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def plan_micro_batch(
    measure: Callable[[int], int], per_process_batch: int, budget_bytes: int, probes: tuple[int, ...] = (1, 2, 4),
) -> MemoryPlan:
    """The largest micro-batch dividing ``per_process_batch`` whose *measured* step peak fits the budget.

    ``measure(m)`` runs one training step at micro-batch ``m`` and returns its peak bytes. Probes larger
    than the per-process batch are skipped. Raises :class:`MemoryBudgetError` when even 1 does not fit.
    """
    plan = MemoryPlan(budget_bytes, per_process_batch)

    def over(m: int) -> bool:
        """Known not to fit: ``m`` or a smaller micro-batch measured over the budget (peaks grow with ``m``)."""
        return any(k <= m and not within(v, budget_bytes) for k, v in plan.measured.items())

    for m in sorted({p for p in probes if p <= per_process_batch} or {1}):
        if over(m):  # a smaller probe is already over: this one is skipped (it would only cost time and memory)
            break
        plan.measured[m] = measure(m)
    plan.intercept, plan.slope = fit_line(plan.measured)
    candidates = divisors(per_process_batch)

    def fits(m: int) -> bool:
        if over(m):
            return False
        if m not in plan.measured:
            plan.measured[m] = measure(m)
        return within(plan.measured[m], budget_bytes)

    predicted_fit = [m for m in candidates if plan.predicted(m) <= budget_bytes] or [1]
    index = candidates.index(predicted_fit[-1])
    while index >= 0 and not fits(candidates[index]):  # the prediction was optimistic: step down
        index -= 1
    if index < 0:
        raise MemoryBudgetError(
            f"no micro-batch fits the budget of {format_bytes(budget_bytes)}: micro-batch 1 needs "
            f"{format_bytes(plan.measured[1])}; larger micro-batches not probed (shorten --max-length, quantize, or "
            "use LoRA)"
        )
    while index + 1 < len(candidates) and fits(candidates[index + 1]):  # pessimistic: step up
        index += 1
    plan.micro_batch = candidates[index]
    return plan


def training_step_peak(model: torch.nn.Module, device: torch.device, micro_batch: int, max_length: int,
                       mixed_precision: str = "no", learning_rate: float = 1e-4, seed: int = 0) -> int:
    """Peak bytes (parameters included) of two updates of ``micro_batch`` rows of ``max_length`` tokens
    through :func:`hf_accum.train`: the real loss path (fused for causal LMs), gradients, and AdamW state
    (it exists from the second update on, as in any real run). Every row is full length: the worst case
    a micro-batch of the planned size meets."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from hf_accum.batching import PaddingCollator
    from hf_accum.loop import LoopConfig, train

    generator = torch.Generator().manual_seed(seed)
    embeddings: Any = model.get_input_embeddings()  # type: ignore[operator]  # a transformers model's method
    vocab = int(embeddings.num_embeddings)
    rows = [{"input_ids": torch.randint(3, vocab, (max_length,), generator=generator).tolist()}
            for _ in range(2 * micro_batch)]
    dataset: Any = rows  # a list is a map-style dataset to DataLoader (typed as Dataset)
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=micro_batch, collate_fn=PaddingCollator(0))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=learning_rate)
    # Its own Accelerator, so that nothing of this step outlives it.
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=mixed_precision)
    prepared_model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(max_steps=2, disable_tqdm=True, stop_on_signals=False)
    library_log = logging.getLogger("hf_accum")
    level = library_log.level
    library_log.setLevel(logging.WARNING)  # the start lines of every measured step are noise here
    try:
        with measure_memory(accelerator.device) as reading:
            train(prepared_model, optimizer, loader, accelerator, config)
    finally:
        library_log.setLevel(level)
    optimizer.zero_grad(set_to_none=True)
    del accelerator, optimizer, loader
    return reading.peak_bytes + resident_bytes(model)
