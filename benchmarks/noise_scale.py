"""Section ``noise_scale``: what tracking the gradient noise scale costs per update.

Our loop with ``LoopConfig(noise_scale=True)`` against the same loop without it, on the same model, data and
micro-batches, in interleaved pairs; the ratio is tracked / untracked time per update (target: <= 1.03). The
tracking adds one fused norm of the first micro-batch's gradient per update and two slots in the boundary's
all-reduce; the big batch's norm is the clip's.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from transformers.hf_argparser import HfArg

from benchmarks.harness import (
    Bench, Timing, Workload, bench_scenario, loop_config, prepare_loop, timed, token_rows,
)
from benchmarks.report import SectionResult, judge, median_interval, require_positive, summary_row, verdict
from benchmarks.sweep import require_divisors
from hf_accum.batching import PaddingCollator

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

TARGET = 1.03  # tracked / untracked time per update: "noise-scale tracking costs <= 3%"


@dataclass
class Options:
    _argument_group_name = "noise_scale section"

    noise_scale_accumulation: int = HfArg(default=4, help="K of the tracked-vs-untracked comparison (must divide "
                                                          "--global-batch-size)")
    noise_scale_repeats: int = HfArg(default=7, help="interleaved (untracked, tracked) pairs; the median of the "
                                                     "per-pair ratios is reported")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(noise_scale_repeats=options.noise_scale_repeats)
    require_divisors("noise_scale accumulation", [options.noise_scale_accumulation], common.global_batch_size)


@dataclass
class NoiseScaleResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("interval", "passed")

    accumulation_steps: int
    micro_batch: int
    clock: str
    """Which time the verdict uses: 'cpu' (process CPU seconds; CPU device) or 'wall' (CUDA)."""
    ratio: float
    """Median over pairs of (tracked time) / (untracked time), by ``clock``."""
    ratios: list[float]
    tracked_seconds_per_update: float
    untracked_seconds_per_update: float
    noise_scale: float | None
    """The last update's measured noise scale (tokens), to show the tracking ran."""

    @property
    def interval(self) -> tuple[float, float]:
        return median_interval(self.ratios)

    @property
    def passed(self) -> bool | None:
        return judge(self.interval, TARGET, at_least=False)

    def text(self) -> str:
        return (
            f"\nNoise-scale tracking (K={self.accumulation_steps}, micro-batch {self.micro_batch}): median "
            f"{self.tracked_seconds_per_update * 1e3:.1f} ms/update tracked, "
            f"{self.untracked_seconds_per_update * 1e3:.1f} ms/update untracked\n"
            f"  tracked/untracked by {self.clock} time: median {self.ratio:.3f} (~95% interval "
            f"{self.interval[0]:.3f}-{self.interval[1]:.3f}); per pair {', '.join(f'{r:.3f}' for r in self.ratios)}"
        )

    def summary(self) -> list[dict]:
        low, high = self.interval
        return [summary_row(
            f"noise-scale tracking: time per update tracked / untracked (K={self.accumulation_steps})",
            f"{self.ratio:.3f} by {self.clock} time (median of {len(self.ratios)} pairs, ~95% interval "
            f"{low:.3f}-{high:.3f})", f"<= {TARGET:.2f}", verdict(self.passed, "INCONCLUSIVE"),
        )]


def run_loop(work: Workload, examples: list, micro_batch: int, accumulation: int, noise_scale: bool):
    """Time of :func:`hf_accum.loop.train` over ``examples``, with or without the noise scale."""
    from hf_accum.loop import train

    scenario = bench_scenario("noise", work.reset, examples, PaddingCollator(work.pad_token_id), micro_batch,
                              accumulation)
    scenario.loop_kwargs = {"noise_scale": noise_scale}
    model, optimizer, loader, accelerator = prepare_loop(scenario, work.device)
    with timed(work.device) as timing:
        result = train(model, optimizer, loader, accelerator, loop_config(scenario))
    return timing, result


def measure(bench: Bench, options: Options) -> NoiseScaleResult:
    common, work = bench.options, bench.workload
    k = options.noise_scale_accumulation
    micro = common.global_batch_size // k
    examples = token_rows(work, common.global_batch_size * common.updates, common.seed + 2, common.min_length,
                          common.max_length)
    run_loop(work, examples, micro, k, False), run_loop(work, examples, micro, k, True)  # warm-up, not timed
    plain: list[Timing] = []
    tracked: list[Timing] = []
    last = None
    with bench.progress(options.noise_scale_repeats, "noise_scale pairs") as bar:
        for rep in range(options.noise_scale_repeats):
            order = (False, True) if rep % 2 == 0 else (True, False)  # a load drift favours neither side
            for noise in order:
                timing, result = run_loop(work, examples, micro, k, noise)
                (tracked if noise else plain).append(timing)
                if noise:
                    last = result.updates[-1].noise_scale
            bar.update(1)
    ratios = [t.on(bench.clock) / p.on(bench.clock) for t, p in zip(tracked, plain)]
    updates = common.updates
    return NoiseScaleResult(
        k, micro, bench.clock, statistics.median(ratios), ratios,
        statistics.median(t.wall for t in tracked) / updates, statistics.median(p.wall for p in plain) / updates,
        last,
    )
