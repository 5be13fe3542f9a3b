"""``hf-accum bench``: the accumulation trade-off and the DESIGN.md section 5 targets, measured.

This module owns the benchmark logic (the CLI in :mod:`hf_accum.cli` only parses arguments):

* **sweep** -- a fixed global batch split into ``K`` micro-batches of ``global / K`` sequences, for
  each ``K``: real (non-pad) tokens/s of :func:`hf_accum.loop.train` and peak memory. Table, PNG, JSON.
* **overhead** -- our loop vs a bare PyTorch accumulation loop (``loss / K``; backward; clip and
  step every K) on the same model, data and micro-batches, in interleaved pairs; the ratio is
  ours / bare tokens/s (target: >= 0.98).
* **memory** -- peak memory of one update of K micro-batches of size b vs one micro-batch of size b
  (target: ratio <= 1.05).
* **padding** -- variable-length SFT-like rows (random prompt and answer lengths, prompt masked):
  real (non-pad) tokens/s of stock ``transformers.Trainer`` with default batching (right padding,
  random order) vs :class:`hf_accum.AccumTrainer` with padding-free packing
  (:class:`hf_accum.batching.PackingCollator`) and vs AccumTrainer with the same padding; same model,
  data, micro-batch (in sequences) and accumulation, interleaved (targets: packed / stock >= 1.5,
  ours / stock at the same batching >= 0.98).
* **loss** -- the loss step at a large vocabulary: :func:`hf_accum.loss.token_loss_sum` (chunked)
  vs plain ``F.cross_entropy(logits.float())``; the largest single allocation tells whether the
  full fp32 logits were materialized.

What "memory" means here (the same numbers on CPU and CUDA):

* *peak tensor memory* = parameter bytes + the peak, during the measured window, of bytes held by
  tensors allocated in it (gradients, optimizer state, activations, batches, temporaries). On CUDA
  the peak comes from ``torch.cuda.max_memory_allocated``; on CPU from the allocation/free events
  the c10 CPU allocator reports to ``torch.profiler`` (``profile_memory=True``): exact tensor bytes,
  no allocator caching, no Python objects. Process RSS is not used: it never goes down and counts
  the allocator's free lists.
* *peak saved activations* = the peak of distinct storages saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded: the part accumulation shrinks.

Timings are only ever compared side by side: repetitions of the things compared are interleaved in
one process and the reported figure is a median, because other work on the machine shifts absolute
timings by far more than the effects measured.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from hf_accum.batching import PaddingCollator
from hf_accum.loss import IGNORE_INDEX, aligned_targets, rows_per_chunk, token_loss_sum

SECTIONS = ("sweep", "overhead", "memory", "padding", "loss")
OVERHEAD_TARGET = 0.98  # ours / bare tokens/s: "within 2% of a bare PyTorch loop"
PACKING_TARGET = 1.5  # packed AccumTrainer / stock Trainer (default batching) real tokens/s
TRAINER_TARGET = 0.98  # AccumTrainer / stock Trainer real tokens/s at the same batching: "no slower"
MEMORY_TARGET = 1.05  # K micro-batches of b vs one micro-batch of b: "within 5%"
MiB = 2**20

# The built-in model: small enough that the default run takes a couple of minutes on 2 CPU cores,
# with a vocabulary large enough that the LM head and the loss weigh as in a real model.
TINY_BENCH_LLAMA = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    pad_token_id=0,
    tie_word_embeddings=False,
)


class BenchError(ValueError):
    """A benchmark setting that cannot be run; raised before anything is measured or written."""


@dataclass
class BenchConfig:
    model: str = "tiny"
    """'tiny' (a Llama built from :data:`TINY_BENCH_LLAMA`, random init) or a local model directory."""
    device: str = "cpu"
    dtype: str = "float32"
    """Weights dtype: float32 or bfloat16 (bf16 weights use the loop's fp32 gradient accumulation)."""
    global_batch_size: int = 16
    accumulation_steps: tuple[int, ...] = (1, 2, 4, 8, 16)
    updates: int = 2
    """Timed optimizer updates per run (each of global_batch_size sequences)."""
    repeats: int = 3
    """Sweep runs per K (interleaved across K); the median is reported."""
    min_length: int = 16
    max_length: int = 256
    overhead_accumulation: int = 4
    overhead_repeats: int = 7
    """Interleaved (bare, ours) pairs; the median of the per-pair ratios is reported."""
    memory_micro_batch: int = 2
    memory_accumulation: int = 8
    padding_micro_batch: int = 8
    """Sequences per micro-batch in the padding section (padded rows, or one packed row)."""
    padding_accumulation: int = 2
    padding_updates: int = 3
    """Optimizer updates per Trainer run in the padding section."""
    padding_repeats: int = 5
    """Interleaved (stock, packed, ours-padded) triples; medians of the per-triple ratios are reported."""
    loss_vocab: int = 32768
    loss_tokens: int = 8192
    """Positions in the loss step; above loss.DEFAULT_CHUNK_BYTES of fp32 logits it runs in chunks."""
    sections: tuple[str, ...] = SECTIONS
    output_dir: str = "bench_out"
    seed: int = 0
    threads: int | None = None
    """torch intra-op threads (None: torch's default). On a CPU shared with other jobs, 1 thread
    is far steadier: a busy core stalls every multi-threaded op at its barrier."""
    disable_tqdm: bool = False


# ----------------------------------------------------------------------------------------------
# Validation (before anything runs, so a bad command writes nothing)
# ----------------------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def validate(config: BenchConfig) -> None:
    """Raise :class:`BenchError` naming the valid values for anything that cannot run."""
    _require_positive(
        global_batch_size=config.global_batch_size, updates=config.updates, repeats=config.repeats,
        overhead_repeats=config.overhead_repeats, memory_micro_batch=config.memory_micro_batch,
        memory_accumulation=config.memory_accumulation, loss_vocab=config.loss_vocab,
        padding_micro_batch=config.padding_micro_batch, padding_accumulation=config.padding_accumulation,
        padding_updates=config.padding_updates, padding_repeats=config.padding_repeats,
    )
    valid = divisors(config.global_batch_size)
    for name, values in (("accumulation steps", config.accumulation_steps), ("overhead accumulation",
                                                                            (config.overhead_accumulation,))):
        bad = [k for k in values if k not in valid]
        if bad or not values:
            raise BenchError(
                f"{name} {', '.join(map(str, bad)) or '(none)'} must divide the global batch of "
                f"{config.global_batch_size} sequences (micro-batch = global / K); valid values: "
                f"{', '.join(map(str, valid))}"
            )
    if not 2 <= config.min_length <= config.max_length:
        raise BenchError(f"need 2 <= min_length <= max_length, got {config.min_length} and {config.max_length}")
    if config.threads is not None and config.threads < 1:
        raise BenchError(f"threads={config.threads} must be at least 1")
    if config.loss_tokens < 2:
        raise BenchError(f"loss_tokens={config.loss_tokens} must be at least 2")
    unknown = [s for s in config.sections if s not in SECTIONS]
    if unknown or not config.sections:
        raise BenchError(f"unknown section(s) {unknown or '(none)'}; choose from {', '.join(SECTIONS)}")
    if config.dtype not in ("float32", "bfloat16"):
        raise BenchError(f"dtype={config.dtype!r}; choose float32 or bfloat16")
    if config.device not in ("cpu", "cuda"):
        raise BenchError(f"device={config.device!r}; choose cpu or cuda")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("device='cuda' but torch.cuda.is_available() is False; use --device cpu")
    if config.model != "tiny" and not Path(config.model).is_dir():
        raise BenchError(f"model={config.model!r} is neither 'tiny' nor a local model directory")
    if Path(config.output_dir).exists() and not Path(config.output_dir).is_dir():
        raise BenchError(f"output_dir={config.output_dir!r} exists and is not a directory")


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise BenchError(f"{name}={value} must be at least 1")


# ----------------------------------------------------------------------------------------------
# Model, data, accelerator
# ----------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One model (reset to the same weights before every run) and the data every run sees."""

    model: torch.nn.Module
    initial_state: dict
    vocab_size: int
    pad_token_id: int
    device: torch.device
    description: str

    def reset(self) -> torch.nn.Module:
        # Reusing one model (instead of a copy per run) keeps one set of weights on the device,
        # which matters for real models; every run starts from identical weights.
        self.model.load_state_dict(self.initial_state)
        for p in self.model.parameters():
            p.grad = None
        return self.model

    @property
    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def load_workload(config: BenchConfig) -> Workload:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, config.dtype)
    torch.manual_seed(config.seed)
    if config.model == "tiny":
        model = LlamaForCausalLM(LlamaConfig(**TINY_BENCH_LLAMA)).to(dtype)
        shape = TINY_BENCH_LLAMA
        description = (
            f"tiny Llama (random init: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"vocab {shape['vocab_size']})"
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, local_files_only=True)
        description = f"{config.model} ({type(model).__name__})"
    device = torch.device(config.device)
    model.to(device)
    pad = model.config.pad_token_id
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    return Workload(
        model, state, model.config.vocab_size, int(pad if pad is not None else 0), device,
        f"{description}, {n_params / 1e6:.2f}M parameters, {config.dtype}",
    )


