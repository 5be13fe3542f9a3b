"""Section ``noise_scale``: what tracking the gradient noise scale costs per update, in both modes.

Our loop without the noise scale, with ``LoopConfig(noise_scale=True)`` in the default mode (every micro-batch a
small batch) and in ``noise_scale_micro_batches="first"``, on the same model, data and micro-batches, in
interleaved rounds (the order rotates, so a drifting load favours none); the ratios are tracked / untracked time
per update, per round (target for the default ``every`` mode: <= 1.03). ``every`` adds a tensor hook per trainable
parameter (one norm kernel per parameter per micro-batch) and two float64 columns in the boundary's all-reduce;
``first`` one fused norm of the first micro-batch's gradient per update and two slots per rank; the big batch's
norm is the clip's in both.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
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
    noise_scale_repeats: int = HfArg(default=7, help="interleaved rounds (untracked, every, first in a rotating "
                                                     "order); the median of the per-round ratios is reported")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(noise_scale_repeats=options.noise_scale_repeats)
    require_divisors("noise_scale accumulation", [options.noise_scale_accumulation], common.global_batch_size)


@dataclass
class NoiseScaleResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("interval", "passed", "first_ratio")

    accumulation_steps: int
    micro_batch: int
    clock: str
    """Which time the verdict uses: 'cpu' (process CPU seconds; CPU device) or 'wall' (CUDA)."""
    ratio: float
    """Median over rounds of (every-micro-batch tracked time) / (untracked time), by ``clock``: the verdict's."""
    ratios: list[float]
    tracked_seconds_per_update: float
    """Every-micro-batch mode (the default), median wall seconds per update."""
    untracked_seconds_per_update: float
    noise_scale: float | None
    """The last update's measured noise scale (tokens, every-micro-batch mode), to show the tracking ran."""
    first_ratios: list[float] = field(default_factory=list)
    """Per round: (first-micro-batch tracked time) / (untracked time), by ``clock``."""
    first_seconds_per_update: float = 0.0
    first_noise_scale: float | None = None

    @property
    def interval(self) -> tuple[float, float]:
        return median_interval(self.ratios)

    @property
    def first_ratio(self) -> float:
        return statistics.median(self.first_ratios) if self.first_ratios else float("nan")

    @property
    def passed(self) -> bool | None:
        return judge(self.interval, TARGET, at_least=False)

    def text(self) -> str:
        first_low, first_high = median_interval(self.first_ratios) if self.first_ratios else (math.nan, math.nan)
        return (
            f"\nNoise-scale tracking (K={self.accumulation_steps}, micro-batch {self.micro_batch}): median "
            f"{self.tracked_seconds_per_update * 1e3:.1f} ms/update every micro-batch, "
            f"{self.first_seconds_per_update * 1e3:.1f} first micro-batch, "
            f"{self.untracked_seconds_per_update * 1e3:.1f} untracked\n"
            f"  every/untracked by {self.clock} time: median {self.ratio:.3f} (~95% interval "
            f"{self.interval[0]:.3f}-{self.interval[1]:.3f}); per round {', '.join(f'{r:.3f}' for r in self.ratios)}\n"
            f"  first/untracked: median {self.first_ratio:.3f} ({first_low:.3f}-{first_high:.3f}); per round "
            f"{', '.join(f'{r:.3f}' for r in self.first_ratios)}"
        )

    def summary(self) -> list[dict]:
        low, high = self.interval
        return [summary_row(
            f"noise-scale tracking (every micro-batch): time per update tracked / untracked "
            f"(K={self.accumulation_steps})",
            f"{self.ratio:.3f} by {self.clock} time (median of {len(self.ratios)} rounds, ~95% interval "
            f"{low:.3f}-{high:.3f})", f"<= {TARGET:.2f}", verdict(self.passed, "INCONCLUSIVE"),
        )]


MODES = ("off", "every", "first")
"""Untracked, and the two noise-scale modes (``LoopConfig.noise_scale_micro_batches``)."""


def run_loop(work: Workload, examples: list, micro_batch: int, accumulation: int, mode: str):
    """Time of :func:`hf_accum.loop.train` over ``examples``, untracked (``off``) or in a noise-scale mode."""
    from hf_accum.loop import train

    scenario = bench_scenario("noise", work.reset, examples, PaddingCollator(work.pad_token_id), micro_batch,
                              accumulation)
    scenario.loop_kwargs = {"noise_scale": False} if mode == "off" else {"noise_scale": True,
                                                                         "noise_scale_micro_batches": mode}
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
    for mode in MODES:  # warm-up, not timed
        run_loop(work, examples, micro, k, mode)
    timings: dict[str, list[Timing]] = {mode: [] for mode in MODES}
    last: dict[str, float | None] = {}
    with bench.progress(options.noise_scale_repeats, "noise_scale rounds") as bar:
        for rep in range(options.noise_scale_repeats):
            shift = rep % len(MODES)  # rotate the order: a load drift favours no mode
            for mode in MODES[shift:] + MODES[:shift]:
                timing, result = run_loop(work, examples, micro, k, mode)
                timings[mode].append(timing)
                last[mode] = result.updates[-1].noise_scale
            bar.update(1)

    def ratios(mode: str) -> list[float]:
        return [t.on(bench.clock) / p.on(bench.clock) for t, p in zip(timings[mode], timings["off"])]

    def per_update(mode: str) -> float:
        return statistics.median(t.wall for t in timings[mode]) / common.updates

    every = ratios("every")
    return NoiseScaleResult(
        k, micro, bench.clock, statistics.median(every), every, per_update("every"), per_update("off"),
        last["every"], first_ratios=ratios("first"), first_seconds_per_update=per_update("first"),
        first_noise_scale=last["first"],
    )
