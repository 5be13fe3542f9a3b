"""Section ``vocab``: what exactness costs at the vocabularies users have (128256, 32000).

At each vocabulary, a Llama of ``--vocab-layers`` layers and hidden ``--vocab-hidden-size`` trains
``--vocab-updates`` updates of ``--vocab-accumulation`` micro-batches of ``--vocab-micro-batch`` rows,
with every front-end a user would choose between:

* stock ``transformers.Trainer`` vs :class:`hf_accum.AccumTrainer` (and stock ``Trainer`` with
  ``use_liger_kernel=True`` where CUDA and liger-kernel exist -- it never materializes the logits);
* a bare Accelerate loop (``model(**batch).loss`` inside ``accelerator.accumulate()``,
  :func:`hf_accum.testing.naive_loop`) vs :func:`hf_accum.train`.

Every run is a fresh process, so its peak memory is its own: on CPU the peak resident set size
(``VmHWM``, reset through ``/proc/self/clear_refs`` when training starts) minus the resident size at
that moment; on CUDA ``torch.cuda.max_memory_allocated`` minus what was allocated then. The time per
update is taken between optimizer steps (the first update, with its lazy initialisations and the
optimizer state's allocation, is not timed unless it is the only one). Runs are interleaved: in each
round every front-end of a comparison runs once, adjacent to its baseline, the order alternating
between rounds; the ratios ours / baseline are taken within a round. Beside them, each front-end's MFU: the model
FLOPs of the timed updates (:mod:`hf_accum.measure.utilization`'s count, the same for every front-end on these rows) over
their wall time and the device's peak (:func:`benchmarks.harness.device_peak`).

Targets (issue "exactness without a price at real vocabularies"), judged only on rows of 512 tokens or
more: at vocab >= 128256, time per update <= 0.95x and peak memory <= 0.5x; below, time <= 1.0x.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from transformers.hf_argparser import HfArg

from benchmarks.harness import (
    BENCH_POSITIONS, Bench, LossPathLog, batch_flops, bench_llama, bench_scenario, build_trainer, device_peak, mfu,
    padded_loader, prepare_loop, synchronize,
)
from benchmarks.report import (
    BenchError, SectionResult, judge, median_interval, median_mfu, mfu_meaning, mib, percent, require_positive,
    summary_row, verdict,
)
from benchmarks.workers import Workers, peak_memory, reset_peak
from hf_accum.batching import PaddingCollator
from hf_accum.testing import Scenario, loop_config, naive_loop, random_rows

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

FULL_SIZE_MIN_LENGTH = 512
"""The targets are set for rows of 512-1024 tokens; shorter rows measure the same paths, scaled down."""
LARGE_VOCAB = 128256


def targets(vocab_size: int) -> tuple[float, float | None]:
    """(time-per-update target, peak-memory target or None) of ours / baseline at ``vocab_size``."""
    return (0.95, 0.5) if vocab_size >= LARGE_VOCAB else (1.0, None)


@dataclass
class Options:
    _argument_group_name = "vocab section"

    vocab_sizes: list[int] = HfArg(default_factory=lambda: [LARGE_VOCAB, 32000],
                                   help="vocabularies to measure at (Llama 3: 128256, Llama 2 / Mistral: 32000)")
    vocab_min_length: int = HfArg(default=64, help="shortest random row in tokens (the targets are set at 512)")
    vocab_max_length: int = HfArg(default=128, help="longest random row in tokens (the targets are set at 1024)")
    vocab_micro_batch: int = HfArg(default=2, help="rows per micro-batch")
    vocab_accumulation: int = HfArg(default=2, help="micro-batches per update (K)")
    vocab_updates: int = HfArg(default=2, help="optimizer updates per run; the first is not timed unless it is "
                                               "the only one")
    vocab_pairs: int = HfArg(default=2, help="interleaved rounds: each front-end runs once per round, in its own "
                                             "process, next to its baseline")
    vocab_hidden_size: int = HfArg(default=256, help="hidden size of the Llama (intermediate size 3x)")
    vocab_layers: int = HfArg(default=2, help="decoder layers of the Llama")
    vocab_sequence_normalization: bool = HfArg(
        default=False, help="also run AccumTrainer with normalization='sequence', fused and on the logits path "
                            "(fused_loss=False), side by side (no target: what the fused weights save)")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(
        vocab_micro_batch=options.vocab_micro_batch, vocab_accumulation=options.vocab_accumulation,
        vocab_updates=options.vocab_updates, vocab_pairs=options.vocab_pairs, vocab_layers=options.vocab_layers,
    )
    if not 2 <= options.vocab_min_length <= options.vocab_max_length:
        raise BenchError(f"need 2 <= vocab_min_length <= vocab_max_length, got {options.vocab_min_length} and "
                         f"{options.vocab_max_length}")
    bad = [v for v in options.vocab_sizes if v < 2]
    if bad or not options.vocab_sizes:
        raise BenchError(f"vocab_sizes {bad or '(none)'}: each must be at least 2")
    if options.vocab_hidden_size < 8 or options.vocab_hidden_size % 8:
        raise BenchError(f"vocab_hidden_size={options.vocab_hidden_size} must be a positive multiple of 8 "
                         "(4 attention heads of an even size)")
    if common.device == "cpu" and not Path("/proc/self/clear_refs").exists():
        raise BenchError("the vocab section measures peak RSS through /proc/self/clear_refs (Linux); "
                         "run it on Linux or with --device cuda")


# ----------------------------------------------------------------------------------------------
# One run, in its own process
# ----------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    """Everything a worker process needs to build the model and data and run one front-end."""

    variant: str
    vocab_size: int
    hidden_size: int
    layers: int
    micro_batch: int
    accumulation: int
    updates: int
    min_length: int
    max_length: int
    seed: int
    device: str
    dtype: str
    threads: int | None
    family: str = "llama"
    """``llama`` (:func:`benchmarks.harness.bench_llama`) or ``gemma2`` (soft-capped logits, tied head)."""
    softcap: float | None = None
    """Gemma 2's ``final_logit_softcapping`` (``c * tanh(logits / c)``)."""


