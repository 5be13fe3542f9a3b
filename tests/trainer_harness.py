"""Run a Trainer (AccumTrainer or stock ``transformers.Trainer``) on a tiny scenario under a
BigBatchAuditor. Shared by the single-process trainer tests and the torchrun worker.

The optimizer is built here and passed as ``optimizers=(optimizer, None)`` so the auditor can hook
it before ``train()``; the Trainer still creates the LR scheduler (that is what we test).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_accum.checking import Scenario
from hf_accum.verify import BigBatchAuditor
from references import big_batch_learning_rates

# Keep test output quiet: Trainer's own info lines are not what we test.
logging.getLogger("transformers.trainer").setLevel(logging.WARNING)


@dataclass
class TrainerScenario(Scenario):
    """A loop scenario (hf_accum.checking.Scenario) plus extra TrainingArguments; the loop-only
    fields (accelerator/loop kwargs, max_grad_norm) are unused here."""

    args: dict = field(default_factory=dict)  # extra TrainingArguments


@dataclass
class TrainerRun:
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
    def __init__(self, sink: list):
        self.sink = sink

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.sink.append(dict(logs or {}))


def training_args(scenario: TrainerScenario, output_dir: str, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=output_dir,
        per_device_train_batch_size=scenario.micro_batch,
        gradient_accumulation_steps=scenario.accumulation,
        num_train_epochs=scenario.epochs,
        max_steps=scenario.max_steps,
        learning_rate=scenario.lr,
        lr_scheduler_type=scenario.scheduler,
        warmup_steps=scenario.warmup_steps,
        label_smoothing_factor=scenario.label_smoothing,
        max_grad_norm=0.0,  # the audit compares unclipped gradients
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
    return TrainingArguments(**values)


def run_trainer(
    scenario: TrainerScenario,
    output_dir: str,
    trainer_cls: type[Trainer] = Trainer,
    auditor: BigBatchAuditor | None = None,
    trainer_kwargs: dict | None = None,
    resume_from_checkpoint: str | None = None,
    record_grads: bool = False,
    **arg_overrides,
) -> TrainerRun:
    model = scenario.model_factory()
    auditor = auditor or BigBatchAuditor(loss_kind=scenario.loss_kind, label_smoothing=scenario.label_smoothing)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=scenario.lr, weight_decay=0.0)
    auditor.attach(model, optimizer)
    grads: list[torch.Tensor] = []
    grads_were_none: list[bool] = []

    def record(opt, args, kwargs):
        params = [p for group in opt.param_groups for p in group["params"]]
        grads_were_none.append(all(p.grad is None for p in params))
        if record_grads:
            flat = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
            grads.append(torch.cat(flat).clone())

    optimizer.register_step_pre_hook(record)
    logs: list[dict] = []
    trainer = trainer_cls(
        model=model,
        args=training_args(scenario, output_dir, **arg_overrides),
        train_dataset=scenario.examples,
        data_collator=auditor.wrap_collator(scenario.collator),
        optimizers=(optimizer, None),
        callbacks=[_KeepLogs(logs)],
        **(trainer_kwargs or {}),
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return TrainerRun(trainer, auditor, logs, grads, grads_were_none)


class NoKwargsForCausalLM(nn.Module):
    """A causal LM whose forward takes no ``**kwargs`` (stock Trainer then averages micro-batch means)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, attention_mask=None, labels=None, use_cache=None):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        loss = None
        if labels is not None:  # the textbook per-micro-batch mean (what stock Trainer relies on)
            logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
            loss = nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=out.logits)


def big_batch_lrs(scenario: TrainerScenario, total_updates: int) -> list[float]:
    """LR at each update of the scenario's big-batch run."""
    return big_batch_learning_rates(scenario.lr, total_updates, scenario.warmup_steps, scenario.scheduler)