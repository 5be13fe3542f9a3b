"""An independent reference for per-sequence normalization: the update's loss written out plainly -- every
sequence of every micro-batch of every rank found by walking rows (and restarts of ``position_ids`` in packed
rows) in Python, its mean token loss, the mean of those -- and its float64 gradient at the run's weights (lr 0).
Nothing from hf_accum's loss, boundary or sequence_norm is used."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _sequences(batch: dict) -> list[tuple[int, list[int]]]:
    """(row, label positions) of each sequence of a collated micro-batch."""
    labels, positions = batch["labels"], batch.get("position_ids")
    found = []
    for row in range(labels.shape[0]):
        starts = [0]
        if positions is not None:
            starts = [i for i in range(labels.shape[1]) if int(positions[row, i]) == 0]
        bounds = starts + [labels.shape[1]]
        for begin, end in zip(bounds[:-1], bounds[1:]):
            found.append((row, list(range(max(begin, 1), end))))  # label 0 of a row is never a target
    return found


def reference_gradient(model: torch.nn.Module, window: list[dict]) -> torch.Tensor:
    """Flat gradient of (1/S) sum_s mean_{t in s} loss_t over ``window`` (all ranks' micro-batches)."""
    params = [p for p in model.parameters() if p.requires_grad]
    means = []
    for batch in window:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        log_probs = F.log_softmax(model(**inputs, use_cache=False).logits.to(torch.float64), dim=-1)
        for row, label_positions in _sequences(batch):
            losses = [-log_probs[row, j - 1, int(batch["labels"][row, j])] for j in label_positions
                      if int(batch["labels"][row, j]) != -100]
            if losses:
                means.append(torch.stack(losses).mean())
    loss = torch.stack(means).mean()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])


def windows_of_all_ranks(batches: list[dict], accumulation: int) -> list[list[dict]]:
    """Each update's micro-batches on every rank (gathered under torch.distributed)."""
    per_rank = [batches]
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()  # all_gather_object puts every rank's list in
        dist.all_gather_object(gathered, batches)
        per_rank = gathered
    count = max(len(b) for b in per_rank)
    return [[batch for rank in per_rank for batch in rank[i:i + accumulation]] for i in range(0, count, accumulation)]


def relative_errors(model: torch.nn.Module, batches: list[dict], accumulation: int,
                    applied: list[torch.Tensor]) -> list[float]:
    """Per update: |applied - reference| / |reference|."""
    windows = windows_of_all_ranks(batches, accumulation)
    assert len(windows) == len(applied), (len(windows), len(applied))
    errors = []
    for window, grad in zip(windows, applied):
        reference = reference_gradient(model, window)
        errors.append(float((grad - reference).norm() / reference.norm()))
    return errors


def run(engine: str, collator: Any, examples: list, normalization: str, output_dir: str, micro_batch: int = 2,
        accumulation: int = 4) -> tuple[list[float], list]:
    """Train (lr 0: the weights stay) in ``engine``; the relative errors of every applied gradient and the logs."""
    from torch.utils.data import DataLoader

    from hf_accum.loop import LoopConfig, train
    from hf_accum.testing import Scenario, fresh_accelerator, run_trainer, tiny_causal_lm
    from hf_accum.testing.data import map_style
    from hf_accum.testing.noise_reference import RecordingCollator
    from hf_accum.trainer import AccumTrainer

    recorder = RecordingCollator(collator)
    model: torch.nn.Module
    if engine == "loop":
        accelerator = fresh_accelerator(accumulation)
        model = tiny_causal_lm()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        applied: list[torch.Tensor] = []
        optimizer.register_step_pre_hook(lambda opt, a, k: applied.append(torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).clone() for p in model.parameters()])))
        loader = DataLoader(map_style(examples), batch_size=micro_batch, shuffle=False, collate_fn=recorder)
        prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        config = LoopConfig(normalization=normalization, max_grad_norm=0.0, lr_scheduler_type="constant",
                            disable_tqdm=True)
        updates = train(prepared, optimizer, loader, accelerator, config).updates
    else:
        case = Scenario("sequence", tiny_causal_lm, examples, recorder, micro_batch=micro_batch,
                        accumulation=accumulation, lr=0.0)
        trained = run_trainer(case, output_dir, trainer_cls=AccumTrainer, record_grads=True,
                              trainer_kwargs={"normalization": normalization})
        trainer = trained.trainer
        assert isinstance(trainer, AccumTrainer) and trainer.model is not None  # trainer_cls above
        model, applied, updates = trainer.model, trained.grads, trainer.updates
    model = getattr(model, "module", model)
    return relative_errors(model, recorder.batches, accumulation, applied), updates
