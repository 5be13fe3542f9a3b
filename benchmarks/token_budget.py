"""Section ``token_budget``: updates of a fixed K against updates closed at a token budget
(``LoopConfig(tokens_per_update=N)``), on long-tailed SFT-like rows, both through :func:`hf_accum.loop.train`.

Same model, data, order and micro-batch; the budget ``N`` is the mean targets of a fixed-K update, so both
variants take about the same number of updates. Reported side by side: real (non-pad) tokens/s of the whole
``train()`` (the budget's counting pass included) and the spread of targets per update (min / median / max and
the coefficient of variation). No target: this section shows a trade-off (steadier updates for a counting pass).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from transformers.hf_argparser import HfArg

from benchmarks.harness import Bench, Timing, Workload, bench_scenario, prepare_loop, timed
from benchmarks.report import SectionResult, require_positive
from hf_accum.batching import PaddingCollator
from hf_accum.testing import loop_config

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

VARIANTS = ("fixed_k", "token_budget")


@dataclass
class Options:
    _argument_group_name = "token_budget section"

    token_budget_micro_batch: int = HfArg(default=4, help="sequences per micro-batch")
    token_budget_accumulation: int = HfArg(default=4, help="K of the fixed-K variant (the budget matches its mean)")
    token_budget_rows: int = HfArg(default=256, help="long-tailed rows in the epoch")
    token_budget_repeats: int = HfArg(default=3, help="interleaved (fixed K, budget) pairs; medians are reported")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(
        token_budget_micro_batch=options.token_budget_micro_batch,
        token_budget_accumulation=options.token_budget_accumulation, token_budget_rows=options.token_budget_rows,
        token_budget_repeats=options.token_budget_repeats,
    )


@dataclass
class Spread:
    """Targets per update of one variant."""

    updates: int
    minimum: int
    median: float
    maximum: int
    cv: float
    """Coefficient of variation (population standard deviation / mean)."""

    @classmethod
    def of(cls, targets: list[int]) -> Spread:
        mean = statistics.fmean(targets)
        return cls(len(targets), min(targets), statistics.median(targets), max(targets),
                   statistics.pstdev(targets) / mean if mean else 0.0)


@dataclass
class TokenBudgetResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ()

    micro_batch: int
    accumulation_steps: int
    budget: int
    rows: int
    real_tokens: int
    clock: str
    tokens_per_s: dict[str, float]
    """Median real tokens/s of each variant by ``clock`` time."""
    ratios: list[float]
    """Per pair: token budget / fixed K real tokens/s."""
    spread: dict[str, Spread]

    def text(self) -> str:
        lines = [
            f"\nToken budget: {self.rows} long-tailed rows (prompt masked), micro-batch {self.micro_batch}; fixed "
            f"K={self.accumulation_steps} vs tokens_per_update={self.budget} (the fixed-K mean), {self.real_tokens} "
            "real tokens per epoch",
            f"  {'variant':<14} {'updates':>7} {'targets/update min':>19} {'median':>7} {'max':>6} {'CV':>6} "
            f"{'real tokens/s':>14}",
        ]
        for name in VARIANTS:
            s = self.spread[name]
            lines.append(f"  {name:<14} {s.updates:>7} {s.minimum:>19} {s.median:>7.0f} {s.maximum:>6} "
                         f"{s.cv:>6.3f} {self.tokens_per_s[name]:>14.0f}")
        lines.append(f"  budget / fixed K real tokens/s per pair ({self.clock}): "
                     f"{', '.join(f'{r:.3f}' for r in self.ratios)}")
        return "\n".join(lines)


def long_tailed_rows(work: Workload, n: int, seed: int, min_length: int, max_length: int) -> list[dict]:
    """Rows whose length is log-normal (most short, a few long: SFT's shape), prompt masked at a random split."""
    rng = random.Random(seed)
    mu = math.log(max(min_length, 1) * 2)
    rows = []
    for _ in range(n):
        length = int(min(max_length, max(min_length, rng.lognormvariate(mu, 0.9))))
        ids = [rng.randrange(1, work.vocab_size) for _ in range(length)]
        ids = [t if t != work.pad_token_id else 1 for t in ids]
        rows.append({"input_ids": ids, "prompt_length": rng.randrange(1, length)})
    return rows


def run_variant(work: Workload, examples: list, micro_batch: int, accumulation: int,
                budget: int | None) -> tuple[Timing, list[int]]:
    """One epoch through :func:`hf_accum.loop.train`; its time and the targets of every update."""
    from hf_accum.loop import train

    scenario = bench_scenario("token_budget", work.reset, examples, PaddingCollator(work.pad_token_id),
                              micro_batch, 1 if budget else accumulation)
    model, optimizer, loader, accelerator = prepare_loop(scenario, work.device)
    config = loop_config(scenario)
    config.tokens_per_update = budget
    with timed(work.device) as timing:
        result = train(model, optimizer, loader, accelerator, config.validate())
    return timing, [u.targets for u in result.updates]


def measure(bench: Bench, options: Options) -> TokenBudgetResult:
    common, work = bench.options, bench.workload
    b, k = options.token_budget_micro_batch, options.token_budget_accumulation
    examples = long_tailed_rows(work, options.token_budget_rows, common.seed + 5, common.min_length,
                                common.max_length)
    _, fixed_targets = run_variant(work, examples, b, k, None)  # warm-up, and the budget
    budget = max(1, round(statistics.fmean(fixed_targets)))
    timings: dict[str, list[Timing]] = {name: [] for name in VARIANTS}
    targets: dict[str, list[int]] = {}
    with bench.progress(options.token_budget_repeats, "token budget pairs") as bar:
        for rep in range(options.token_budget_repeats):
            for name in VARIANTS[rep % 2:] + VARIANTS[: rep % 2]:  # alternate which variant goes first
                timing, targets[name] = run_variant(work, examples, b, k, budget if name == "token_budget" else None)
                timings[name].append(timing)
            bar.update(1)
    real = sum(len(e["input_ids"]) for e in examples)
    clock = bench.clock
    ratios = [f.on(clock) / t.on(clock) for f, t in zip(timings["fixed_k"], timings["token_budget"])]
    return TokenBudgetResult(
        b, k, budget, len(examples), real, clock,
        {name: real / statistics.median(t.on(clock) for t in timings[name]) for name in VARIANTS},
        ratios, {name: Spread.of(targets[name]) for name in VARIANTS},
    )