@dataclass
class RunMeasure:
    wall: float
    """Wall-clock seconds per timed update."""
    cpu: float
    """Process CPU seconds (all threads) per timed update."""
    peak_bytes: int
    """Peak memory during training minus the memory when it started."""
    updates: int
    """Optimizer steps seen (must equal the updates asked for)."""
    path: str = "-"
    """hf_accum front-ends: the loss path taken, ``fused`` or ``logits`` (from hf_accum's log line)."""
    flops: float = 0.0
    """Model FLOPs per timed update (:func:`benchmarks.harness.batch_flops` over the rows of those updates)."""
    mfu: float | None = None
    """``flops / wall / peak`` (None: no peak known)."""
    peak: str = ""
    """The peak FLOP/s of ``mfu``, and where it came from."""


def timed_updates(count: int) -> range:
    """The updates (0-based) whose time a run reports: all but the first, which warms up (lazy
    initialisations, the optimizer state's allocation), unless it is the only one."""
    return range(1, count) if count > 1 else range(count)


class Measurement:
    """Time per update (between optimizer steps) and peak memory of one training call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[tuple[float, float]] = []
        self.peak_bytes = 0

    def _stamp(self, *_args) -> None:
        synchronize(self.device)
        self.stamps.append((time.perf_counter(), time.process_time()))

    @contextmanager
    def around(self, optimizer: torch.optim.Optimizer):
        """Measure the block, which must train with ``optimizer`` (a torch optimizer, or Accelerate's wrapper)."""
        hook = getattr(optimizer, "optimizer", optimizer).register_step_post_hook(self._stamp)
        gc.collect()
        start = reset_peak(self.device)
        self._stamp()
        try:
            yield self
        finally:
            hook.remove()
        self.peak_bytes = peak_memory(self.device) - start

    def result(self) -> RunMeasure:
        steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(self.stamps, self.stamps[1:])]
        timed = [steps[i] for i in timed_updates(len(steps))]
        return RunMeasure(statistics.fmean(s[0] for s in timed), statistics.fmean(s[1] for s in timed),
                          self.peak_bytes, len(steps))


def _run_trainer(scenario: Scenario, device: torch.device, measurement: Measurement, output_dir: str, *,
                 accum: bool, liger: bool = False, **accum_options) -> None:
    trainer = build_trainer(scenario, accum, output_dir, device, accum_options, use_liger_kernel=liger)
    trainer.create_optimizer()  # Trainer's own default optimizer, created now so that its steps can be timed
    with measurement.around(trainer.optimizer):
        trainer.train()


