"""Section ``rampup-auto``: does a batch that steers itself by the noise scale pay? Fixed batches against
``LoopConfig(rampup_batch_size="auto")`` on the recipe's embedded task, several seeds each.

The embedded default job (``recipes/configs/cpu_default.yaml``: the tiny Llama with LoRA on the synthetic
instruction tasks, answers-only targets), with fewer rows so that every run takes well under a minute. Variants:
fixed global batches at the minimum (two micro-batches per process, where the auto ramp starts), the middle and
the maximum (the configured global batch), ``auto`` (its defaults: LR rule ``constant``, so the only difference to
the fixed runs is the batch) and ``auto m=1`` (margin 1, reset below 0.5: it grows sooner). Every run sees the same rows in the same order for a seed (one epoch)
and the same LR schedule shape (cosine, 5% warmup) over its samples, so all consume the same tokens.

Per run, the held-out loss (exact per-token mean over the held-out split) is measured every
``--rampup-auto-eval-every`` samples and at the end. Reported per variant, median and [min, max] over the seeds:
the final held-out loss (equal tokens consumed), and the optimizer updates, target tokens and training seconds
(evaluation excluded) until the held-out loss first reaches the target (default: the worst variant's median final
loss). Wall times are measured on whatever else the machine runs: the verdict rests on updates and tokens.
No pass/fail target: the section reports what the controller buys (or not) on this task.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from transformers.hf_argparser import HfArg

from benchmarks.report import BenchError, SectionResult, require_positive

if TYPE_CHECKING:
    from benchmarks.harness import Bench
    from benchmarks.options import BenchOptions

AUTO = "auto"
EAGER = "auto m=1"
"""The auto ramp with a lower margin (1 instead of 2, reset below 0.5): does growing sooner help here?"""
EAGER_SETTINGS = {"margin": 1.0, "release": 0.5}


@dataclass
class Options:
    _argument_group_name = "rampup-auto section"

    rampup_auto_examples: int = HfArg(default=800, help="training rows of the embedded task (one epoch)")
    rampup_auto_seeds: int = HfArg(default=3, help="seeds per variant (weights, LoRA init, data order)")
    rampup_auto_micro_batch: int = HfArg(default=8, help="sequences per micro-batch")
    rampup_auto_max_accumulation: int = HfArg(default=8, help="K of the largest fixed batch and the auto ramp's "
                                                              "ceiling (a multiple of 4: min is K=2, middle K/2)")
    rampup_auto_eval_every: int = HfArg(default=96, help="samples between held-out evaluations")
    rampup_auto_target_loss: float | None = HfArg(default=None, help="held-out loss to reach (default: the worst "
                                                                     "variant's median final loss)")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(rampup_auto_examples=options.rampup_auto_examples, rampup_auto_seeds=options.rampup_auto_seeds,
                     rampup_auto_micro_batch=options.rampup_auto_micro_batch,
                     rampup_auto_eval_every=options.rampup_auto_eval_every)
    if options.rampup_auto_max_accumulation < 4 or options.rampup_auto_max_accumulation % 4:
        raise BenchError(f"rampup_auto_max_accumulation={options.rampup_auto_max_accumulation} must be a multiple "
                         "of 4 (>= 4): the variants are K = 2, K/2 and K")
    if common.device != "cpu":
        raise BenchError("the rampup-auto section runs the embedded CPU job; use --device cpu")


@dataclass
class Point:
    update: int
    samples: int
    targets: int
    seconds: float
    """Training time so far, evaluation excluded."""
    loss: float


@dataclass
class Run:
    variant: str
    seed: int
    updates: int
    batches: list[int]
    """Sequences of every update."""
    changes: int
    points: list[Point] = field(default_factory=list)

    @property
    def final_loss(self) -> float:
        return self.points[-1].loss

    def reached(self, target: float) -> Point | None:
        return next((p for p in self.points if p.loss <= target), None)


@dataclass
class VariantRow:
    variant: str
    batch: str
    updates: list[int]
    final_loss: list[float]
    to_target_updates: list[int | None]
    to_target_targets: list[int | None]
    to_target_seconds: list[float | None]


@dataclass
class RampupAutoResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ()

    examples: int
    micro_batch: int
    seeds: int
    target_loss: float
    eval_every: int
    rows: list[VariantRow]
    auto_batches: dict[str, list[str]]
    """Per auto variant and seed: the run's batch stages (``16 x 40 -> 32 x 20``)."""

    def text(self) -> str:
        lines = [
            f"\nAuto batch ramp vs fixed batches: embedded task, {self.examples} rows x 1 epoch, micro-batch "
            f"{self.micro_batch}, {self.seeds} seeds; median [min, max] over seeds; held-out loss every "
            f"{self.eval_every} samples; target held-out loss {self.target_loss:.4f}",
            f"  {'variant':<10} {'batch':>8} {'updates':>18} {'final held-out loss':>26} {'updates to target':>20} "
            f"{'tokens to target':>22} {'train s to target':>22}",
        ]
        for row in self.rows:
            lines.append(f"  {row.variant:<10} {row.batch:>8} {_spread(row.updates, '{:.0f}'):>18} "
                         f"{_spread(row.final_loss, '{:.4f}'):>26} {_spread(row.to_target_updates, '{:.0f}'):>20} "
                         f"{_spread(row.to_target_targets, '{:.0f}'):>22} "
                         f"{_spread(row.to_target_seconds, '{:.1f}'):>22}")
        for name, per_seed in self.auto_batches.items():
            lines.append(f"  {name} batches per seed: " + "; ".join(per_seed))
        lines.append("  (train seconds are wall time on a shared, loaded machine: compare updates and tokens)")
        return "\n".join(lines)


