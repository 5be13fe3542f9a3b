"""Section ``padding``: stock ``transformers.Trainer`` vs :class:`hf_accum.AccumTrainer` on
variable-length SFT-like rows (random prompt and answer lengths, prompt masked).

Real (non-pad) tokens/s of stock Trainer with default batching (right padding, random order) vs
AccumTrainer with padding-free packing (:class:`hf_accum.batching.PackingCollator`) and vs
AccumTrainer with the same padding; same model, data, micro-batch (in sequences) and accumulation,
interleaved (targets: packed / stock >= 1.5, ours / stock at the same batching >= 0.98).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

from transformers import TrainerCallback
from transformers.hf_argparser import HfArg

from benchmarks.harness import Bench, Timing, Workload, bench_scenario, build_trainer, synchronize, token_rows
from benchmarks.report import SectionResult, judge, median_interval, require_positive, summary_row, verdict
from hf_accum.batching import PackingCollator, PaddingCollator

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

PACKING_TARGET = 1.5  # packed AccumTrainer / stock Trainer (default batching) real tokens/s
TRAINER_TARGET = 0.98  # AccumTrainer / stock Trainer real tokens/s at the same batching: "no slower"

VARIANTS = {
    # name: (AccumTrainer?, packing?)
    "stock": (False, False),
    "packed": (True, True),
    "ours_padded": (True, False),
}
NAMES = {"stock": "stock Trainer, padded (default batching)", "packed": "AccumTrainer, packed (padding-free)",
         "ours_padded": "AccumTrainer, padded (same batching as stock)"}


@dataclass
class Options:
    _argument_group_name = "padding section"

    padding_micro_batch: int = HfArg(default=8, help="sequences per micro-batch (padded rows, or one packed row)")
    padding_accumulation: int = HfArg(default=2, help="accumulation steps")
    padding_updates: int = HfArg(default=3, help="optimizer updates per Trainer run")
    padding_repeats: int = HfArg(default=5, help="interleaved (stock, packed, ours-padded) triples; medians of the "
                                                 "per-triple ratios are reported")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(
        padding_micro_batch=options.padding_micro_batch, padding_accumulation=options.padding_accumulation,
        padding_updates=options.padding_updates, padding_repeats=options.padding_repeats,
    )


@dataclass
class PaddingResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = (
        "packed_ratio", "packed_interval", "packed_passed", "trainer_ratio", "trainer_interval", "trainer_passed")

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
        return judge(self.packed_interval, PACKING_TARGET)

    @property
    def trainer_passed(self) -> bool | None:
        return judge(self.trainer_interval, TRAINER_TARGET)

    def text(self) -> str:
        t = self.tokens_per_s
        rows = [("stock", 1.0, 1.0), ("packed", self.packed_ratio, self.packed_wall_ratio),
                ("ours_padded", self.trainer_ratio, self.trainer_wall_ratio)]
        lines = [
            f"\nPadding: SFT-like rows (random prompt/answer split, prompt masked), micro-batch {self.micro_batch} "
            f"sequences, K={self.accumulation_steps}, {self.updates} updates per run, {self.real_tokens} real "
            f"tokens per run; stock pads {self.stock_padding_fraction:.1%} of positions",
            f"  {'variant':<48} {'real tokens/s':>14} {'/ stock (' + self.clock + ')':>14} {'/ stock (wall)':>15}",
            *(f"  {NAMES[name]:<48} {t[name]:>14.0f} {ratio:>14.3f} {wall:>15.3f}" for name, ratio, wall in rows),
            f"  packed/stock per triple ({self.clock}): {', '.join(f'{r:.3f}' for r in self.packed_ratios)}",
            f"  ours/stock per triple ({self.clock}):   {', '.join(f'{r:.3f}' for r in self.trainer_ratios)}",
        ]
        return "\n".join(lines)

    def summary(self) -> list[dict]:
        where = f"micro-batch {self.micro_batch} sequences, K={self.accumulation_steps}"
        return [
            summary_row(
                f"padding: real tokens/s packed AccumTrainer / stock Trainer default batching ({where})",
                f"{self.packed_ratio:.3f} by {self.clock} time (median of {len(self.packed_ratios)} triples, ~95% "
                f"interval {self.packed_interval[0]:.3f}-{self.packed_interval[1]:.3f}; wall "
                f"{self.packed_wall_ratio:.3f}; stock padding {self.stock_padding_fraction:.1%})",
                f">= {PACKING_TARGET:.2f}", verdict(self.packed_passed, "INCONCLUSIVE"),
            ),
            summary_row(
                f"trainer overhead: AccumTrainer / stock Trainer, same batching ({where}, padded)",
                f"{self.trainer_ratio:.3f} by {self.clock} time (median of {len(self.trainer_ratios)} triples, ~95% "
                f"interval {self.trainer_interval[0]:.3f}-{self.trainer_interval[1]:.3f}; wall "
                f"{self.trainer_wall_ratio:.3f})",
                f">= {TRAINER_TARGET:.2f}", verdict(self.trainer_passed, "INCONCLUSIVE"),
            ),
        ]


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


class _TrainClock(TrainerCallback):
    """Times ``train()`` from ``on_train_begin`` to ``on_train_end`` (device work waited for)."""

    def __init__(self, device):
        self.device = device
        self.timing: Timing | None = None

    def on_train_begin(self, *_args, **_kwargs):
        synchronize(self.device)
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def on_train_end(self, *_args, **_kwargs):
        synchronize(self.device)
        self.timing = Timing(time.perf_counter() - self.wall, time.process_time() - self.cpu)


@dataclass
class TrainerRun:
    timing: Timing
    real_tokens: int
    positions: int


def run_variant(work: Workload, name: str, examples: list, micro_batch: int, accumulation: int, output_dir: str,
                seed: int) -> TrainerRun:
    """One epoch over ``examples`` with the variant's Trainer and batching; the optimizer, scheduler,
    dataloader and Trainer construction are not timed."""
    accum, packing = VARIANTS[name]
    collator = _CountingCollator(PackingCollator() if packing else PaddingCollator(work.pad_token_id))
    scenario = bench_scenario(f"padding:{name}", work.reset, examples, collator, micro_batch, accumulation)
    # Default batching of stock Trainer: a random order (the same seed in every variant).
    trainer = build_trainer(scenario, accum, output_dir, work.device, seed=seed, train_sampling_strategy="random")
    clock = _TrainClock(work.device)
    trainer.add_callback(clock)
    trainer.train()
    return TrainerRun(clock.timing, collator.real, collator.total)


def measure(bench: Bench, options: Options) -> PaddingResult:
    """Stock Trainer (default batching) vs packed AccumTrainer vs padded AccumTrainer, interleaved."""
    common, work = bench.options, bench.workload
    b, k, updates = options.padding_micro_batch, options.padding_accumulation, options.padding_updates
    # SFT-like rows: a random prompt length (masked, no targets) and the answer (the targets).
    examples = token_rows(work, b * k * updates, common.seed + 3, common.min_length, common.max_length,
                          prompt_masking=True)
    names = list(VARIANTS)
    runs: dict[str, list[TrainerRun]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="hf_accum_bench_") as tmp:
        for name in names:  # warm-up (one update each), not timed
            run_variant(work, name, examples[: b * k], b, k, tmp, common.seed)
        with bench.progress(options.padding_repeats, "padding triples") as bar:
            for rep in range(options.padding_repeats):
                for name in names[rep % 3:] + names[: rep % 3]:  # rotate: no fixed position per variant
                    runs[name].append(run_variant(work, name, examples, b, k, tmp, common.seed))
                bar.update(1)
    real = {runs[name][0].real_tokens for name in names}
    if len(real) != 1:
        raise RuntimeError(f"the variants saw different real token counts: {real}")
    tokens = real.pop()

    def ratios(name: str, clock: str) -> list[float]:
        return [s.timing.on(clock) / o.timing.on(clock) for s, o in zip(runs["stock"], runs[name])]

    stock = runs["stock"][0]
    return PaddingResult(
        b, k, updates, bench.clock, tokens, 1.0 - stock.real_tokens / stock.positions,
        ratios("packed", bench.clock), ratios("ours_padded", bench.clock),
        statistics.median(ratios("packed", "wall")), statistics.median(ratios("ours_padded", "wall")),
        {name: tokens / statistics.median(r.timing.wall for r in runs[name]) for name in names},
    )