def _run_bare_loop(scenario: Scenario, device: torch.device, measurement: Measurement, output_dir: str) -> None:
    from transformers import get_scheduler

    model, optimizer, loader, accelerator = prepare_loop(scenario, device)
    updates = math.ceil(len(loader) / scenario.accumulation)
    scheduler = get_scheduler(scenario.scheduler, optimizer, num_warmup_steps=0, num_training_steps=updates)
    with measurement.around(optimizer):
        naive_loop(model, optimizer, loader, accelerator, scheduler, max_grad_norm=scenario.max_grad_norm)


def _run_hf_accum_train(scenario: Scenario, device: torch.device, measurement: Measurement, output_dir: str) -> None:
    from hf_accum.loop import train

    model, optimizer, loader, accelerator = prepare_loop(scenario, device)
    with measurement.around(optimizer):
        train(model, optimizer, loader, accelerator, loop_config(scenario))


@dataclass(frozen=True)
class Variant:
    label: str
    run: Callable[..., None]
    """``run(scenario, device, measurement, output_dir)``: set up, then train inside ``measurement.around``."""


VARIANTS = {
    "trainer": Variant("stock transformers.Trainer",
                       lambda *a: _run_trainer(*a, accum=False)),
    "trainer_liger": Variant("stock Trainer + Liger (use_liger_kernel=True)",
                             lambda *a: _run_trainer(*a, accum=False, liger=True)),
    "accum_trainer": Variant("hf_accum.AccumTrainer", lambda *a: _run_trainer(*a, accum=True)),
    "accelerate_loop": Variant("bare Accelerate loop (model(**batch).loss, accumulate())", _run_bare_loop),
    "hf_accum_train": Variant("hf_accum.train", _run_hf_accum_train),
    "accum_sequence_logits": Variant("AccumTrainer, normalization='sequence', fused_loss=False",
                                     lambda *a: _run_trainer(*a, accum=True, normalization="sequence",
                                                             fused_loss=False)),
    "accum_sequence": Variant("AccumTrainer, normalization='sequence' (fused)",
                              lambda *a: _run_trainer(*a, accum=True, normalization="sequence")),
}
# Front-ends that run next to each other in a round (baselines first), and the ratios reported.
GROUPS = (("trainer", "trainer_liger", "accum_trainer"), ("accelerate_loop", "hf_accum_train"))
SEQUENCE_GROUP = ("accum_sequence_logits", "accum_sequence")  # --vocab-sequence-normalization
COMPARISONS = (("accum_trainer", "trainer"), ("accum_trainer", "trainer_liger"), ("hf_accum_train", "accelerate_loop"),
               SEQUENCE_GROUP[::-1])
TARGETED = {("accum_trainer", "trainer"), ("hf_accum_train", "accelerate_loop")}
"""Comparisons with a target (the paths our front-ends replace); the one against Liger is reported only."""


def build_model(spec: RunSpec) -> torch.nn.Module:
    """The randomly initialised model of ``spec`` (same seed: same weights in every run)."""
    dtype = getattr(torch, spec.dtype)
    positions = max(spec.max_length, BENCH_POSITIONS)
    if spec.family == "llama":
        return bench_llama(spec.vocab_size, dtype, spec.seed, hidden_size=spec.hidden_size,
                           intermediate_size=3 * spec.hidden_size, num_hidden_layers=spec.layers,
                           max_position_embeddings=positions)
    if spec.family == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        # Gemma 2's shape scaled down; its head as shipped: tied to the embedding, logits soft-capped.
        config = Gemma2Config(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=3 * spec.hidden_size,
            num_hidden_layers=spec.layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=spec.hidden_size // 4, query_pre_attn_scalar=spec.hidden_size // 4,
            max_position_embeddings=positions, sliding_window=positions, final_logit_softcapping=spec.softcap,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
        )
        torch.manual_seed(spec.seed)
        return Gemma2ForCausalLM(config).to(dtype)
    raise ValueError(f"family={spec.family!r}; allowed: 'llama', 'gemma2'")


