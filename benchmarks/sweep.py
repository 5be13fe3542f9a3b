"""Section ``sweep``: the accumulation trade-off, shown so that it cannot mislead.

A fixed global batch is split into ``K`` micro-batches of ``global / K`` sequences, for each ``K``: the
micro-batch size, the padding fraction, real (non-pad) tokens/s of :func:`hf_accum.train` as a percentage of
K=1 (per-round ratios), peak memory as a multiple of K=1, and the fixed part of that memory (parameters,
gradients, optimizer state) apart from the activations. Twice: on variable-length rows (padded per
micro-batch: smaller micro-batches pad less, which alone can raise tokens/s with K) and on equal-length rows
(no padding at any K: what accumulation itself costs). Each K's MFU: the model FLOPs of its run
(:func:`benchmarks.harness.batch_flops`, padding not counted) over its median wall time and the device's peak.
Table, PNG with the conclusion in its title, JSON.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Sequence

from transformers.hf_argparser import HfArg

from benchmarks.harness import (
    MEMORY_UPDATES, Bench, Timing, batch_flops, device_peak, mfu, padded_loader, real_tokens, run_ours, token_rows,
    training_memory,
)
from benchmarks.report import MEMORY_MEANING, MiB, BenchError, SectionResult, mfu_meaning, mib, percent, require_positive

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions


@dataclass
class Options:
    _argument_group_name = "sweep section"

    accumulation_steps: list[int] = HfArg(default_factory=lambda: [1, 2, 4, 8, 16],
                                          help="K values to sweep; each must divide --global-batch-size")
    repeats: int = HfArg(default=3, help="sweep rounds: each K runs once per round, the order rotated; medians and "
                                         "min-max over rounds are reported")
    equal_length_sweep: bool = HfArg(
        default=True, help="also sweep on rows of one length (the mean of --min-length and --max-length): no padding "
                           "at any K, so the cost of accumulation itself shows (--no-equal-length-sweep: skip it)")


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
    """Real tokens per second of process CPU time (CPU device) or wall time (CUDA), median over rounds."""
    tokens_per_s_min: float
    tokens_per_s_max: float
    peak_memory_bytes: int
    peak_saved_activation_bytes: int
    padding_fraction: float
    relative_tokens_per_s: list[float]
    """Per round: this K's real tokens/s / the reference K's (the smallest K, normally 1) in the same round."""
    fixed_bytes: int
    """Parameters + gradients + AdamW state: what every K keeps (see :func:`fixed_bytes`)."""
    reference_peak_bytes: int
    """The reference K's peak memory."""
    flops: float = 0.0
    """Model FLOPs of one run (:func:`benchmarks.harness.batch_flops`): the same at every K on these rows, as
    padding is not counted."""
    mfu: float | None = None
    """Model FLOPs utilization at the median wall time over rounds, against the section's ``peak`` (None: no peak
    known)."""

    tokens_per_s_percent: float = field(init=False)
    """Real tokens/s as a percentage of the reference K's, median over rounds."""
    tokens_per_s_percent_range: tuple[float, float] = field(init=False)
    memory_multiple: float = field(init=False)
    """Peak memory as a multiple of the reference K's."""
    activation_bytes: int = field(init=False)
    """The rest of the peak: activations, the batch, logits and other temporaries (what K shrinks)."""

    def __post_init__(self) -> None:
        self.tokens_per_s_percent = 100 * statistics.median(self.relative_tokens_per_s)
        self.tokens_per_s_percent_range = (100 * min(self.relative_tokens_per_s), 100 * max(self.relative_tokens_per_s))
        self.memory_multiple = self.peak_memory_bytes / self.reference_peak_bytes
        self.activation_bytes = max(0, self.peak_memory_bytes - self.fixed_bytes)


