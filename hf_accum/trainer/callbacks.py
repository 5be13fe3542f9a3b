"""The boundary's decisions carried out through Trainer's own flow (``_run_epoch`` is not overridden): a skipped
window must not step the LR scheduler; a checkpoint request or a halt saves a checkpoint; a halt ends training.
And the fp32 accumulation hooks live from the start to the end of training."""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_callback import TrainerControl, TrainerState

from hf_accum.compat import set_optimizer_step_skipped
from hf_accum.trainer.window import TrainerWindow


class BoundaryActions(TrainerCallback):
    def __init__(self, window: TrainerWindow, fp32_grad_accumulation: bool,
                 model: Callable[[], torch.nn.Module | None]) -> None:
        self.window = window
        self.fp32_grad_accumulation = fp32_grad_accumulation
        self.model = model

    # Trainer's callback signature; the optimizer is Accelerate's wrapper (Any: compat sets a private flag on it).
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        model = self.model()
        assert model is not None  # Trainer holds its model while training
        if self.fp32_grad_accumulation:
            self.window.attach_fp32_sums(model)
        self.window.attach_noise_hooks(model)  # noise scale from every micro-batch (else nothing)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        # The model may be used without the trainer afterwards: no hooks left on it.
        self.window.detach_fp32_sums()
        self.window.detach_noise_hooks()

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          optimizer: Any = None, **kwargs: Any) -> None:
        # Between optimizer.step() and Trainer's "was the step skipped?" check: a skipped window is
        # reported as skipped, so Trainer does not step the LR scheduler.
        if self.window.skip_step:
            set_optimizer_step_skipped(optimizer, True)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    optimizer: Any = None, **kwargs: Any) -> None:
        if self.window.skip_step:
            set_optimizer_step_skipped(optimizer, False)
            self.window.skip_step = False
        decision = self.window.step_ended()
        if decision is not None and decision.save:
            control.should_save = True
        if decision is not None and decision.halt is not None:
            control.should_training_stop = True