def run_here(spec: RunSpec) -> RunMeasure:
    """Build the model and rows of ``spec`` and measure its front-end in this process."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    model = build_model(spec).to(device)
    rows = random_rows(spec.micro_batch * spec.accumulation * spec.updates, seed=spec.seed, min_len=spec.min_length,
                       max_len=spec.max_length, vocab_size=spec.vocab_size, pad_token_id=0, lowest_id=0)
    scenario = bench_scenario(spec.variant, lambda: model, rows, PaddingCollator(0), spec.micro_batch,
                              spec.accumulation)
    measurement = Measurement(device)
    with tempfile.TemporaryDirectory(prefix="hf_accum_bench_") as tmp, LossPathLog.watching() as path_log:
        VARIANTS[spec.variant].run(scenario, device, measurement, tmp)
    result = measurement.result()
    result.path = path_log.path
    if result.updates != spec.updates:
        raise RuntimeError(f"{spec.variant}: {result.updates} optimizer steps seen, {spec.updates} expected")
    peak = device_peak(device, model)  # after training: a CPU peak's GEMM probe stays out of the measured window
    result.flops = timed_update_flops(model, rows, spec)
    result.mfu, result.peak = mfu(result.flops, result.wall, peak.flops), peak.describe()
    return result


def timed_update_flops(model: torch.nn.Module, rows: list[dict], spec: RunSpec) -> float:
    """Model FLOPs per timed update: every front-end takes the rows in order (sequential sampling), ``micro_batch``
    rows padded per micro-batch, ``accumulation`` micro-batches per update."""
    per_update = spec.micro_batch * spec.accumulation
    updates = timed_updates(spec.updates)
    total = sum(batch_flops(model, padded_loader(rows[u * per_update:(u + 1) * per_update], spec.micro_batch, 0))
                for u in updates)
    return total / len(updates)


class VocabWorkers(Workers):
    """Each :class:`RunSpec` in a fresh process (see :mod:`benchmarks.workers`)."""

    def __init__(self, threads: int | None):
        super().__init__(threads, preload=["benchmarks.vocab"])

    def run(self, spec: RunSpec) -> RunMeasure:
        return RunMeasure(**self.call("benchmarks.vocab:run_here_json", spec,
                                      f"vocab run {spec.variant} at vocab {spec.vocab_size}"))


def run_here_json(**spec) -> RunMeasure:
    return run_here(RunSpec(**spec))


# ----------------------------------------------------------------------------------------------
# The section: rounds of interleaved runs, ratios within a round
# ----------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    ours: str
    baseline: str
    time_ratios: list[float]
    """Per round: ours / baseline seconds per update, by the section's clock."""
    memory_ratios: list[float]
    """Per round: ours / baseline peak memory."""


@dataclass
class VocabRow:
    vocab_size: int
    runs: dict[str, list[RunMeasure]]
    comparisons: list[Comparison] = field(default_factory=list)


@dataclass
class VocabResult(SectionResult):
    model: str
    """The Llama's shape (the vocabulary varies per row)."""
    dtype: str
    device: str
    clock: str
    """Which time the ratios use: 'cpu' (process CPU seconds; CPU device) or 'wall' (CUDA)."""
    micro_batch: int
    accumulation_steps: int
    min_length: int
    max_length: int
    updates: int
    pairs: int
    skipped: dict[str, str]
    """Front-end -> why it did not run."""
    rows: list[VocabRow] = field(default_factory=list)

    @property
    def full_size(self) -> bool:
        return self.min_length >= FULL_SIZE_MIN_LENGTH

    def text(self) -> str:
        memory = "peak RSS increment" if self.device == "cpu" else "peak CUDA allocation increment"
        lines = [
            f"\nVocabulary: {self.model}, {self.dtype}; micro-batch {self.micro_batch} rows of {self.min_length}-"
            f"{self.max_length} tokens, K={self.accumulation_steps}, {self.updates} updates per run, {self.pairs} "
            f"interleaved rounds, each run in its own process; time per update by {self.clock} time, memory = "
            f"{memory} during training",
            *(f"  {VARIANTS[name].label}: skipped ({why})" for name, why in self.skipped.items()),
        ]
        for row in self.rows:
            lines.append(f"  vocab {row.vocab_size}:")
            for name, runs in row.runs.items():
                seconds = statistics.median(getattr(r, self.clock) for r in runs)
                peak = statistics.median(r.peak_bytes for r in runs)
                path = "/".join(sorted({r.path for r in runs} - {"-"}))
                lines.append(f"    {VARIANTS[name].label:<58} {seconds:8.3f} s/update  peak {mib(int(peak)):>12}  "
                             f"MFU {percent(median_mfu(r.mfu for r in runs)):>6}"
                             + (f"  ({path} loss path)" if path else ""))
            lines.append(f"    {run_mfu_meaning(row.runs)}")
            for c in row.comparisons:
                lines.append(
                    f"    {VARIANTS[c.ours].label} / {VARIANTS[c.baseline].label}: time {_spread(c.time_ratios)}, "
                    f"memory {_spread(c.memory_ratios)}"
                )
        if not self.full_size:
            lines.append(f"  (rows shorter than {FULL_SIZE_MIN_LENGTH} tokens: the targets are not judged; "
                         f"benchmarks/README.md gives the full-size command)")
        return "\n".join(lines)

    def summary(self) -> list[dict]:
        rows = []
        for row in self.rows:
            time_target, memory_target = targets(row.vocab_size)
            for c in row.comparisons:
                if (c.ours, c.baseline) not in TARGETED:
                    continue
                passed = [judge(median_interval(c.time_ratios), time_target, at_least=False)]
                threshold = f"time <= {time_target:.2f}"
                if memory_target is not None:
                    passed.append(judge(median_interval(c.memory_ratios), memory_target, at_least=False))
                    threshold += f", memory <= {memory_target:.2f}"
                rows.append(summary_row(
                    f"vocab {row.vocab_size}: {VARIANTS[c.ours].label} / {VARIANTS[c.baseline].label}",
                    f"time {_spread(c.time_ratios)}, memory {_spread(c.memory_ratios)}",
                    threshold, _combined_verdict(passed) if self.full_size else "n/a (small)",
                ))
        return rows