def random_examples(n: int, vocab_size: int, pad_id: int, min_length: int, max_length: int, seed: int) -> list[dict]:
    """Rows of uniformly random length and random tokens (never the pad id); every token is a target."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        length = int(torch.randint(min_length, max_length + 1, (1,), generator=generator))
        ids = torch.randint(0, vocab_size - 1, (length,), generator=generator)
        examples.append({"input_ids": torch.where(ids >= pad_id, ids + 1, ids).tolist()})
    return examples


def real_tokens(examples: Sequence[dict]) -> int:
    return sum(len(e["input_ids"]) for e in examples)


def fresh_accelerator(accumulation: int, device: torch.device):
    """Accelerate keeps its state in per-process singletons: reset them so each run gets its own K
    (as :func:`hf_accum.checking.fresh_accelerator`, but with the device chosen by the caller)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=device.type == "cpu", gradient_accumulation_steps=accumulation)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Wall-clock seconds and this process's CPU seconds (all threads) of one run."""

    wall: float
    cpu: float


@contextlib.contextmanager
def _timed(device: torch.device):
    """Yield a :class:`Timing` filled in when the block ends (device work waited for)."""
    timing = Timing(0.0, 0.0)
    _synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    yield timing
    _synchronize(device)
    timing.wall, timing.cpu = time.perf_counter() - wall, time.process_time() - cpu


# ----------------------------------------------------------------------------------------------
# The two loops being compared
# ----------------------------------------------------------------------------------------------


def run_ours(work: Workload, examples: list, micro_batch: int, accumulation: int) -> Timing:
    """Time of :func:`hf_accum.loop.train` over ``examples`` (model setup excluded)."""
    from hf_accum.loop import LoopConfig, train

    accelerator = fresh_accelerator(accumulation, work.device)
    model = work.reset()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = _loader(examples, micro_batch, work.pad_token_id)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with _timed(work.device) as timing:
        train(model, optimizer, loader, accelerator, LoopConfig(disable_tqdm=True))
    return timing


