"""Audited training runs: one scenario, run through the hf_accum loop, the naive loop or a Trainer.

A :class:`Scenario` is a model factory, examples, a collator and the batch arithmetic. Every run
wraps the collator and hooks the optimizer with :class:`hf_accum.verify.BigBatchAuditor`, which
recomputes the big-batch gradient at each ``optimizer.step`` independently of the core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainingArguments, get_scheduler
from transformers.trainer_callback import TrainerControl, TrainerState

from hf_accum.loop import LoopConfig, TrainResult, train
from hf_accum.testing.data import map_style
from hf_accum.verify import BigBatchAuditor


@dataclass
class Scenario:
    """A model factory, examples and a collator, plus the accumulation settings to audit."""

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
    pad_token_id: int = 0
    reference_dtype: torch.dtype | None = None
    max_grad_norm: float = 0.0
    """0: unclipped, so the audit compares the raw applied gradient."""
    accelerator_kwargs: dict = field(default_factory=dict)
    """Loop runs only: extra ``Accelerator`` arguments."""
    loop_kwargs: dict = field(default_factory=dict)
    """Loop runs only: extra ``LoopConfig`` fields."""
    args: dict = field(default_factory=dict)
    """Trainer runs only: extra ``TrainingArguments`` fields."""
    optimizer: str = "adamw"
    """Loop runs only: ``"adamw"``, or ``"sgd"`` (no optimizer state: what ``hf-accum check`` uses at real
    sizes; the audit compares gradients, which the optimizer does not change)."""
    router_loss: str = "none"
    """MoE models: how the audit's reference adds the router loss (:class:`hf_accum.verify.BigBatchAuditor`)."""
    share_weights: bool = False
    """The audit's reference recomputes on the live weights, not a copy (:class:`hf_accum.verify.BigBatchAuditor`)."""

    def auditor(self) -> BigBatchAuditor:
        return BigBatchAuditor(
            loss_kind=self.loss_kind, label_smoothing=self.label_smoothing, pad_token_id=self.pad_token_id,
            reference_dtype=self.reference_dtype, router_loss=self.router_loss, share_weights=self.share_weights,
        )

    def big_batch_learning_rates(self, total_updates: int) -> list[float]:
        """LR at each update of this scenario's big-batch run."""
        return big_batch_learning_rates(self.lr, total_updates, self.warmup_steps, self.scheduler)


# Scenario field -> the TrainingArguments / LoopConfig field it sets (LoopConfig names follow
# TrainingArguments where they overlap; label smoothing is the one spelled differently).
_SHARED_SETTINGS = {
    "epochs": ("num_train_epochs", "num_train_epochs"),
    "max_steps": ("max_steps", "max_steps"),
    "scheduler": ("lr_scheduler_type", "lr_scheduler_type"),
    "warmup_steps": ("warmup_steps", "warmup_steps"),
    "max_grad_norm": ("max_grad_norm", "max_grad_norm"),
    "label_smoothing": ("label_smoothing_factor", "label_smoothing"),
}

OnModel = Callable[[torch.nn.Module], None]
"""Called with the prepared model before training (a test's extra hook or check)."""


def loop_config(scenario: Scenario) -> LoopConfig:
    values = {loop: getattr(scenario, name) for name, (_, loop) in _SHARED_SETTINGS.items()}
    return LoopConfig(**values, loss_kind=scenario.loss_kind, disable_tqdm=True, **scenario.loop_kwargs)


def training_args(
    scenario: Scenario, output_dir: str, args_cls: type[TrainingArguments] = TrainingArguments, **overrides: Any
) -> TrainingArguments:
    """``args_cls`` (``TrainingArguments`` or a subclass such as TRL's ``SFTConfig``) for the scenario."""
    values = {trainer: getattr(scenario, name) for name, (trainer, _) in _SHARED_SETTINGS.items()}
    values.update(
        output_dir=output_dir,
        per_device_train_batch_size=scenario.micro_batch,
        gradient_accumulation_steps=scenario.accumulation,
        learning_rate=scenario.lr,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,  # keep prompt_length / label for our collators
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    values.update(scenario.args)
    values.update(overrides)
    return args_cls(**values)


def big_batch_learning_rates(lr: float, total_updates: int, warmup: int = 0, name: str = "linear") -> list[float]:
    """LR applied at updates 1..total of a big-batch run (one update per big batch): a transformers
    scheduler over exactly that many updates, stepped once per update."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_updates)
    rates = []
    for _ in range(total_updates):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


# -- the Accelerate loops --------------------------------------------------------------------------


def reset_accelerate_state() -> None:
    """Accelerate keeps its state in per-process singletons: forget them, so that the next
    ``Accelerator`` (ours or a Trainer's) is built with its own settings."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def fresh_accelerator(accumulation: int, device: str | torch.device | None = None, **kwargs: Any) -> Accelerator:
    """An ``Accelerator`` on fresh state, so each run gets its own K."""
    reset_accelerate_state()
    cpu = torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()
    return Accelerator(cpu=cpu, gradient_accumulation_steps=accumulation, **kwargs)


def run_exact(scenario: Scenario, on_model: OnModel | None = None) -> tuple[TrainResult, BigBatchAuditor]:
    """hf_accum's loop under the auditor."""
    accelerator = fresh_accelerator(scenario.accumulation, **scenario.accelerator_kwargs)
    model, optimizer, loader, auditor = _prepare(scenario, accelerator, on_model)
    return train(model, optimizer, loader, accelerator, loop_config(scenario)), auditor


def run_naive(scenario: Scenario, on_model: OnModel | None = None) -> BigBatchAuditor:
    """The classic loop: the model's own per-micro-batch mean, ``Accelerator.backward``'s fixed
    ``1 / K``, and an LR horizon counted in micro-batches. The baseline hf_accum must beat."""
    accelerator = fresh_accelerator(scenario.accumulation, **scenario.accelerator_kwargs)
    model, optimizer, loader, auditor = _prepare(scenario, accelerator, on_model)
    epochs = int(scenario.epochs)
    scheduler = get_scheduler(
        scenario.scheduler, optimizer, num_warmup_steps=scenario.warmup_steps, num_training_steps=len(loader) * epochs
    )
    naive_loop(model, optimizer, loader, accelerator, scheduler, epochs, scenario.max_grad_norm)
    return auditor


def naive_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable[Mapping[str, Any]],
               accelerator: Accelerator, scheduler: Any, epochs: int = 1, max_grad_norm: float = 0.0) -> None:
    """The bare Accelerate loop of Accelerate's own examples: ``model(**batch).loss`` inside
    ``accelerator.accumulate()``, clipping (when ``max_grad_norm`` > 0) and stepping once per update.
    The naive baseline of the exactness tests and the bare loop the benchmarks time."""
    model.train()
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch, use_cache=False).loss)
                if accelerator.sync_gradients:
                    if max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()