def run_mfu_meaning(runs: dict[str, list[RunMeasure]]) -> str:
    """The MFU line under one vocabulary's table (MFU: the median over a front-end's runs)."""
    return mfu_meaning(r.peak for measured in runs.values() for r in measured)


def _spread(ratios: list[float]) -> str:
    low, high = min(ratios), max(ratios)
    return f"{statistics.median(ratios):.3f}x ({low:.3f}-{high:.3f} over {len(ratios)})"


def _combined_verdict(passed: list[bool | None]) -> str:
    if any(p is False for p in passed):
        return "FAIL"
    return verdict(True if all(passed) else None, "INCONCLUSIVE")


def liger_unavailable(device: str) -> str | None:
    """Why stock Trainer + Liger cannot run here, or None when it can."""
    if device != "cuda":
        return f"Liger's kernels need CUDA; this run is on {device}"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed: pip install liger-kernel"
    return None


def measure(bench: Bench, options: Options) -> VocabResult:
    common = bench.options
    skipped = {}
    why = liger_unavailable(common.device)
    if why is not None:
        skipped["trainer_liger"] = why
    chosen = GROUPS + ((SEQUENCE_GROUP,) if options.vocab_sequence_normalization else ())
    groups = [[name for name in group if name not in skipped] for group in chosen]
    result = VocabResult(
        f"Llama ({options.vocab_layers} layers, hidden {options.vocab_hidden_size})", common.dtype, common.device,
        bench.clock, options.vocab_micro_batch, options.vocab_accumulation, options.vocab_min_length,
        options.vocab_max_length, options.vocab_updates, options.vocab_pairs, skipped,
    )
    total = len(options.vocab_sizes) * options.vocab_pairs * sum(map(len, groups))
    workers = VocabWorkers(common.threads)
    try:
        with bench.progress(total, "vocab runs") as bar:
            for vocab_size in options.vocab_sizes:
                runs: dict[str, list[RunMeasure]] = {name: [] for group in groups for name in group}
                for round_index in range(options.vocab_pairs):
                    for group in groups:
                        # Alternate the order between rounds so a drift in machine load favours no side.
                        for name in group if round_index % 2 == 0 else reversed(group):
                            runs[name].append(workers.run(_spec(common, options, name, vocab_size)))
                            bar.update(1)
                result.rows.append(VocabRow(vocab_size, runs, _compare(runs, bench.clock)))
    finally:
        workers.close()
    return result


def _spec(common: BenchOptions, options: Options, variant: str, vocab_size: int) -> RunSpec:
    return RunSpec(
        variant, vocab_size, options.vocab_hidden_size, options.vocab_layers, options.vocab_micro_batch,
        options.vocab_accumulation, options.vocab_updates, options.vocab_min_length, options.vocab_max_length,
        common.seed, common.device, common.dtype, common.threads,
    )


def _compare(runs: dict[str, list[RunMeasure]], clock: str) -> list[Comparison]:
    comparisons = []
    for ours, baseline in COMPARISONS:
        if ours in runs and baseline in runs:
            pairs = list(zip(runs[ours], runs[baseline]))
            comparisons.append(Comparison(
                ours, baseline, [getattr(o, clock) / getattr(b, clock) for o, b in pairs],
                [o.peak_bytes / b.peak_bytes for o, b in pairs],
            ))
    return comparisons


