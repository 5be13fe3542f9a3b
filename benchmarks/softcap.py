"""Section ``softcap``: soft-capped logits at a 256k vocabulary (Gemma 2), ``AccumTrainer`` vs stock ``Trainer``.

Gemma 2 and 3 cap their logits (``final_logit_softcapping``: ``c * tanh(logits / c)``) and have the largest
vocabularies people fine-tune (256000 / 262144). A randomly initialised Gemma 2 of ``--softcap-layers`` layers
and hidden ``--softcap-hidden-size`` (its head tied to the embedding, as shipped) trains with stock
``transformers.Trainer`` and with :class:`hf_accum.AccumTrainer`, each run in its own process and measured
exactly as in the ``vocab`` section (:mod:`benchmarks.vocab`: time per update between optimizer steps, the
peak memory increment during training, rounds alternating the order, ratios within a round).

The table also says which loss path ``AccumTrainer`` took, read from hf_accum's own log line: ``fused`` (the
soft-cap folded into the chunked loss, no ``(tokens x vocab)`` logits) or ``logits`` (the model's full logits,
then the exact loss). Targets, judged on rows of 512 tokens or more: time per update <= 0.95x and peak memory
<= 0.5x of stock ``Trainer``. Beside the ratios, each front-end's MFU, measured as in the ``vocab`` section.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from transformers.hf_argparser import HfArg

from benchmarks.harness import Bench
from benchmarks.report import (
    BenchError, SectionResult, judge, median_interval, median_mfu, mib, percent, require_positive, summary_row,
)
from benchmarks.vocab import (
    FULL_SIZE_MIN_LENGTH, Comparison, RunMeasure, RunSpec, VocabWorkers, _combined_verdict, _compare, _spread,
    run_mfu_meaning,
)

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

GEMMA_VOCAB = 256000
TIME_TARGET, MEMORY_TARGET = 0.95, 0.5
VARIANTS = {"trainer": "stock transformers.Trainer", "accum_trainer": "hf_accum.AccumTrainer"}


@dataclass
class Options:
    _argument_group_name = "softcap section"

    softcap_vocab_sizes: list[int] = HfArg(default_factory=lambda: [GEMMA_VOCAB],
                                           help="vocabularies (Gemma 2: 256000, Gemma 3: 262144)")
    softcap_value: float = HfArg(default=30.0, help="final_logit_softcapping (Gemma 2's: 30.0)")
    softcap_min_length: int = HfArg(default=64, help="shortest random row in tokens (the targets are set at 512)")
    softcap_max_length: int = HfArg(default=128, help="longest random row in tokens (the targets are set at 1024)")
    softcap_micro_batch: int = HfArg(default=2, help="rows per micro-batch")
    softcap_accumulation: int = HfArg(default=2, help="micro-batches per update (K)")
    softcap_updates: int = HfArg(default=2, help="optimizer updates per run; the first is not timed")
    softcap_pairs: int = HfArg(default=2, help="rounds: stock Trainer and AccumTrainer once each, in their own "
                                               "processes, the order alternating")
    softcap_hidden_size: int = HfArg(default=256, help="hidden size of the Gemma 2 (4 heads, intermediate 3x)")
    softcap_layers: int = HfArg(default=2, help="decoder layers of the Gemma 2")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(
        softcap_micro_batch=options.softcap_micro_batch, softcap_accumulation=options.softcap_accumulation,
        softcap_updates=options.softcap_updates, softcap_pairs=options.softcap_pairs,
        softcap_layers=options.softcap_layers,
    )
    if not 2 <= options.softcap_min_length <= options.softcap_max_length:
        raise BenchError(f"need 2 <= softcap_min_length <= softcap_max_length, got {options.softcap_min_length} and "
                         f"{options.softcap_max_length}")
    if options.softcap_value <= 0:
        raise BenchError(f"softcap_value={options.softcap_value} must be positive")
    bad = [v for v in options.softcap_vocab_sizes if v < 3]
    if bad or not options.softcap_vocab_sizes:
        raise BenchError(f"softcap_vocab_sizes {bad or '(none)'}: each must be at least 3")
    if options.softcap_hidden_size < 16 or options.softcap_hidden_size % 8:
        raise BenchError(f"softcap_hidden_size={options.softcap_hidden_size} must be a multiple of 8, at least 16 "
                         "(4 attention heads of an even size)")


@dataclass
class SoftcapRow:
    vocab_size: int
    runs: dict[str, list[RunMeasure]]
    comparison: Comparison

    @property
    def path(self) -> str:
        """The loss path AccumTrainer took (all its runs; normally one value)."""
        return "/".join(sorted({r.path for r in self.runs["accum_trainer"]})) or "?"


@dataclass
class SoftcapResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("full_size",)

    model: str
    softcap: float
    device: str
    clock: str
    micro_batch: int
    accumulation_steps: int
    min_length: int
    max_length: int
    updates: int
    pairs: int
    rows: list[SoftcapRow] = field(default_factory=list)

    @property
    def full_size(self) -> bool:
        return self.min_length >= FULL_SIZE_MIN_LENGTH

    def text(self) -> str:
        memory = "peak RSS increment" if self.device == "cpu" else "peak CUDA allocation increment"
        lines = [
            f"\nSoft-capped logits: {self.model}, final_logit_softcapping={self.softcap:g}; micro-batch "
            f"{self.micro_batch} rows of {self.min_length}-{self.max_length} tokens, K={self.accumulation_steps}, "
            f"{self.updates} updates per run, {self.pairs} rounds, each run in its own process; time per update by "
            f"{self.clock} time, memory = {memory} during training",
        ]
        for row in self.rows:
            lines.append(f"  vocab {row.vocab_size}: AccumTrainer took the {row.path} loss path")
            for name, runs in row.runs.items():
                seconds = statistics.median(getattr(r, self.clock) for r in runs)
                peak = statistics.median(r.peak_bytes for r in runs)
                lines.append(f"    {VARIANTS[name]:<30} {seconds:8.3f} s/update  peak {mib(int(peak)):>12}  "
                             f"MFU {percent(median_mfu(r.mfu for r in runs)):>6}")
            lines.append(f"    {run_mfu_meaning(row.runs)}")
            c = row.comparison
            lines.append(f"    AccumTrainer / stock Trainer ({row.path} path): time {_spread(c.time_ratios)}, "
                         f"memory {_spread(c.memory_ratios)}")
        if not self.full_size:
            lines.append(f"  (rows shorter than {FULL_SIZE_MIN_LENGTH} tokens: the targets are not judged; "
                         f"benchmarks/README.md gives the full-size command)")
        return "\n".join(lines)

    def summary(self) -> list[dict]:
        out = []
        for row in self.rows:
            c = row.comparison
            passed = [judge(median_interval(c.time_ratios), TIME_TARGET, at_least=False),
                      judge(median_interval(c.memory_ratios), MEMORY_TARGET, at_least=False)]
            out.append(summary_row(
                f"softcap vocab {row.vocab_size}: AccumTrainer / stock Trainer",
                f"time {_spread(c.time_ratios)}, memory {_spread(c.memory_ratios)} ({row.path} path)",
                f"time <= {TIME_TARGET:.2f}, memory <= {MEMORY_TARGET:.2f}",
                _combined_verdict(passed) if self.full_size else "n/a (small)",
            ))
        return out


def _spec(common: BenchOptions, options: Options, variant: str, vocab_size: int) -> RunSpec:
    return RunSpec(
        variant, vocab_size, options.softcap_hidden_size, options.softcap_layers, options.softcap_micro_batch,
        options.softcap_accumulation, options.softcap_updates, options.softcap_min_length, options.softcap_max_length,
        common.seed, common.device, common.dtype, common.threads, family="gemma2", softcap=options.softcap_value,
    )


def measure(bench: Bench, options: Options) -> SoftcapResult:
    common = bench.options
    result = SoftcapResult(
        f"Gemma 2 ({options.softcap_layers} layers, hidden {options.softcap_hidden_size}, tied head)",
        options.softcap_value,
        common.device, bench.clock, options.softcap_micro_batch, options.softcap_accumulation,
        options.softcap_min_length, options.softcap_max_length, options.softcap_updates, options.softcap_pairs,
    )
    names = list(VARIANTS)
    workers = VocabWorkers(common.threads)
    try:
        with bench.progress(len(options.softcap_vocab_sizes) * options.softcap_pairs * 2, "softcap runs") as bar:
            for vocab_size in options.softcap_vocab_sizes:
                runs: dict[str, list[RunMeasure]] = {name: [] for name in names}
                for round_index in range(options.softcap_pairs):
                    # Alternate the order between rounds so a drift in machine load favours neither side.
                    for name in names if round_index % 2 == 0 else reversed(names):
                        runs[name].append(workers.run(_spec(common, options, name, vocab_size)))
                        bar.update(1)
                (comparison,) = [c for c in _compare(runs, bench.clock) if c.baseline == "trainer"]
                result.rows.append(SoftcapRow(vocab_size, runs, comparison))
    finally:
        workers.close()
    return result
