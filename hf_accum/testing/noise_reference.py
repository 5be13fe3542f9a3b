"""An independent reference for the noise-scale measurement: every rank records the micro-batches it trained
(in order), then recomputes, at the run's (unchanged: lr 0) weights, the gradient of each micro-batch ALONE
(mode ``every``; ``first``: each window's first only) and of the whole update, with a plain float64
cross-entropy -- nothing from hf_accum's loss, boundary, probe or hooks. The expected estimates follow; the
run's ``UpdateLog.grad_sq`` / ``trace_cov`` must equal them (1e-10)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_accum.measure.noise_scale import SmallBatch, pooled_estimate, update_estimates


class RecordingCollator:
    """Wraps a collator; keeps every micro-batch this rank's dataloader produced."""

    def __init__(self, collator: Callable[[list[dict]], dict]) -> None:
        self.collator = collator
        self.batches: list[dict] = []

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collator(examples)
        self.batches.append({key: value.clone() for key, value in batch.items()})
        return batch


def summed_gradient(model: torch.nn.Module, batches: list[dict]) -> tuple[torch.Tensor, int]:
    """Flat gradient of the summed next-token cross-entropy over ``batches``, and their target count."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    targets = 0
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits.to(torch.float64)
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=-100, reduction="sum")
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        total += torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64)
                            for g, p in zip(grads, params)])
        targets += int((labels != -100).sum())
    return total, targets


def expected_estimates(model: torch.nn.Module, batches: list[dict], accumulation: int,
                       mode: str = "every") -> list[dict]:
    """Per update: ``B``, ``|G|^2``, the small batches and the estimates they give. ``every``: each micro-batch
    of every rank (:func:`pooled_estimate`); ``first``: every rank's first micro-batch of windows of >= 2
    (:func:`update_estimates`). A collective under torch.distributed."""
    windows = [batches[i:i + accumulation] for i in range(0, len(batches), accumulation)]
    if mode == "every":
        return [_every_micro_batch(model, window) for window in windows]
    world = dist.get_world_size() if dist.is_initialized() else 1
    expected = []
    for window in windows:
        first, n_first = summed_gradient(model, window[:1])
        local = [(n_first, float(first.square().sum()) / n_first ** 2)] if len(window) > 1 and n_first else []
        window_sum, window_targets = summed_gradient(model, window)
        counts = torch.tensor([float(window_targets)], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(window_sum)
            dist.all_reduce(counts)
            gathered: list = [None] * world
            dist.all_gather_object(gathered, local)
            local = [pair for rank_pairs in gathered for pair in rank_pairs]
        big_targets = float(counts[0])
        big_grad_sq = float((window_sum / big_targets).square().sum())
        estimate = update_estimates([SmallBatch(n, g) for n, g in local], big_targets, big_grad_sq)
        expected.append({
            "small": local, "big_targets": big_targets, "big_grad_sq": big_grad_sq,
            "grad_sq": estimate.grad_sq if estimate else None, "trace_cov": estimate.trace_cov if estimate else None,
        })
    return expected


def _every_micro_batch(model: torch.nn.Module, window: list[dict]) -> dict:
    """One window with every micro-batch a small batch: each one's gradient computed on its own; ``m`` and
    ``sum_k b_k |g_k|^2 = sum_k |s_k|^2 / b_k`` summed over ranks with the update's sum and targets."""
    parts = [summed_gradient(model, [batch]) for batch in window]
    window_sum = torch.stack([gradient for gradient, _ in parts]).sum(0)
    with_targets = [(gradient, n) for gradient, n in parts if n]
    sums = torch.tensor([float(sum(n for _, n in parts)), float(len(with_targets)),
                         sum(float(gradient.square().sum()) / n for gradient, n in with_targets)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(window_sum)
        dist.all_reduce(sums)
    big_targets, micro_batches, weighted = sums.tolist()
    big_grad_sq = float((window_sum / big_targets).square().sum())
    estimate = pooled_estimate(micro_batches, weighted, big_targets, big_grad_sq)
    return {"micro_batches": micro_batches, "weighted_grad_sq": weighted, "big_targets": big_targets,
            "big_grad_sq": big_grad_sq, "grad_sq": estimate.grad_sq if estimate else None,
            "trace_cov": estimate.trace_cov if estimate else None}


def relative_errors(updates: list[dict], expected: list[dict]) -> list[float]:
    """Relative error of the logged raw estimates against the reference, update by update."""
    errors = []
    for update, reference in zip(updates, expected, strict=True):
        for name in ("grad_sq", "trace_cov"):
            if reference[name] is None:
                assert update[name] is None, (name, update[name])
                continue
            errors.append(abs(update[name] - reference[name]) / abs(reference[name]))
    return errors


# -- the runs under test ----------------------------------------------------------------------------------

def learnable_rows(rows: int, seed: int) -> list[dict]:
    """Random lengths and masked prompts, but tokens that count up (mod the vocabulary) from a random start: a
    gradient with signal, so that ``|G|^2`` is measurably positive (uniform random tokens have none)."""
    from hf_accum.testing import random_rows
    from hf_accum.testing.data import VOCAB

    examples = random_rows(rows, seed=seed, prompt_masking=True)
    for example in examples:
        ids = torch.as_tensor(example["input_ids"])
        counting = 3 + (ids[0] - 3 + torch.arange(len(ids))) % (VOCAB - 3)
        example["input_ids"] = counting.tolist() if isinstance(example["input_ids"], list) else counting
    return examples


def scenario(rows: int = 32, lr: float = 0.0, max_grad_norm: float = 1e6, seed: int = 11, accumulation: int = 4,
             epochs: float = 1, mode: str = "every") -> Any:
    """Float64 tiny Llama, padded rows with masked prompts (uneven targets per micro-batch); lr 0 keeps the
    weights of the reference; ``mode``: ``noise_scale_micro_batches``."""
    from hf_accum.batching import PaddingCollator
    from hf_accum.testing import PAD, Scenario, tiny_causal_lm

    return Scenario("noise", tiny_causal_lm, learnable_rows(rows, seed),
                    RecordingCollator(PaddingCollator(PAD)), micro_batch=2, accumulation=accumulation, lr=lr,
                    max_grad_norm=max_grad_norm, epochs=epochs,
                    loop_kwargs={"noise_scale": True, "noise_scale_micro_batches": mode})


def run_engine(engine: str, case: Any, output_dir: str) -> tuple[list[dict], torch.nn.Module, str | None]:
    """Train ``case`` in ``engine`` ('loop' or 'trainer'): (updates as dicts, the plain model, advice line)."""
    from dataclasses import asdict

    from hf_accum.testing import run_exact, run_trainer
    from hf_accum.trainer import AccumTrainer

    if engine == "loop":
        models: list[torch.nn.Module] = []
        result, _ = run_exact(case, on_model=models.append)
        model = getattr(models[0], "module", models[0])
        return [asdict(u) for u in result.updates], model, result.noise_scale_advice
    run = run_trainer(case, output_dir, trainer_cls=AccumTrainer, trainer_kwargs=dict(case.loop_kwargs))
    trainer = run.trainer
    assert isinstance(trainer, AccumTrainer) and trainer.model is not None  # trainer_cls above
    model = getattr(trainer.model, "module", trainer.model)
    return [asdict(u) for u in trainer.updates], model, trainer.noise_scale_advice
