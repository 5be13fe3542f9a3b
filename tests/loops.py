"""Run a scenario through the hf_accum loop, or through the naive `loss / K` loop (negative control),
with a BigBatchAuditor attached. Shared by the single-process tests and the torchrun worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader
from transformers import get_scheduler

from hf_accum.loop import LoopConfig, train
from hf_accum.verify import BigBatchAuditor


@dataclass
class Scenario:
    name: str
    model_factory: Callable[[], torch.nn.Module]
    examples: list
    collator: Any
    micro_batch: int = 2
    accumulation: int = 4
    epochs: float = 1
    max_steps: int = -1
    label_smoothing: float = 0.0
    loss_kind: str = "causal_lm"
    lr: float = 1e-2
    warmup_steps: int = 0
    scheduler: str = "constant"
    loop_kwargs: dict = field(default_factory=dict)


def fresh_accelerator(accumulation: int, **kwargs) -> Accelerator:
    # Accelerator state is a per-process singleton; reset it so each run gets its own K.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=accumulation, **kwargs)


def _prepare(scenario: Scenario, accelerator: Accelerator, on_model=None):
    model = scenario.model_factory()
    auditor = BigBatchAuditor(loss_kind=scenario.loss_kind, label_smoothing=scenario.label_smoothing)
    loader = DataLoader(
        scenario.examples,
        batch_size=scenario.micro_batch,
        shuffle=False,
        collate_fn=auditor.wrap_collator(scenario.collator),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=scenario.lr)
    auditor.attach(model, optimizer)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if on_model is not None:
        on_model(model)
    return model, optimizer, loader, auditor


def run_exact(scenario: Scenario, on_model=None):
    accelerator = fresh_accelerator(scenario.accumulation)
    model, optimizer, loader, auditor = _prepare(scenario, accelerator, on_model)
    config = LoopConfig(
        num_train_epochs=scenario.epochs,
        max_steps=scenario.max_steps,
        lr_scheduler_type=scenario.scheduler,
        warmup_steps=scenario.warmup_steps,
        max_grad_norm=0.0,  # the audit compares unclipped gradients
        label_smoothing=scenario.label_smoothing,
        loss_kind=scenario.loss_kind,
        disable_tqdm=True,
        **scenario.loop_kwargs,
    )
    result = train(model, optimizer, loader, accelerator, config)
    return result, auditor


def run_naive(scenario: Scenario, on_model=None):
    """The classic loop: model's own per-micro-batch mean, Accelerator.backward's fixed 1/K, and an
    LR horizon counted in micro-batches. It is what the tests must catch."""
    accelerator = fresh_accelerator(scenario.accumulation)
    model, optimizer, loader, auditor = _prepare(scenario, accelerator, on_model)
    epochs = int(scenario.epochs)
    scheduler = get_scheduler(
        scenario.scheduler, optimizer, num_warmup_steps=scenario.warmup_steps,
        num_training_steps=len(loader) * epochs,
    )
    model.train()
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch, use_cache=False).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
    return auditor
