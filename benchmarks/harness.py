"""What the sections measure with: the model and data, the runs being timed (hf_accum's loop, a
``Trainer``), the clocks, and the memory instruments.

What "memory" means for the sections that use :func:`measure_memory` (sweep, memory, loss) -- the
same numbers on CPU and CUDA:

* *peak tensor memory* = parameter bytes + the peak, during the measured window, of bytes held by
  tensors allocated in it (gradients, optimizer state, activations, batches, temporaries). On CUDA
  the peak comes from ``torch.cuda.max_memory_allocated``; on CPU from the allocation/free events
  the c10 CPU allocator reports to ``torch.profiler`` (``profile_memory=True``): exact tensor bytes,
  no allocator caching, no Python objects. Process RSS is not used there: inside one process it
  never goes down and counts the allocator's free lists (the vocab section, which runs every
  measurement in its own process, does use it).
* *peak saved activations* = the peak of distinct storages saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded: the part accumulation shrinks.

Runs use the shared test support (:mod:`hf_accum.testing`): a :class:`~hf_accum.testing.Scenario`
carries the batch arithmetic and per-update settings into ``TrainingArguments`` and ``LoopConfig``
exactly as the tests do, so every front-end compared does the same work per update.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from hf_accum.batching import PaddingCollator
from hf_accum.tiny import tiny_llama_config
from hf_accum.testing import (
    Scenario, fresh_accelerator, loop_config, random_rows, reset_accelerate_state, training_args,
)

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

BENCH_VOCAB = 4096
"""The built-in model's vocabulary: large enough that the LM head and the loss weigh as in a real
model, small enough for a couple of minutes on 2 CPU cores (the vocab section goes to 128256)."""
BENCH_POSITIONS = 1024
# What a user's run does per update, in every front-end compared: AdamW, linear schedule, clip at 1.0.
PER_UPDATE_SETTINGS = dict(lr=1e-4, scheduler="linear", max_grad_norm=1.0)


def bench_llama(vocab_size: int = BENCH_VOCAB, dtype: torch.dtype = torch.float32, seed: int = 0, **shape):
    """A randomly initialised Llama of the tiny shape (:func:`hf_accum.tiny.tiny_llama_config`),
    ``shape`` on top; the same seed gives the same weights."""
    from transformers import LlamaForCausalLM

    values = {"vocab_size": vocab_size, "max_position_embeddings": BENCH_POSITIONS, "pad_token_id": 0, **shape}
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**values)).to(dtype)


def describe(model: torch.nn.Module, dtype: str) -> str:
    """Parameter count and dtype."""
    n_params = sum(p.numel() for p in model.parameters())
    return f"{n_params / 1e6:.2f}M parameters, {dtype}"


def llama_shape(config) -> str:
    return f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}"


def bench_scenario(name: str, model_factory: Callable, examples: list, collator: Any, micro_batch: int,
                   accumulation: int) -> Scenario:
    return Scenario(name, model_factory, examples, collator, micro_batch=micro_batch, accumulation=accumulation,
                    **PER_UPDATE_SETTINGS)


# ----------------------------------------------------------------------------------------------
# The run context: options, the shared model (loaded when a section first needs it), progress
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


def load_workload(options: BenchOptions) -> Workload:
    dtype = getattr(torch, options.dtype)
    if options.model == "tiny":
        model = bench_llama(dtype=dtype, seed=options.seed)
        description = f"tiny Llama (random init: {llama_shape(model.config)}), {describe(model, options.dtype)}"
    else:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(options.seed)
        model = AutoModelForCausalLM.from_pretrained(options.model, dtype=dtype, local_files_only=True)
        description = f"{options.model} ({type(model).__name__}), {describe(model, options.dtype)}"
    device = torch.device(options.device)
    model.to(device)
    pad = model.config.pad_token_id
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return Workload(model, state, model.config.vocab_size, int(pad if pad is not None else 0), device, description)


def token_rows(work: Workload, n: int, seed: int, min_length: int, max_length: int, **kwargs) -> list[dict]:
    """``n`` rows of uniformly random length and random tokens over the whole vocabulary (never the
    pad id); every token is a target unless ``prompt_masking=True`` is passed."""
    return random_rows(n, seed=seed, min_len=min_length, max_len=max_length, vocab_size=work.vocab_size,
                       pad_token_id=work.pad_token_id, lowest_id=0, **kwargs)


def real_tokens(examples: Sequence[dict]) -> int:
    return sum(len(e["input_ids"]) for e in examples)


# ----------------------------------------------------------------------------------------------
# Model FLOPs and MFU: hf_accum.measure.utilization's count, so a table's MFU is the one a run's log line prints
# ----------------------------------------------------------------------------------------------


def batch_flops(model: torch.nn.Module, batches: Iterable[dict]) -> float:
    """Model FLOPs of training ``model`` on the collated causal-LM ``batches`` (forward + backward, the head on
    the targets: :class:`hf_accum.measure.utilization.ModelFlops`); the same for every front-end given these rows."""
    from hf_accum.accumulation import batch_shape_counts, squared_sequence_lengths
    from hf_accum.losses.token_loss import count_targets
    from hf_accum.measure.utilization import ModelFlops

    flops = ModelFlops.of(model)
    total = 0.0
    for batch in batches:
        _, tokens, _ = batch_shape_counts(batch)
        targets = count_targets(batch["labels"], "causal_lm")
        total += flops.update_flops(int(tokens), int(targets), int(squared_sequence_lengths(batch)))
    return total


def device_peak(device: torch.device | str, model: torch.nn.Module) -> Any:
    """One device's peak FLOP/s for ``model``'s compute dtype (:func:`hf_accum.measure.peak_flops.device_peak_flops`:
    ``$HF_ACCUM_PEAK_FLOPS``, a GPU's data-sheet peak, or a GEMM rate measured and cached for this CPU)."""
    from hf_accum.measure.peak_flops import device_peak_flops
    from hf_accum.measure.utilization import compute_dtype

    return device_peak_flops(device, compute_dtype(model))


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilization of ``flops`` done in ``seconds`` on a device of ``peak`` FLOP/s (None: unknown)."""
    return flops / seconds / peak if peak and seconds > 0 else None


@dataclass
class Bench:
    """What a section's ``measure(bench, options)`` gets: the common options, the shared model, progress."""

    options: BenchOptions
    echo: Callable[[str], None] = print

    @cached_property
    def workload(self) -> Workload:
        work = load_workload(self.options)
        self.echo(f"model: {work.description}")
        return work

    @property
    def loaded_model(self) -> str:
        """The shared model's description, or '' when no section needed it."""
        return self.workload.description if "workload" in self.__dict__ else ""

    @property
    def device(self) -> torch.device:
        return torch.device(self.options.device)

    @property
    def clock(self) -> str:
        """The time ratios are judged by: process CPU seconds on a CPU device (it counts the work
        done, not the time other jobs held the cores); wall-clock seconds on CUDA (the host waits)."""
        return "cpu" if self.options.device == "cpu" else "wall"

    @contextlib.contextmanager
    def progress(self, total: int, desc: str):
        bar = tqdm(total=total, desc=desc, disable=self.options.no_progress)
        try:
            yield bar
        finally:
            bar.close()


# ----------------------------------------------------------------------------------------------
# Clocks
# ----------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Wall-clock seconds and this process's CPU seconds (all threads)."""

    wall: float
    cpu: float

    def on(self, clock: str) -> float:
        return getattr(self, clock)


@contextlib.contextmanager
def timed(device: torch.device):
    """Yield a :class:`Timing` filled in when the block ends (device work waited for)."""
    timing = Timing(0.0, 0.0)
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    yield timing
    synchronize(device)
    timing.wall, timing.cpu = time.perf_counter() - wall, time.process_time() - cpu


# ----------------------------------------------------------------------------------------------
# Runs: hf_accum's loop and a Trainer
# ----------------------------------------------------------------------------------------------


def padded_loader(examples: list, micro_batch: int, pad_id: int) -> DataLoader:
    return DataLoader(examples, batch_size=micro_batch, shuffle=False, collate_fn=PaddingCollator(pad_id))


def prepare_loop(scenario: Scenario, device: torch.device):
    """(model, optimizer, loader, accelerator) of ``scenario`` after ``accelerator.prepare``."""
    accelerator = fresh_accelerator(scenario.accumulation, device)
    model = scenario.model_factory()
    optimizer = torch.optim.AdamW(model.parameters(), lr=scenario.lr)
    loader = DataLoader(scenario.examples, batch_size=scenario.micro_batch, shuffle=False,
                        collate_fn=scenario.collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return model, optimizer, loader, accelerator


def run_ours(work: Workload, examples: list, micro_batch: int, accumulation: int) -> Timing:
    """Time of :func:`hf_accum.loop.train` over ``examples`` (model setup excluded)."""
    from hf_accum.loop import train

    scenario = bench_scenario("ours", work.reset, examples, PaddingCollator(work.pad_token_id), micro_batch,
                              accumulation)
    model, optimizer, loader, accelerator = prepare_loop(scenario, work.device)
    with timed(work.device) as timing:
        train(model, optimizer, loader, accelerator, loop_config(scenario))
    return timing


def build_trainer(scenario: Scenario, accum: bool, output_dir: str, device: torch.device,
                  accum_options: dict | None = None, **arg_overrides):
    """Stock ``transformers.Trainer`` (``accum=False``) or :class:`hf_accum.AccumTrainer` on
    ``scenario`` (``accum_options``: its own keyword arguments), with ``TrainingArguments`` from the shared
    :func:`hf_accum.testing.training_args` and no log lines on stdout."""
    from transformers import PrinterCallback, Trainer

    from hf_accum.trainer import AccumTrainer

    reset_accelerate_state()  # the Trainer builds its own Accelerator
    args = training_args(scenario, output_dir, logging_strategy="no", use_cpu=device.type == "cpu", **arg_overrides)
    cls = AccumTrainer if accum else Trainer
    trainer = cls(model=scenario.model_factory(), args=args, train_dataset=scenario.examples,
                  data_collator=scenario.collator, **(accum_options or {}))
    trainer.remove_callback(PrinterCallback)
    return trainer


# ----------------------------------------------------------------------------------------------
# Memory measurement (tensor bytes: profiler replay on CPU, allocator counters on CUDA)
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
    """Yield a :class:`MemoryReading`, filled in when the block ends (see the module docstring): the library's
    peak tensor memory (:func:`hf_accum.measure.memory.measure_memory`) plus the peak of saved activations."""
    from hf_accum.measure.memory import measure_memory as measure_tensor_memory

    reading = MemoryReading()
    saved = SavedActivations(parameters)
    with measure_tensor_memory(device) as tensors, saved.hooks():
        yield reading
    reading.peak_bytes, reading.largest_allocation = tensors.peak_bytes, tensors.largest_allocation
    reading.peak_saved_bytes = saved.peak


MEMORY_UPDATES = 2
"""Updates inside a memory window: from the 2nd on, optimizer state exists, as in any real run."""


def training_memory(work: Workload, examples: list, micro_batch: int, accumulation: int) -> MemoryReading:
    """Memory of :data:`MEMORY_UPDATES` updates of our loop (``examples`` must hold exactly that many)."""
    from hf_accum.loop import train

    if len(examples) != MEMORY_UPDATES * micro_batch * accumulation:
        raise ValueError(f"need {MEMORY_UPDATES} x {micro_batch} x {accumulation} examples, got {len(examples)}")
    scenario = bench_scenario("memory", work.reset, examples, PaddingCollator(work.pad_token_id), micro_batch,
                              accumulation)
    model, optimizer, loader, accelerator = prepare_loop(scenario, work.device)
    with measure_memory(work.device, model.parameters()) as reading:
        train(model, optimizer, loader, accelerator, loop_config(scenario))
    reading.peak_bytes += work.parameter_bytes  # parameters were allocated before the window
    del optimizer, loader, accelerator
    return reading


class LossPathLog(logging.Handler):
    """Reads hf_accum's log line saying which loss path a run takes: ``fused`` (no ``(tokens x vocab)``
    logits) or ``logits``; ``-`` until such a line is seen (front-ends that are not hf_accum's). Reading the
    library's own line makes the benchmark report what the library did, whatever its internals."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.path = "-"

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "fused linear cross-entropy on" in message:
            self.path = "fused"
        elif "logits path" in message or "not the fused loss" in message:
            self.path = "logits"

    @classmethod
    @contextlib.contextmanager
    def watching(cls):
        """Yield a handler attached to the ``hf_accum`` logger for the block."""
        handler = cls()
        library = logging.getLogger("hf_accum")
        library.addHandler(handler)
        try:
            yield handler
        finally:
            library.removeHandler(handler)


def checkout_root() -> Path:
    """The repository checkout this benchmarks package lives in (its worker processes import it from there)."""
    return Path(__file__).resolve().parent.parent