@dataclass
class Sweep:
    """One sweep over K at a fixed global batch, on one kind of rows."""

    rows_kind: str
    """'variable' (uniformly random lengths, padded per micro-batch) or 'equal' (every row the same length)."""
    min_length: int
    max_length: int
    rows: list[SweepRow] = field(default_factory=list)
    peak: str = ""
    """The peak FLOP/s the MFU column is measured against, and where it came from."""

    @property
    def reference(self) -> int:
        return self.rows[0].accumulation_steps

    @property
    def title(self) -> str:
        if self.rows_kind == "equal":
            return f"equal-length rows ({self.max_length} tokens each: no padding at any K)"
        return f"variable-length rows ({self.min_length}-{self.max_length} tokens, padded per micro-batch)"

    def table(self) -> list[str]:
        ref = self.reference
        lines = [
            f"  {self.title}:",
            f"  {'K':>3} {'micro':>5} {'pad':>6} {'tokens/s':>10} {'(min-max)':>15} {f'% of K={ref}':>9} "
            f"{'(min-max)':>13} {'peak memory':>13} {f'x K={ref}':>7} {'fixed part':>12} {'activations':>13} "
            f"{'saved activ.':>13} {'MFU':>6}",
        ]
        for r in self.rows:
            low, high = r.tokens_per_s_percent_range
            lines.append(
                f"  {r.accumulation_steps:>3} {r.micro_batch:>5} {r.padding_fraction:>6.1%} {r.tokens_per_s:>10.0f} "
                f"{f'({r.tokens_per_s_min:.0f}-{r.tokens_per_s_max:.0f})':>15} {r.tokens_per_s_percent:>8.0f}% "
                f"{f'({low:.0f}-{high:.0f}%)':>13} {mib(r.peak_memory_bytes):>13} {r.memory_multiple:>6.2f}x "
                f"{mib(r.fixed_bytes):>12} {mib(r.activation_bytes):>13} {mib(r.peak_saved_activation_bytes):>13} {percent(r.mfu):>6}"
            )
        lines.append(f"  {mfu_meaning([self.peak])}")
        return lines


@dataclass
class SweepResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("conclusion",)

    global_batch_size: int
    min_length: int
    max_length: int
    updates: int
    repeats: int
    device: str
    model: str
    clock: str = "wall"
    """The time tokens/s are counted in: 'cpu' (process CPU seconds: the work done, not the time other jobs held
    the cores; CPU device) or 'wall' (CUDA)."""
    rows: list[SweepRow] = field(default_factory=list)
    """The sweep on variable-length rows (the data as it comes)."""
    equal_length: Sweep | None = None
    """The same sweep on rows of one length: no padding at any K, so only accumulation differs."""
    peak: str = ""
    """The peak FLOP/s MFU is measured against, and where it came from."""

    @property
    def variable(self) -> Sweep:
        return Sweep("variable", self.min_length, self.max_length, self.rows, self.peak)

    @property
    def conclusion(self) -> list[str]:
        return conclusion(self)

    def text(self) -> str:
        lines = [
            f"\nAccumulation trade-off: global batch {self.global_batch_size} sequences = micro-batch x K, "
            f"{self.updates} updates per run, median of {self.repeats} rounds (K order rotated per round)",
            f"tokens/s counts real (non-pad) tokens per second of {self.clock} time; % of K=1: per-round ratio to "
            f"K=1's run of the same round; "
            f"memory: {MEMORY_MEANING[self.device]}",
            "fixed part = parameters + gradients (fp32) + AdamW state (2 per trainable parameter): kept at every K; "
            "activations = peak - fixed part (activations, batch, logits, temporaries)",
            *self.variable.table(),
            *(self.equal_length.table() if self.equal_length else []),
            *(f"  => {line}" for line in self.conclusion),
        ]
        return "\n".join(lines)

    def write(self, output_dir: Path) -> list[Path]:
        return [plot(self, output_dir / "accumulation_tradeoff.png")]