def run_bare(work: Workload, examples: list, micro_batch: int, accumulation: int) -> Timing:
    """Time of the classic bare PyTorch loop: ``loss / K``, backward, clip + step every K.

    It does what ours does per update (clip at 1.0, AdamW, linear LR schedule, grads set to None)
    so that the ratio isolates the cost of exact accumulation, not of features.
    """
    from transformers import get_scheduler

    model = work.reset()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = _loader(examples, micro_batch, work.pad_token_id)
    scheduler = get_scheduler("linear", optimizer, 0, math.ceil(len(loader) / accumulation))
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    with _timed(work.device) as timing:
        for step, batch in enumerate(loader, start=1):
            batch = {k: v.to(work.device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch, use_cache=False).loss / accumulation
            loss.backward()
            if step % accumulation == 0 or step == len(loader):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
    return timing


def _loader(examples: list, micro_batch: int, pad_id: int) -> DataLoader:
    return DataLoader(examples, batch_size=micro_batch, shuffle=False, collate_fn=PaddingCollator(pad_id))


# ----------------------------------------------------------------------------------------------
# Memory measurement
# ----------------------------------------------------------------------------------------------


@dataclass
class MemoryReading:
    peak_bytes: int = 0
    """Peak over the window of bytes allocated in it and still held (the window's start is 0)."""
    largest_allocation: int | None = None
    """Largest single tensor allocation in the window (None: the profiler reported none)."""
    peak_saved_bytes: int = 0
    """Peak of distinct non-parameter storages saved for backward."""


class SavedActivations:
    """Track the bytes of distinct storages autograd holds for backward (parameters excluded)."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self._live: dict[tuple, list[int]] = {}  # storage key -> [references, bytes]
        self.current = 0
        self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._excluded or storage.data_ptr() == 0:
            return tensor
        key = (str(tensor.device), storage.data_ptr())
        entry = self._live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _SavedRef(tensor, key, self)

    def _release(self, key: tuple) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _SavedRef) else packed

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class _SavedRef:
    """What autograd keeps instead of the tensor; freeing it (graph released) releases the bytes."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor, key, tracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker._release(self.key)


@contextlib.contextmanager
def measure_memory(device: torch.device, parameters: Iterable[torch.Tensor] = ()):
    """Yield a :class:`MemoryReading`, filled in when the block ends (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    reading = MemoryReading()
    saved = SavedActivations(parameters)
    gc.collect()  # frees of earlier runs' garbage must not land inside the window
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, saved.hooks():
        yield reading
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak, largest = _profiler_memory(prof, device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - start
    reading.peak_bytes, reading.largest_allocation, reading.peak_saved_bytes = peak, largest, saved.peak


def _profiler_memory(prof, device: torch.device) -> tuple[int, int | None]:
    """(peak of the running allocation total, largest single allocation) for ``device``'s events."""
    events = [
        e for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name.lower() == device.type
    ]
    current = peak = 0
    largest = None
    for event in sorted(events, key=lambda e: e.start_ns()):
        size = event.nbytes()
        current += size
        peak = max(peak, current)
        largest = max(largest or 0, size)
    return peak, largest


MEMORY_UPDATES = 2
"""Updates inside a memory window: from the 2nd on, optimizer state exists, as in any real run."""


def training_memory(work: Workload, examples: list, micro_batch: int, accumulation: int) -> MemoryReading:
    """Memory of :data:`MEMORY_UPDATES` updates of our loop (``examples`` must hold exactly that many)."""
    from hf_accum.loop import LoopConfig, train

    if len(examples) != MEMORY_UPDATES * micro_batch * accumulation:
        raise ValueError(f"need {MEMORY_UPDATES} x {micro_batch} x {accumulation} examples, got {len(examples)}")
    accelerator = fresh_accelerator(accumulation, work.device)
    model = work.reset()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = _loader(examples, micro_batch, work.pad_token_id)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with measure_memory(work.device, model.parameters()) as reading:
        train(model, optimizer, loader, accelerator, LoopConfig(disable_tqdm=True))
    reading.peak_bytes += work.parameter_bytes  # parameters were allocated before the window
    del optimizer, loader, accelerator
    return reading


# ----------------------------------------------------------------------------------------------
# The sections
# ----------------------------------------------------------------------------------------------


@dataclass
class SweepRow:
    accumulation_steps: int
    micro_batch: int
    tokens_per_s: float
    tokens_per_s_min: float
    tokens_per_s_max: float
    peak_memory_bytes: int
    peak_saved_activation_bytes: int
    padding_fraction: float


def sweep(config: BenchConfig, work: Workload) -> list[SweepRow]:
    """Tokens/s and memory per K at a fixed global batch; runs of different K are interleaved."""
    examples = random_examples(
        config.global_batch_size * config.updates, work.vocab_size, work.pad_token_id,
        config.min_length, config.max_length, config.seed,
    )
    tokens = real_tokens(examples)
    ks = list(config.accumulation_steps)
    micro = {k: config.global_batch_size // k for k in ks}
    for k in ks:  # warm-up (allocator, thread pools, lazy inits); not timed
        run_ours(work, examples[: config.global_batch_size], micro[k], k)
    seconds: dict[int, list[Timing]] = {k: [] for k in ks}
    with _progress(config.repeats * len(ks), "sweep runs", config) as bar:
        for rep in range(config.repeats):
            for k in ks[rep % len(ks):] + ks[: rep % len(ks)]:  # rotate the order: no fixed position per K
                seconds[k].append(run_ours(work, examples, micro[k], k))
                bar.update(1)
    # The same rows as the timed runs (random_examples is prefix-stable), but always MEMORY_UPDATES updates.
    memory_rows = random_examples(
        config.global_batch_size * MEMORY_UPDATES, work.vocab_size, work.pad_token_id,
        config.min_length, config.max_length, config.seed,
    )
    rows = []
    for k in tqdm(ks, desc="sweep memory", disable=config.disable_tqdm):
        memory = training_memory(work, memory_rows, micro[k], k)
        rates = [tokens / t.wall for t in seconds[k]]
        rows.append(SweepRow(
            k, micro[k], statistics.median(rates), min(rates), max(rates), memory.peak_bytes,
            memory.peak_saved_bytes, padding_fraction(examples, micro[k]),
        ))
    return rows


def padding_fraction(examples: Sequence[dict], micro_batch: int) -> float:
    """Share of pad positions when rows are padded to the longest of their micro-batch."""
    total = 0
    for start in range(0, len(examples), micro_batch):
        chunk = examples[start:start + micro_batch]
        total += len(chunk) * max(len(e["input_ids"]) for e in chunk)
    return 1.0 - real_tokens(examples) / total


@dataclass
class OverheadResult:
    accumulation_steps: int
    micro_batch: int
    clock: str
    """Which time the verdict uses: 'cpu' (process CPU seconds; CPU device) or 'wall' (CUDA)."""
    ratio: float
    """Median over pairs of (ours tokens/s) / (bare tokens/s), by ``clock``."""
    ratios: list[float]
    wall_ratio: float
    """The same median by wall-clock time (noisy on a shared CPU: descheduling lands on either side)."""
    ours_tokens_per_s: float
    bare_tokens_per_s: float
    """Median wall-clock real tokens/s of each loop."""

    @property
    def interval(self) -> tuple[float, float]:
        return median_interval(self.ratios)

    @property
    def passed(self) -> bool | None:
        """True/False when the whole ~95% interval of the median is on one side of the target;
        None (inconclusive) when the machine's noise is larger than the margin."""
        low, high = self.interval
        if low >= OVERHEAD_TARGET:
            return True
        if high < OVERHEAD_TARGET:
            return False
        return None


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """Distribution-free ~95% confidence interval of the median (order statistics, normal
    approximation of the binomial): no assumption about how other jobs disturb the timings."""
    ordered = sorted(values)
    n = len(ordered)
    half = 0.98 * math.sqrt(n)  # 1.96 * sqrt(n) / 2
    low = max(0, math.floor(n / 2 - half) - 1)
    high = min(n - 1, math.ceil(n / 2 + 1 + half) - 1)
    return ordered[low], ordered[high]


def overhead(config: BenchConfig, work: Workload) -> OverheadResult:
    k = config.overhead_accumulation
    micro = config.global_batch_size // k
    examples = random_examples(
        config.global_batch_size * config.updates, work.vocab_size, work.pad_token_id,
        config.min_length, config.max_length, config.seed + 1,
    )
    tokens = real_tokens(examples)
    run_bare(work, examples, micro, k), run_ours(work, examples, micro, k)  # warm-up, not timed
    ours, bare = [], []
    with _progress(config.overhead_repeats, "overhead pairs", config) as bar:
        for rep in range(config.overhead_repeats):
            # Alternate which loop goes first, so a drift in machine load does not favour one side.
            if rep % 2 == 0:
                bare.append(run_bare(work, examples, micro, k))
                ours.append(run_ours(work, examples, micro, k))
            else:
                ours.append(run_ours(work, examples, micro, k))
                bare.append(run_bare(work, examples, micro, k))
            bar.update(1)
    # Equal tokens on both sides: the tokens/s ratio is the inverse ratio of times.
    cpu_ratios = [b.cpu / o.cpu for o, b in zip(ours, bare)]
    wall_ratios = [b.wall / o.wall for o, b in zip(ours, bare)]
    # On a CPU device the process's CPU time counts the work done, not the time other jobs held the
    # cores; on CUDA the host mostly waits, so wall time (after synchronize) is the measure.
    clock = "cpu" if work.device.type == "cpu" else "wall"
    ratios = cpu_ratios if clock == "cpu" else wall_ratios
    return OverheadResult(
        k, micro, clock, statistics.median(ratios), ratios, statistics.median(wall_ratios),
        tokens / statistics.median(o.wall for o in ours), tokens / statistics.median(b.wall for b in bare),
    )


@dataclass
class MemoryResult:
    micro_batch: int
    accumulation_steps: int
    sequence_length: int
    single_bytes: int
    accumulated_bytes: int
    gradient_bytes: int
    """Bytes of one full set of gradients in the weights' dtype (what accumulation must keep)."""

    @property
    def ratio(self) -> float:
        return self.accumulated_bytes / self.single_bytes

    @property
    def excess_in_gradients(self) -> float:
        """(accumulated - single) in units of ``gradient_bytes``."""
        return (self.accumulated_bytes - self.single_bytes) / self.gradient_bytes

    @property
    def passed(self) -> bool:
        return self.ratio <= MEMORY_TARGET


def accumulation_memory(config: BenchConfig, work: Workload) -> MemoryResult:
    """One update of K micro-batches of b rows vs one update of one micro-batch of b rows.

    Every row has ``max_length`` tokens so that all micro-batches have the same shape: the
    comparison then isolates what accumulating costs, not what a longer row costs.
    """
    b, k = config.memory_micro_batch, config.memory_accumulation
    rows = random_examples(MEMORY_UPDATES * b * k, work.vocab_size, work.pad_token_id, config.max_length,
                           config.max_length, config.seed + 2)
    single = training_memory(work, rows[: MEMORY_UPDATES * b], b, 1)
    accumulated = training_memory(work, rows, b, k)
    gradient_bytes = sum(p.numel() * p.element_size() for p in work.model.parameters() if p.requires_grad)
    return MemoryResult(b, k, config.max_length, single.peak_bytes, accumulated.peak_bytes, gradient_bytes)


def sft_examples(n: int, vocab_size: int, pad_id: int, min_length: int, max_length: int, seed: int) -> list[dict]:
    """SFT-like rows: random total length in ``[min_length, max_length]``, split at a random point
    into a prompt (``prompt_length``: masked, no target) and an answer (the targets)."""
    rows = random_examples(n, vocab_size, pad_id, min_length, max_length, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for row in rows:
        length = len(row["input_ids"])
        row["prompt_length"] = int(torch.randint(1, length, (1,), generator=generator))
    return rows


class _CountingCollator:
    """Wrap a collator; count the real (non-pad) tokens and the positions it hands to the model."""

    def __init__(self, collate: Callable):
        self.collate = collate
        self.real = self.total = 0

    def __call__(self, examples):
        batch = self.collate(examples)
        mask = batch.get("attention_mask")
        self.total += batch["input_ids"].numel()
        self.real += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        return batch


@dataclass
class TrainerRun:
    timing: Timing
    real_tokens: int
    positions: int


def run_trainer(work: Workload, examples: list, micro_batch: int, accumulation: int, *, accum: bool,
                packing: bool, output_dir: str, seed: int) -> TrainerRun:
    """One epoch over ``examples`` with stock ``Trainer`` (``accum=False``) or ``AccumTrainer``,
    padded or packed; times ``train()`` from ``on_train_begin`` to ``on_train_end`` (the optimizer,
    scheduler and dataloader are built before; construction of the Trainer is not timed)."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from hf_accum.batching import PackingCollator
    from hf_accum.trainer import AccumTrainer

    device = work.device

    class Clock(TrainerCallback):
        def on_train_begin(self, *_args, **_kwargs):
            _synchronize(device)
            self.wall, self.cpu = time.perf_counter(), time.process_time()

        def on_train_end(self, *_args, **_kwargs):
            _synchronize(device)
            self.timing = Timing(time.perf_counter() - self.wall, time.process_time() - self.cpu)

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model = work.reset()
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
        num_train_epochs=1, learning_rate=1e-4, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, remove_unused_columns=False, use_cpu=device.type == "cpu", seed=seed,
        dataloader_num_workers=0,
    )
    collator = _CountingCollator(PackingCollator() if packing else PaddingCollator(work.pad_token_id))
    clock = Clock()
    cls = AccumTrainer if accum else Trainer
    trainer = cls(model=model, args=args, train_dataset=examples, data_collator=collator, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # no log dicts on stdout
    trainer.train()
    return TrainerRun(clock.timing, collator.real, collator.total)


PADDING_VARIANTS = {
    # name: (AccumTrainer?, packing?)
    "stock": (False, False),
    "packed": (True, True),
    "ours_padded": (True, False),
}


@dataclass
class PaddingResult:
    micro_batch: int
    accumulation_steps: int
    updates: int
    clock: str
    """Which time the verdicts use: 'cpu' (process CPU seconds; CPU device) or 'wall' (CUDA)."""
    real_tokens: int
    """Real (non-pad) tokens per run (the same in every variant)."""
    stock_padding_fraction: float
    """Share of pad positions stock Trainer computed (random order, right padding)."""
    packed_ratios: list[float]
    """Per triple: packed AccumTrainer / stock Trainer real tokens/s, by ``clock``."""
    trainer_ratios: list[float]
    """Per triple: AccumTrainer / stock Trainer real tokens/s at the same (padded) batching."""
    packed_wall_ratio: float
    trainer_wall_ratio: float
    tokens_per_s: dict[str, float]
    """Median wall-clock real tokens/s of each variant."""

    @property
    def packed_ratio(self) -> float:
        return statistics.median(self.packed_ratios)

    @property
    def trainer_ratio(self) -> float:
        return statistics.median(self.trainer_ratios)

    @property
    def packed_interval(self) -> tuple[float, float]:
        return median_interval(self.packed_ratios)

    @property
    def trainer_interval(self) -> tuple[float, float]:
        return median_interval(self.trainer_ratios)

    @property
    def packed_passed(self) -> bool | None:
        return _interval_verdict(self.packed_interval, PACKING_TARGET)

    @property
    def trainer_passed(self) -> bool | None:
        return _interval_verdict(self.trainer_interval, TRAINER_TARGET)


def _interval_verdict(interval: tuple[float, float], target: float) -> bool | None:
    """As :attr:`OverheadResult.passed`: decided only when the whole ~95% interval is on one side."""
    low, high = interval
    if low >= target:
        return True
    if high < target:
        return False
    return None


def padding(config: BenchConfig, work: Workload) -> PaddingResult:
    """Stock Trainer (default batching) vs packed AccumTrainer vs padded AccumTrainer, interleaved."""
    import tempfile

    b, k, updates = config.padding_micro_batch, config.padding_accumulation, config.padding_updates
    examples = sft_examples(b * k * updates, work.vocab_size, work.pad_token_id, config.min_length,
                            config.max_length, config.seed + 3)
    names = list(PADDING_VARIANTS)
    runs: dict[str, list[TrainerRun]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="hf_accum_bench_") as tmp:
        def run(name: str, rows: list) -> TrainerRun:
            accum, packing = PADDING_VARIANTS[name]
            return run_trainer(work, rows, b, k, accum=accum, packing=packing, output_dir=tmp, seed=config.seed)

        for name in names:  # warm-up (one update each), not timed
            run(name, examples[: b * k])
        with _progress(config.padding_repeats, "padding triples", config) as bar:
            for rep in range(config.padding_repeats):
                for name in names[rep % 3:] + names[: rep % 3]:  # rotate: no fixed position per variant
                    runs[name].append(run(name, examples))
                bar.update(1)
    real = {runs[name][0].real_tokens for name in names}
    if len(real) != 1:
        raise RuntimeError(f"the variants saw different real token counts: {real}")
    tokens = real.pop()
    clock = "cpu" if work.device.type == "cpu" else "wall"

    def ratios(name: str, by: str) -> list[float]:
        return [getattr(s.timing, by) / getattr(o.timing, by) for s, o in zip(runs["stock"], runs[name])]

    stock = runs["stock"][0]
    return PaddingResult(
        b, k, updates, clock, tokens, 1.0 - stock.real_tokens / stock.positions,
        ratios("packed", clock), ratios("ours_padded", clock),
        statistics.median(ratios("packed", "wall")), statistics.median(ratios("ours_padded", "wall")),
        {name: tokens / statistics.median(r.timing.wall for r in runs[name]) for name in names},
    )


@dataclass
class LossResult:
    vocab_size: int
    targets: int
    chunk_targets: int
    logits_dtype: str
    fp32_logits_bytes: int
    chunked_peak_bytes: int
    plain_peak_bytes: int
    chunked_largest_allocation: int | None
    plain_largest_allocation: int | None

    @property
    def ratio(self) -> float:
        return self.chunked_peak_bytes / self.plain_peak_bytes

    @property
    def passed(self) -> bool | None:
        """True when no single allocation of the chunked step is as large as the full fp32 logits."""
        if self.chunked_largest_allocation is None:
            return None
        return self.chunked_largest_allocation < self.fp32_logits_bytes


def loss_memory(config: BenchConfig, device: torch.device) -> LossResult:
    """Peak extra memory of the loss step (forward + backward) on one row of bf16 logits."""
    vocab, n = config.loss_vocab, config.loss_tokens
    generator = torch.Generator().manual_seed(config.seed)
    labels = torch.randint(0, vocab, (1, n), generator=generator).to(device)
    logits = torch.randn(1, n, vocab, generator=generator, dtype=torch.bfloat16).to(device).requires_grad_()

    def chunked():
        return token_loss_sum(logits, labels)[0]

    def plain():
        # What a stock causal-LM loss does: upcast the whole logits tensor, then cross-entropy.
        targets = aligned_targets(labels).reshape(-1)
        return F.cross_entropy(logits.float().reshape(-1, vocab), targets, ignore_index=IGNORE_INDEX, reduction="sum")

    readings = {}
    for name, fn in tqdm((("chunked", chunked), ("plain", plain)), desc="loss memory", disable=config.disable_tqdm):
        with measure_memory(device) as reading:
            fn().backward()
            logits.grad = None  # freed inside the window: both variants allocate and free it alike
        readings[name] = reading
    return LossResult(
        vocab, n - 1, rows_per_chunk(vocab, torch.bfloat16), "bfloat16", (n - 1) * vocab * 4,
        readings["chunked"].peak_bytes, readings["plain"].peak_bytes,
        readings["chunked"].largest_allocation, readings["plain"].largest_allocation,
    )


@contextlib.contextmanager
def _progress(total: int, desc: str, config: BenchConfig):
    bar = tqdm(total=total, desc=desc, disable=config.disable_tqdm)
    try:
        yield bar
    finally:
        bar.close()


# ----------------------------------------------------------------------------------------------
# Running, reporting, writing
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchReport:
    config: BenchConfig
    environment: dict
    model: str = ""
    sweep: list[SweepRow] = field(default_factory=list)
    overhead: OverheadResult | None = None
    memory: MemoryResult | None = None
    padding: PaddingResult | None = None
    loss: LossResult | None = None

    def summary(self) -> list[dict]:
        """One row per DESIGN.md target that was measured: target, measured value, verdict."""
        rows = []
        if self.overhead is not None:
            o = self.overhead
            rows.append(dict(
                target=f"loop overhead: ours / bare tokens/s (K={o.accumulation_steps}, micro-batch {o.micro_batch})",
                measured=(f"{o.ratio:.3f} by {o.clock} time (median of {len(o.ratios)} pairs, ~95% interval "
                          f"{o.interval[0]:.3f}-{o.interval[1]:.3f}; wall {o.wall_ratio:.3f})"),
                threshold=f">= {OVERHEAD_TARGET:.2f}", verdict=_verdict(o.passed, "INCONCLUSIVE"),
            ))
        if self.memory is not None:
            m = self.memory
            rows.append(dict(
                target=f"memory: {m.accumulation_steps} micro-batches of {m.micro_batch} vs 1 of {m.micro_batch}",
                measured=(f"{m.ratio:.3f} ({_mib(m.accumulated_bytes)} vs {_mib(m.single_bytes)}; excess = "
                          f"{m.excess_in_gradients:.2f} x gradient bytes)"),
                threshold=f"<= {MEMORY_TARGET:.2f}", verdict=_verdict(m.passed),
            ))
        if self.padding is not None:
            p = self.padding
            where = f"micro-batch {p.micro_batch} sequences, K={p.accumulation_steps}"
            rows.append(dict(
                target=f"padding: real tokens/s packed AccumTrainer / stock Trainer default batching ({where})",
                measured=(f"{p.packed_ratio:.3f} by {p.clock} time (median of {len(p.packed_ratios)} triples, ~95% "
                          f"interval {p.packed_interval[0]:.3f}-{p.packed_interval[1]:.3f}; wall "
                          f"{p.packed_wall_ratio:.3f}; stock padding {p.stock_padding_fraction:.1%})"),
                threshold=f">= {PACKING_TARGET:.2f}", verdict=_verdict(p.packed_passed, "INCONCLUSIVE"),
            ))
            rows.append(dict(
                target=f"trainer overhead: AccumTrainer / stock Trainer, same batching ({where}, padded)",
                measured=(f"{p.trainer_ratio:.3f} by {p.clock} time (median of {len(p.trainer_ratios)} triples, ~95% "
                          f"interval {p.trainer_interval[0]:.3f}-{p.trainer_interval[1]:.3f}; wall "
                          f"{p.trainer_wall_ratio:.3f})"),
                threshold=f">= {TRAINER_TARGET:.2f}", verdict=_verdict(p.trainer_passed, "INCONCLUSIVE"),
            ))
        if self.loss is not None:
            s = self.loss
            largest = "n/a" if s.chunked_largest_allocation is None else _mib(s.chunked_largest_allocation)
            rows.append(dict(
                target=f"loss step, vocab {s.vocab_size} x {s.targets} targets: no full fp32 logits",
                measured=(f"largest allocation {largest} vs fp32 logits {_mib(s.fp32_logits_bytes)}; "
                          f"peak extra chunked/plain {s.ratio:.3f}"),
                threshold="largest < fp32 logits", verdict=_verdict(s.passed),
            ))
        return rows

    def as_dict(self) -> dict:
        return dict(
            config=asdict(self.config), environment=self.environment, model=self.model,
            memory_measured=MEMORY_MEANING[self.environment["device"]],
            sweep=[asdict(r) for r in self.sweep],
            overhead=None if self.overhead is None else {
                **asdict(self.overhead), "interval": self.overhead.interval, "passed": self.overhead.passed},
            memory=None if self.memory is None else {
                **asdict(self.memory), "ratio": self.memory.ratio, "passed": self.memory.passed,
                "excess_in_gradients": self.memory.excess_in_gradients},
            padding=None if self.padding is None else {
                **asdict(self.padding), "packed_ratio": self.padding.packed_ratio,
                "packed_interval": self.padding.packed_interval, "packed_passed": self.padding.packed_passed,
                "trainer_ratio": self.padding.trainer_ratio, "trainer_interval": self.padding.trainer_interval,
                "trainer_passed": self.padding.trainer_passed},
            loss=None if self.loss is None else {**asdict(self.loss), "ratio": self.loss.ratio, "passed": self.loss.passed},
            summary=self.summary(),
        )

    @property
    def failed(self) -> bool:
        return any(row["verdict"] == "FAIL" for row in self.summary())


MEMORY_MEANING = {
    "cpu": "parameter bytes + peak bytes held by tensors allocated during 2 updates "
           "(torch.profiler memory events of the c10 CPU allocator; no caching, no Python objects)",
    "cuda": "parameter bytes + (torch.cuda.max_memory_allocated - memory_allocated when 2 updates start)",
}


def _verdict(passed: bool | None, unknown: str = "UNMEASURED") -> str:
    return unknown if passed is None else ("PASS" if passed else "FAIL")


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def environment(config: BenchConfig) -> dict:
    device = config.device
    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    return dict(
        device=device, device_name=name, torch=torch.__version__, threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(), python=platform.python_version(),
        load_average_1min=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    )


def run_bench(config: BenchConfig, echo: Callable[[str], None] = print) -> BenchReport:
    """Validate, run the selected sections, print tables and the summary, write JSON + PNG."""
    validate(config)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    work = load_workload(config)
    report = BenchReport(config, environment(config), work.description)
    env = report.environment
    echo(f"hf-accum bench: {work.description} on {env['device']} ({env['device_name']}, "
         f"{env['threads']} torch threads, torch {env['torch']}, load average {env['load_average_1min']:.2f})")
    if "sweep" in config.sections:
        report.sweep = sweep(config, work)
        echo(sweep_table(report))
    if "overhead" in config.sections:
        report.overhead = overhead(config, work)
        echo(overhead_text(report.overhead))
    if "memory" in config.sections:
        report.memory = accumulation_memory(config, work)
        echo(memory_text(report.memory))
    if "padding" in config.sections:
        report.padding = padding(config, work)
        echo(padding_text(report.padding))
    if "loss" in config.sections:
        report.loss = loss_memory(config, work.device)
        echo(loss_text(report.loss))
    echo(summary_table(report))
    for path in write_outputs(report, Path(config.output_dir)):
        echo(f"wrote {path}")
    return report


def sweep_table(report: BenchReport) -> str:
    c = report.config
    lines = [
        f"\nAccumulation trade-off: global batch {c.global_batch_size} sequences ({c.min_length}-{c.max_length} "
        f"tokens, random), {c.updates} updates per run, median of {c.repeats} interleaved runs",
        f"tokens/s counts real (non-pad) tokens; memory: {MEMORY_MEANING[c.device]}",
        f"{'K':>3} {'micro':>5} {'tokens/s':>10} {'(min-max)':>17} {'peak memory':>13} {'saved activ.':>13} {'pad':>6}",
    ]
    for r in report.sweep:
        lines.append(
            f"{r.accumulation_steps:>3} {r.micro_batch:>5} {r.tokens_per_s:>10.0f} "
            f"{f'({r.tokens_per_s_min:.0f}-{r.tokens_per_s_max:.0f})':>17} {_mib(r.peak_memory_bytes):>13} "
            f"{_mib(r.peak_saved_activation_bytes):>13} {r.padding_fraction:>6.1%}"
        )
    return "\n".join(lines)


def overhead_text(o: OverheadResult) -> str:
    return (
        f"\nOverhead vs bare PyTorch (K={o.accumulation_steps}, micro-batch {o.micro_batch}): median wall-clock "
        f"ours {o.ours_tokens_per_s:.0f} tokens/s, bare {o.bare_tokens_per_s:.0f} tokens/s\n"
        f"  ours/bare by {o.clock} time: median {o.ratio:.3f} (~95% interval {o.interval[0]:.3f}-"
        f"{o.interval[1]:.3f}); per pair {', '.join(f'{r:.3f}' for r in o.ratios)}\n"
        f"  ours/bare by wall time: median {o.wall_ratio:.3f}"
    )


def memory_text(m: MemoryResult) -> str:
    return (
        f"\nMemory of accumulation ({m.sequence_length}-token rows, peak over {MEMORY_UPDATES} updates): "
        f"{m.accumulation_steps} micro-batches of {m.micro_batch} per update: {_mib(m.accumulated_bytes)}; "
        f"one micro-batch of {m.micro_batch} per update: "
        f"{_mib(m.single_bytes)}; ratio {m.ratio:.3f}\n  excess {_mib(m.accumulated_bytes - m.single_bytes)} = "
        f"{m.excess_in_gradients:.2f} x the gradient bytes ({_mib(m.gradient_bytes)}): the window's gradients stay "
        f"allocated through every later forward, while a lone micro-batch (zero_grad(set_to_none=True)) has none "
        f"during its forward"
    )


def padding_text(p: PaddingResult) -> str:
    t = p.tokens_per_s
    names = {"stock": "stock Trainer, padded (default batching)", "packed": "AccumTrainer, packed (padding-free)",
             "ours_padded": "AccumTrainer, padded (same batching as stock)"}
    lines = [
        f"\nPadding: SFT-like rows (random prompt/answer split, prompt masked), micro-batch {p.micro_batch} "
        f"sequences, K={p.accumulation_steps}, {p.updates} updates per run, {p.real_tokens} real tokens per run; "
        f"stock pads {p.stock_padding_fraction:.1%} of positions",
        f"  {'variant':<48} {'real tokens/s':>14} {'/ stock (' + p.clock + ')':>14} {'/ stock (wall)':>15}",
        f"  {names['stock']:<48} {t['stock']:>14.0f} {1.0:>14.3f} {1.0:>15.3f}",
        f"  {names['packed']:<48} {t['packed']:>14.0f} {p.packed_ratio:>14.3f} {p.packed_wall_ratio:>15.3f}",
        f"  {names['ours_padded']:<48} {t['ours_padded']:>14.0f} {p.trainer_ratio:>14.3f} {p.trainer_wall_ratio:>15.3f}",
        f"  packed/stock per triple ({p.clock}): {', '.join(f'{r:.3f}' for r in p.packed_ratios)}",
        f"  ours/stock per triple ({p.clock}):   {', '.join(f'{r:.3f}' for r in p.trainer_ratios)}",
    ]
    return "\n".join(lines)


def loss_text(s: LossResult) -> str:
    def largest(v):
        return "n/a" if v is None else _mib(v)

    return (
        f"\nLoss step, {s.logits_dtype} logits, vocab {s.vocab_size}, {s.targets} targets (chunks of "
        f"{s.chunk_targets}); full fp32 logits would be {_mib(s.fp32_logits_bytes)}\n"
        f"  token_loss_sum (chunked): peak extra {_mib(s.chunked_peak_bytes)}, largest allocation "
        f"{largest(s.chunked_largest_allocation)}\n"
        f"  F.cross_entropy(logits.float()): peak extra {_mib(s.plain_peak_bytes)}, largest allocation "
        f"{largest(s.plain_largest_allocation)}"
    )


def summary_table(report: BenchReport) -> str:
    rows = report.summary()
    if not rows:
        return "\nSummary: no target measured (only the sweep ran)"
    width = max(len(r["target"]) for r in rows)
    lines = ["\nSummary (DESIGN.md section 5)"]
    for r in rows:
        lines.append(f"  {r['target']:<{width}}  {r['verdict']:<10} {r['measured']}  [target {r['threshold']}]")
    return "\n".join(lines)


def write_outputs(report: BenchReport, output_dir: Path) -> list[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / "bench.json"
    json_path.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    paths = [json_path]
    if report.sweep:
        paths.append(plot_sweep(report, output_dir / "accumulation_tradeoff.png"))
    return paths


def plot_sweep(report: BenchReport, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    ks = [r.accumulation_steps for r in report.sweep]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.errorbar(
        ks, [r.tokens_per_s for r in report.sweep],
        yerr=[[r.tokens_per_s - r.tokens_per_s_min for r in report.sweep],
              [r.tokens_per_s_max - r.tokens_per_s for r in report.sweep]],
        marker="o", capsize=3,
    )
    left.set(title="Throughput (median, min-max)", xlabel="accumulation steps K", ylabel="real tokens / s")
    right.plot(ks, [r.peak_memory_bytes / MiB for r in report.sweep], marker="o", label="peak tensor memory")
    right.plot(ks, [r.peak_saved_activation_bytes / MiB for r in report.sweep], marker="s",
               label="peak saved activations")
    right.set(title="Memory", xlabel="accumulation steps K", ylabel="MiB")
    right.legend()
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    c = report.config
    fig.suptitle(f"Global batch {c.global_batch_size} = micro-batch x K; {report.model}; {c.device}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