def _spread(values: list, fmt: str) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "not reached"
    text = f"{fmt.format(statistics.median(known))} [{fmt.format(min(known))}, {fmt.format(max(known))}]"
    missing = len(values) - len(known)
    return text + (f" ({missing} not)" if missing else "")


def stages(batches: list[int]) -> str:
    parts: list[list[int]] = []
    for batch in batches:
        if parts and parts[-1][0] == batch:
            parts[-1][1] += 1
        else:
            parts.append([batch, 1])
    return " -> ".join(f"{b} x {n}" for b, n in parts)


class EmbeddedTask:
    """The recipe's embedded default job's tokenizer, encoded rows and model builder (loaded once)."""

    def __init__(self, examples: int) -> None:
        from hf_accum.recipe.checks import load_recipe_config
        from hf_accum.recipe.data import load_tokenizer_and_data

        self.config = load_recipe_config([f"data.num_train_examples={examples}", "data.num_eval_examples=200"],
                                         ["loop"], ["sft"])
        self.tokenizer, self.data = load_tokenizer_and_data(self.config.model, self.config.data)

    def model(self, seed: int):
        from hf_accum.recipe.modeling import build_model

        return build_model(self.config, self.tokenizer, seed=seed, model_checkpointing=False)


def run_variant(task: EmbeddedTask, variant: str, accumulation: int, seed: int, options: Options) -> Run:
    """One epoch through :func:`hf_accum.loop.train`, the held-out loss every ``eval_every`` samples."""
    import torch
    from torch.utils.data import DataLoader

    from hf_accum.batching import PaddingCollator
    from hf_accum.loop import LoopConfig, train
    from hf_accum.loop.evaluation import evaluate_loss
    from hf_accum.losses.micro_batch import MicroBatchLoss
    from hf_accum.testing import fresh_accelerator

    accelerator = fresh_accelerator(accumulation, device="cpu")
    model = task.model(seed)
    collator = PaddingCollator(task.tokenizer.pad_token_id)
    loader = DataLoader(task.data.train.examples, batch_size=options.rampup_auto_micro_batch, shuffle=True,
                        generator=torch.Generator().manual_seed(seed), collate_fn=collator)
    held_out = DataLoader(task.data.held_out.examples, batch_size=32, collate_fn=collator)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(num_train_epochs=1, lr_scheduler_type="cosine", warmup_ratio=0.05, max_grad_norm=1.0,
                        disable_tqdm=True, loss_kind="causal_lm",
                        rampup_batch_size=AUTO if variant in (AUTO, EAGER) else None,
                        rampup_auto=EAGER_SETTINGS if variant == EAGER else None)
    loss = MicroBatchLoss("causal_lm")
    run = Run(variant, seed, 0, [], 0)
    clock = {"start": time.perf_counter(), "eval": 0.0, "samples": 0, "targets": 0}

    def evaluate(step: int) -> None:
        began = time.perf_counter()
        seconds = began - clock["start"] - clock["eval"]  # training so far: earlier evaluations excluded
        value = evaluate_loss(model, held_out, accelerator, loss)
        clock["eval"] += time.perf_counter() - began
        run.points.append(Point(step, clock["samples"], clock["targets"], seconds, value))

    def on_update(update) -> None:
        clock["samples"] += update.sequences
        clock["targets"] += update.targets
        run.batches.append(update.sequences)
        run.changes += bool(update.batch_change)
        if clock["samples"] // options.rampup_auto_eval_every > len(run.points):
            evaluate(update.step)

    result = train(model, optimizer, loader, accelerator, config, on_update=on_update)
    run.updates = len(result.updates)
    if not run.points or run.points[-1].update != run.updates:
        evaluate(run.updates)
    return run


def measure(bench: Bench, options: Options) -> RampupAutoResult:
    task = EmbeddedTask(options.rampup_auto_examples)
    k = options.rampup_auto_max_accumulation
    micro = options.rampup_auto_micro_batch
    variants = {f"fixed {2 * micro}": 2, f"fixed {k // 2 * micro}": k // 2, f"fixed {k * micro}": k, AUTO: k,
                EAGER: k}
    runs: dict[str, list[Run]] = {name: [] for name in variants}
    with bench.progress(len(variants) * options.rampup_auto_seeds, "rampup-auto runs") as bar:
        for seed in range(options.rampup_auto_seeds):
            for name, accumulation in variants.items():
                runs[name].append(run_variant(task, name, accumulation, bench.options.seed + seed, options))
                bar.update(1)
    target = options.rampup_auto_target_loss
    if target is None:
        target = max(statistics.median(r.final_loss for r in variant_runs) for variant_runs in runs.values())
    rows = []
    for name, variant_runs in runs.items():
        reached = [r.reached(target) for r in variant_runs]
        batch = f"{2 * micro}-{k * micro}" if name in (AUTO, EAGER) else name.split()[1]
        rows.append(VariantRow(
            name, batch, [r.updates for r in variant_runs], [r.final_loss for r in variant_runs],
            [p.update if p else None for p in reached], [p.targets if p else None for p in reached],
            [p.seconds if p else None for p in reached],
        ))
    return RampupAutoResult(options.rampup_auto_examples, micro, options.rampup_auto_seeds, target,
                            options.rampup_auto_eval_every, rows,
                            {name: [stages(r.batches) for r in runs[name]] for name in (AUTO, EAGER)})