def fixed_bytes(model) -> int:
    """Bytes every K keeps: the parameters, one gradient per trainable parameter (the loop accumulates in
    fp32) and AdamW's two moments (the parameter's dtype)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    gradients = sum(p.numel() * 4 for p in trainable)
    moments = sum(2 * p.numel() * p.element_size() for p in trainable)
    return params + gradients + moments


def measure(bench: Bench, options: Options) -> SweepResult:
    """The sweep on variable-length rows, then (unless turned off) on equal-length rows."""
    common, work = bench.options, bench.workload
    result = SweepResult(common.global_batch_size, common.min_length, common.max_length, common.updates,
                         options.repeats, common.device, work.description, bench.clock)
    peak = device_peak(work.device, work.model)
    result.peak = peak.describe()
    result.rows = sweep_rows(bench, options, common.min_length, common.max_length, "sweep", peak.flops)
    if options.equal_length_sweep:
        # The rows' mean length, so both sweeps move about as many real tokens per update.
        length = (common.min_length + common.max_length) // 2
        result.equal_length = Sweep("equal", length, length,
                                    sweep_rows(bench, options, length, length, "sweep (equal lengths)", peak.flops),
                                    result.peak)
    return result


def sweep_rows(bench: Bench, options: Options, min_length: int, max_length: int, label: str,
               peak_flops: float | None) -> list[SweepRow]:
    """Tokens/s, memory and MFU (against ``peak_flops``) per K at a fixed global batch; in every round each K
    runs once, the order rotated."""
    common, work = bench.options, bench.workload
    examples = token_rows(work, common.global_batch_size * common.updates, common.seed, min_length, max_length)
    tokens = real_tokens(examples)
    ks = list(options.accumulation_steps)
    micro = {k: common.global_batch_size // k for k in ks}
    for k in ks:  # warm-up (allocator, thread pools, lazy inits); not timed
        run_ours(work, examples[: common.global_batch_size], micro[k], k)
    seconds: dict[int, list[Timing]] = {k: [] for k in ks}
    with bench.progress(options.repeats * len(ks), f"{label} runs") as bar:
        for rep in range(options.repeats):
            for k in ks[rep % len(ks):] + ks[: rep % len(ks)]:  # rotate the order: no fixed position per K
                seconds[k].append(run_ours(work, examples, micro[k], k))
                bar.update(1)
    # The same rows as the timed runs (the generator is prefix-stable), but always MEMORY_UPDATES updates.
    memory_rows = token_rows(work, common.global_batch_size * MEMORY_UPDATES, common.seed, min_length, max_length)
    memory = {}
    with bench.progress(len(ks), f"{label} memory") as bar:
        for k in ks:
            memory[k] = training_memory(work, memory_rows, micro[k], k)
            bar.update(1)
    reference = min(ks)
    fixed = fixed_bytes(work.model)
    rows = []
    for k in sorted(ks):
        rates = [tokens / t.on(bench.clock) for t in seconds[k]]
        # Same tokens at every K: the tokens/s ratio is the inverse time ratio, taken within a round.
        relative = [a.on(bench.clock) / b.on(bench.clock) for a, b in zip(seconds[reference], seconds[k])]
        flops = batch_flops(work.model, padded_loader(examples, micro[k], work.pad_token_id))
        wall = statistics.median(t.wall for t in seconds[k])
        rows.append(SweepRow(
            k, micro[k], statistics.median(rates), min(rates), max(rates), memory[k].peak_bytes,
            memory[k].peak_saved_bytes, padding_fraction(examples, micro[k]), relative, fixed,
            memory[reference].peak_bytes, flops, mfu(flops, wall, peak_flops),
        ))
    return rows


def padding_fraction(examples: Sequence[dict], micro_batch: int) -> float:
    """Share of pad positions when rows are padded to the longest of their micro-batch."""
    total = 0
    for start in range(0, len(examples), micro_batch):
        chunk = examples[start:start + micro_batch]
        total += len(chunk) * max(len(e["input_ids"]) for e in chunk)
    return 1.0 - real_tokens(examples) / total


# ----------------------------------------------------------------------------------------------
# What the numbers say, in words (printed, and the plot's title)
# ----------------------------------------------------------------------------------------------

NOISE = 0.03
"""Relative changes of tokens/s within this are called "no measurable change" (shared machines)."""


def _change(percent: float) -> str:
    if abs(percent - 100) <= 100 * NOISE:
        return f"about the same tokens/s ({percent:.0f}%)"
    return f"{percent:.0f}% of the tokens/s"


def conclusion(result: SweepResult) -> list[str]:
    """Two or three sentences stating what the sweep shows, from its own numbers."""
    var = result.variable.rows
    first, last = var[0], var[-1]
    k1, kn = first.accumulation_steps, last.accumulation_steps
    saved = 1 - last.activation_bytes / first.activation_bytes if first.activation_bytes else 0.0
    lines = [
        f"Accumulation saves activation memory only: K={kn} needs {last.memory_multiple:.2f}x the peak memory of "
        f"K={k1} (activations -{saved:.0%}); the fixed part ({mib(first.fixed_bytes)}: parameters, gradients, "
        f"optimizer state) is the same at every K."
    ]
    if result.equal_length is not None:
        eq = result.equal_length.rows[-1]
        lines.append(f"At equal padding (equal-length rows), K={kn} runs at {_change(eq.tokens_per_s_percent)} of "
                     f"K={k1}: that is the cost of accumulation itself (smaller micro-batches).")
        if last.tokens_per_s_percent - eq.tokens_per_s_percent > 100 * NOISE:
            lines.append(f"With variable-length rows, K={kn} reaches {last.tokens_per_s_percent:.0f}% because its "
                         f"smaller micro-batches pad less ({first.padding_fraction:.0%} -> "
                         f"{last.padding_fraction:.0%} pad), not because accumulation is faster.")
    elif last.padding_fraction < first.padding_fraction:
        lines.append(f"Tokens/s at K={kn}: {last.tokens_per_s_percent:.0f}% of K={k1}, with less padding "
                     f"({first.padding_fraction:.0%} -> {last.padding_fraction:.0%}): run the equal-length sweep to "
                     f"separate the cost of accumulation from the padding saved.")
    return lines


# ----------------------------------------------------------------------------------------------
# The plot
# ----------------------------------------------------------------------------------------------


PANEL_NOTES = {
    "variable": "tokens/s mix two effects: less padding at small micro-batches (helps), accumulation (costs)",
    "equal": "same padding at every K: the cost of accumulation itself",
}


def _tick_labels(sweep: Sweep) -> list[str]:
    return [f"K={r.accumulation_steps}\nmicro {r.micro_batch}\npad {r.padding_fraction:.0%}" for r in sweep.rows]


def _throughput_panel(ax, sweep: Sweep, color: str) -> None:
    rows = sweep.rows
    x = range(len(rows))
    percent = [r.tokens_per_s_percent for r in rows]
    low = [p - r.tokens_per_s_percent_range[0] for p, r in zip(percent, rows)]
    high = [r.tokens_per_s_percent_range[1] - p for p, r in zip(percent, rows)]
    ax.bar(x, percent, color=color, alpha=0.75, yerr=[low, high], capsize=3)
    ax.axhline(100, color="black", linewidth=0.8)
    for i, p in zip(x, percent):  # at the bar's foot: clear of the error bar and the 100% line
        ax.text(i, 4, f"{p:.0f}%", ha="center", va="bottom", fontsize=9, color="white", fontweight="bold")
    ax.set_ylabel(f"real tokens/s, % of K={sweep.reference}\n(median, min-max over rounds)")


def _memory_panel(ax, sweep: Sweep) -> None:
    rows = sweep.rows
    x = range(len(rows))
    fixed = [r.fixed_bytes / MiB for r in rows]
    rest = [r.activation_bytes / MiB for r in rows]
    ax.bar(x, fixed, color="0.65", hatch="//", edgecolor="0.4",
           label="fixed: parameters + gradients + optimizer state")
    ax.bar(x, rest, bottom=fixed, color="tab:orange", label="activations, batch, logits, temporaries")
    for i, (f, a, r) in enumerate(zip(fixed, rest, rows)):
        ax.annotate(f"{r.memory_multiple:.2f}x", (i, f + a), textcoords="offset points", xytext=(0, 3),
                    ha="center", fontsize=8)
    ax.set_ylabel(f"peak memory, MiB\n(label: multiple of K={sweep.reference})")
    ax.legend(fontsize=7, loc="upper right")


def plot(result: SweepResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import textwrap

    import matplotlib.pyplot as plt

    sweeps = [result.variable] + ([result.equal_length] if result.equal_length else [])
    # One y scale per row: the two sweeps' bars compare by height.
    fig, axes = plt.subplots(2, len(sweeps), figsize=(6.2 * len(sweeps), 8.6), squeeze=False, sharey="row")
    for column, (sweep, color) in enumerate(zip(sweeps, ("tab:blue", "tab:green"))):
        top, bottom = axes[0][column], axes[1][column]
        _throughput_panel(top, sweep, color)
        _memory_panel(bottom, sweep)
        top.set_title(textwrap.fill(sweep.title, 64) + "\n" + PANEL_NOTES[sweep.rows_kind], fontsize=9)
        for ax in (top, bottom):
            ax.set_xticks(range(len(sweep.rows)), _tick_labels(sweep), fontsize=7)
            ax.grid(axis="y", alpha=0.3)
    top_percent = max(r.tokens_per_s_percent_range[1] for sweep in sweeps for r in sweep.rows)
    axes[0][0].set_ylim(0, max(125, top_percent * 1.1))
    top_memory = max(r.peak_memory_bytes for sweep in sweeps for r in sweep.rows) / MiB
    axes[1][0].set_ylim(0, top_memory * 1.3)  # room for the legend above the tallest bar
    lines = [wrapped for line in result.conclusion for wrapped in textwrap.wrap(line, 80 * len(sweeps))]
    # fig.text, not suptitle: tight_layout would reserve the suptitle's room a second time.
    fig.text(0.01, 0.995, "\n".join(lines), fontsize=9.5, ha="left", va="top")
    fig.text(0.01, 0.005, f"global batch {result.global_batch_size} = micro-batch x K; {result.model}; "
                          f"{result.device}", fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 0.985 - 0.022 * len(lines)))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
