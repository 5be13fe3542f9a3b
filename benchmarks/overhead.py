"""Section ``overhead``: hf_accum's loop vs a bare PyTorch accumulation loop.

Both loops (``loss / K``; backward; clip and step every K for the bare one) run on the same model,
data and micro-batches, in interleaved pairs; the ratio is ours / bare tokens/s (target: >= 0.98).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from transformers.hf_argparser import HfArg

from benchmarks.harness import (
    PER_UPDATE_SETTINGS, Bench, Timing, Workload, batch_flops, device_peak, mfu, padded_loader, real_tokens, run_ours,
    timed, token_rows,
)
from benchmarks.report import SectionResult, judge, median_interval, percent, require_positive, summary_row, verdict
from benchmarks.sweep import require_divisors

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

TARGET = 0.98  # ours / bare tokens/s: "within 2% of a bare PyTorch loop"


@dataclass
class Options:
    _argument_group_name = "overhead section"

    overhead_accumulation: int = HfArg(default=4, help="K of the ours-vs-bare comparison (must divide "
                                                       "--global-batch-size)")
    overhead_repeats: int = HfArg(default=7, help="interleaved (bare, ours) pairs; the median of the per-pair "
                                                  "ratios is reported")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(overhead_repeats=options.overhead_repeats)
    require_divisors("overhead accumulation", [options.overhead_accumulation], common.global_batch_size)


@dataclass
class OverheadResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("interval", "passed")

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
    ours_mfu: float | None = None
    bare_mfu: float | None = None
    """Model FLOPs utilization of each loop at its median wall time (:mod:`hf_accum.measure.utilization`: the same model
    FLOPs on both sides) against ``peak``."""
    peak: str = ""
    """The peak FLOP/s MFU is measured against, and where it came from."""

    @property
    def interval(self) -> tuple[float, float]:
        return median_interval(self.ratios)

    @property
    def passed(self) -> bool | None:
        return judge(self.interval, TARGET)

    def text(self) -> str:
        return (
            f"\nOverhead vs bare PyTorch (K={self.accumulation_steps}, micro-batch {self.micro_batch}): median "
            f"wall-clock ours {self.ours_tokens_per_s:.0f} tokens/s, bare {self.bare_tokens_per_s:.0f} tokens/s\n"
            f"  ours/bare by {self.clock} time: median {self.ratio:.3f} (~95% interval {self.interval[0]:.3f}-"
            f"{self.interval[1]:.3f}); per pair {', '.join(f'{r:.3f}' for r in self.ratios)}\n"
            f"  ours/bare by wall time: median {self.wall_ratio:.3f}\n"
            f"  MFU (wall time): ours {percent(self.ours_mfu)}, bare {percent(self.bare_mfu)} ({self.peak})"
        )

    def summary(self) -> list[dict]:
        low, high = self.interval
        return [summary_row(
            f"loop overhead: ours / bare tokens/s (K={self.accumulation_steps}, micro-batch {self.micro_batch})",
            f"{self.ratio:.3f} by {self.clock} time (median of {len(self.ratios)} pairs, ~95% interval "
            f"{low:.3f}-{high:.3f}; wall {self.wall_ratio:.3f}; MFU ours {percent(self.ours_mfu)}, bare "
            f"{percent(self.bare_mfu)})",
            f">= {TARGET:.2f}", verdict(self.passed, "INCONCLUSIVE"),
        )]


def run_bare(work: Workload, examples: list, micro_batch: int, accumulation: int) -> Timing:
    """Time of the classic bare PyTorch loop: ``loss / K``, backward, clip + step every K.

    It does what ours does per update (clip, AdamW, linear LR schedule, grads set to None) so that
    the ratio isolates the cost of exact accumulation, not of features.
    """
    from transformers import get_scheduler

    model = work.reset()
    optimizer = torch.optim.AdamW(model.parameters(), lr=PER_UPDATE_SETTINGS["lr"])
    loader = padded_loader(examples, micro_batch, work.pad_token_id)
    scheduler = get_scheduler(PER_UPDATE_SETTINGS["scheduler"], optimizer, 0, math.ceil(len(loader) / accumulation))
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    with timed(work.device) as timing:
        for step, batch in enumerate(loader, start=1):
            batch = {k: v.to(work.device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch, use_cache=False).loss / accumulation
            loss.backward()
            if step % accumulation == 0 or step == len(loader):
                torch.nn.utils.clip_grad_norm_(params, PER_UPDATE_SETTINGS["max_grad_norm"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
    return timing


def measure(bench: Bench, options: Options) -> OverheadResult:
    common, work = bench.options, bench.workload
    k = options.overhead_accumulation
    micro = common.global_batch_size // k
    examples = token_rows(work, common.global_batch_size * common.updates, common.seed + 1, common.min_length,
                          common.max_length)
    tokens = real_tokens(examples)
    run_bare(work, examples, micro, k), run_ours(work, examples, micro, k)  # warm-up, not timed
    ours, bare = [], []
    with bench.progress(options.overhead_repeats, "overhead pairs") as bar:
        for rep in range(options.overhead_repeats):
            # Alternate which loop goes first, so a drift in machine load does not favour one side.
            if rep % 2 == 0:
                bare.append(run_bare(work, examples, micro, k))
                ours.append(run_ours(work, examples, micro, k))
            else:
                ours.append(run_ours(work, examples, micro, k))
                bare.append(run_bare(work, examples, micro, k))
            bar.update(1)
    # Equal tokens on both sides: the tokens/s ratio is the inverse ratio of times.
    ratios = [b.on(bench.clock) / o.on(bench.clock) for o, b in zip(ours, bare)]
    wall_ratios = [b.wall / o.wall for o, b in zip(ours, bare)]
    flops = batch_flops(work.model, padded_loader(examples, micro, work.pad_token_id))
    peak = device_peak(work.device, work.model)
    ours_wall, bare_wall = statistics.median(o.wall for o in ours), statistics.median(b.wall for b in bare)
    return OverheadResult(
        k, micro, bench.clock, statistics.median(ratios), ratios, statistics.median(wall_ratios),
        tokens / ours_wall, tokens / bare_wall, mfu(flops, ours_wall, peak.flops), mfu(flops, bare_wall, peak.flops),
        peak.describe(),
    )