def _prepare(scenario: Scenario, accelerator: Accelerator, on_model: OnModel | None = None
             ) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader, BigBatchAuditor]:
    model = scenario.model_factory()
    auditor = scenario.auditor()
    loader = DataLoader(
        map_style(scenario.examples), batch_size=scenario.micro_batch, shuffle=False,
        collate_fn=auditor.wrap_collator(scenario.collator),
    )
    optimizer_class = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[scenario.optimizer]
    optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], lr=scenario.lr)
    auditor.attach(model, optimizer)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if on_model is not None:
        on_model(model)
    return model, optimizer, loader, auditor


# -- Trainer (AccumTrainer or stock) ---------------------------------------------------------------


@dataclass
class AuditedTrainerRun:
    trainer: Trainer
    auditor: BigBatchAuditor
    logs: list[dict]
    grads: list[torch.Tensor]  # flat gradient handed to each optimizer step (when recorded)
    grads_were_none: list[bool]

    @property
    def errors(self) -> list[float]:
        return [r.relative_error for r in self.auditor.records]

    @property
    def max_error(self) -> float:
        return self.auditor.max_relative_error

    @property
    def lrs(self) -> list[float]:
        return [r.learning_rate for r in self.auditor.records]

    @property
    def update_logs(self) -> list[dict]:
        return [log for log in self.logs if "loss" in log and "train_runtime" not in log]


class _KeepLogs(TrainerCallback):
    def __init__(self, sink: list[dict[str, Any]]) -> None:
        self.sink = sink

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.sink.append(dict(logs or {}))


def run_trainer(
    scenario: Scenario,
    output_dir: str,
    trainer_cls: type[Trainer] = Trainer,
    auditor: BigBatchAuditor | None = None,
    trainer_kwargs: dict | None = None,
    resume_from_checkpoint: str | None = None,
    record_grads: bool = False,
    args_cls: type[TrainingArguments] = TrainingArguments,
    **arg_overrides: Any,
) -> AuditedTrainerRun:
    """Train ``scenario`` with ``trainer_cls`` under the auditor. The optimizer is built here and passed
    as ``optimizers=(optimizer, None)`` so the auditor can hook it before ``train()``; the Trainer still
    creates the LR scheduler (that is what is tested). ``scenario.collator=None`` audits the collator
    the trainer builds itself (TRL's)."""
    logging.getLogger("transformers.trainer").setLevel(logging.WARNING)  # Trainer's info lines are not tested
    model = scenario.model_factory()
    auditor = auditor or scenario.auditor()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=scenario.lr, weight_decay=0.0)
    auditor.attach(model, optimizer)
    grads: list[torch.Tensor] = []
    grads_were_none: list[bool] = []

    def record(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        grads_were_none.append(all(p.grad is None for p in params))
        if record_grads:
            flat = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            grads.append(torch.cat(flat).clone())

    optimizer.register_step_pre_hook(record)
    logs: list[dict] = []
    trainer = trainer_cls(
        model=model,
        args=training_args(scenario, output_dir, args_cls, **arg_overrides),
        train_dataset=scenario.examples,
        data_collator=None if scenario.collator is None else auditor.wrap_collator(scenario.collator),
        optimizers=(optimizer, None),
        callbacks=[_KeepLogs(logs)],
        **(trainer_kwargs or {}),
    )
    if scenario.collator is None:
        built: Any = trainer.data_collator  # the trainer's own (TRL's): any callable over the list of rows
        trainer.data_collator = auditor.wrap_collator(built)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return AuditedTrainerRun(trainer, auditor, logs, grads, grads_were_none)
