"""Section ``sweep``: the accumulation trade-off.

A fixed global batch is split into ``K`` micro-batches of ``global / K`` sequences, for each ``K``:
real (non-pad) tokens/s of :func:`hf_accum.loop.train` and peak memory. Table, PNG, JSON.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from transformers.hf_argparser import HfArg

from benchmarks.harness import MEMORY_UPDATES, Bench, Timing, real_tokens, run_ours, token_rows, training_memory
from benchmarks.report import MEMORY_MEANING, MiB, BenchError, SectionResult, mib, require_positive

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions


@dataclass
class Options:
    _argument_group_name = "sweep section"

    accumulation_steps: list[int] = HfArg(default_factory=lambda: [1, 2, 4, 8, 16],
                                          help="K values to sweep; each must divide --global-batch-size")
    repeats: int = HfArg(default=3, help="sweep runs per K (interleaved across K); the median is reported")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def require_divisors(name: str, values: Sequence[int], global_batch_size: int) -> None:
    """Every K must divide the global batch (micro-batch = global / K); name the valid values."""
    valid = divisors(global_batch_size)
    bad = [k for k in values if k not in valid]
    if bad or not values:
        raise BenchError(
            f"{name} {', '.join(map(str, bad)) or '(none)'} must divide the global batch of {global_batch_size} "
            f"sequences (micro-batch = global / K); valid values: {', '.join(map(str, valid))}"
        )


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(repeats=options.repeats)
    require_divisors("accumulation steps", options.accumulation_steps, common.global_batch_size)


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


@dataclass
class SweepResult(SectionResult):
    global_batch_size: int
    min_length: int
    max_length: int
    updates: int
    repeats: int
    device: str
    model: str
    rows: list[SweepRow] = field(default_factory=list)

    def text(self) -> str:
        lines = [
            f"\nAccumulation trade-off: global batch {self.global_batch_size} sequences ({self.min_length}-"
            f"{self.max_length} tokens, random), {self.updates} updates per run, median of {self.repeats} "
            f"interleaved runs",
            f"tokens/s counts real (non-pad) tokens; memory: {MEMORY_MEANING[self.device]}",
            f"{'K':>3} {'micro':>5} {'tokens/s':>10} {'(min-max)':>17} {'peak memory':>13} {'saved activ.':>13} "
            f"{'pad':>6}",
        ]
        for r in self.rows:
            lines.append(
                f"{r.accumulation_steps:>3} {r.micro_batch:>5} {r.tokens_per_s:>10.0f} "
                f"{f'({r.tokens_per_s_min:.0f}-{r.tokens_per_s_max:.0f})':>17} {mib(r.peak_memory_bytes):>13} "
                f"{mib(r.peak_saved_activation_bytes):>13} {r.padding_fraction:>6.1%}"
            )
        return "\n".join(lines)

    def write(self, output_dir: Path) -> list[Path]:
        return [plot(self, output_dir / "accumulation_tradeoff.png")]


def measure(bench: Bench, options: Options) -> SweepResult:
    """Tokens/s and memory per K at a fixed global batch; runs of different K are interleaved."""
    common, work = bench.options, bench.workload
    examples = token_rows(work, common.global_batch_size * common.updates, common.seed, common.min_length,
                          common.max_length)
    tokens = real_tokens(examples)
    ks = list(options.accumulation_steps)
    micro = {k: common.global_batch_size // k for k in ks}
    for k in ks:  # warm-up (allocator, thread pools, lazy inits); not timed
        run_ours(work, examples[: common.global_batch_size], micro[k], k)
    seconds: dict[int, list[Timing]] = {k: [] for k in ks}
    with bench.progress(options.repeats * len(ks), "sweep runs") as bar:
        for rep in range(options.repeats):
            for k in ks[rep % len(ks):] + ks[: rep % len(ks)]:  # rotate the order: no fixed position per K
                seconds[k].append(run_ours(work, examples, micro[k], k))
                bar.update(1)
    # The same rows as the timed runs (the generator is prefix-stable), but always MEMORY_UPDATES updates.
    memory_rows = token_rows(work, common.global_batch_size * MEMORY_UPDATES, common.seed, common.min_length,
                             common.max_length)
    result = SweepResult(common.global_batch_size, common.min_length, common.max_length, common.updates,
                         options.repeats, common.device, work.description)
    with bench.progress(len(ks), "sweep memory") as bar:
        for k in ks:
            memory = training_memory(work, memory_rows, micro[k], k)
            rates = [tokens / t.wall for t in seconds[k]]
            result.rows.append(SweepRow(
                k, micro[k], statistics.median(rates), min(rates), max(rates), memory.peak_bytes,
                memory.peak_saved_bytes, padding_fraction(examples, micro[k]),
            ))
            bar.update(1)
    return result


def padding_fraction(examples: Sequence[dict], micro_batch: int) -> float:
    """Share of pad positions when rows are padded to the longest of their micro-batch."""
    total = 0
    for start in range(0, len(examples), micro_batch):
        chunk = examples[start:start + micro_batch]
        total += len(chunk) * max(len(e["input_ids"]) for e in chunk)
    return 1.0 - real_tokens(examples) / total


def plot(result: SweepResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    rows = result.rows
    ks = [r.accumulation_steps for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.errorbar(
        ks, [r.tokens_per_s for r in rows],
        yerr=[[r.tokens_per_s - r.tokens_per_s_min for r in rows], [r.tokens_per_s_max - r.tokens_per_s for r in rows]],
        marker="o", capsize=3,
    )
    left.set(title="Throughput (median, min-max)", xlabel="accumulation steps K", ylabel="real tokens / s")
    right.plot(ks, [r.peak_memory_bytes / MiB for r in rows], marker="o", label="peak tensor memory")
    right.plot(ks, [r.peak_saved_activation_bytes / MiB for r in rows], marker="s", label="peak saved activations")
    right.set(title="Memory", xlabel="accumulation steps K", ylabel="MiB")
    right.legend()
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Global batch {result.global_batch_size} = micro-batch x K; {result.model}; {result.device}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
