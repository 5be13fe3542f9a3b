"""Between updates: checkpoints when due or decided by the boundary, the halt (stop or inf/NaN limit), resuming.

Every rank runs it in lockstep: its inputs are the boundary's decisions, which come from all-reduced sums.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from accelerate import Accelerator

from hf_accum.boundary import Decision, UpdateBoundary
from hf_accum.checkpointing.checkpoint import (
    LOOP_STATE_FILE,
    ResumeMismatchError,
    check_output_dir_writable,
    resolve_resume_checkpoint,
)
from hf_accum.checkpointing.loop_checkpoint import LoopCheckpointer, LoopState
from hf_accum.loop.config import LoopConfig, LoopConfigError
from hf_accum.loop.plan import RunPlan
from hf_accum.loop.steppers import Stepper
from hf_accum.records import TrainResult, UpdateLog

logger = logging.getLogger("hf_accum.loop")


class Supervisor:
    """Checkpoints (every ``save_steps``, each epoch, or when the boundary decides one is due), the halt after
    a stop or at the inf/NaN limit, and resuming a run where a checkpoint left it."""

    def __init__(self, config: LoopConfig, accelerator: Accelerator, stepper: Stepper, result: TrainResult,
                 plan: RunPlan, checkpointer: LoopCheckpointer | None) -> None:
        if config.save_strategy == "epoch" and config.output_dir and plan.micro_batches is None:
            raise LoopConfigError(
                "LoopConfig.save_strategy='epoch' needs a dataloader with a length (a stream has no epochs)"
            )
        self.config = config
        self.accelerator = accelerator
        self.stepper = stepper
        self.boundary: UpdateBoundary = stepper.boundary
        self.result = result
        self.plan = plan
        self.checkpointer = checkpointer
        self.first_epoch = 0

    def resume(self, checkpoint: str, progress: Any) -> None:
        assert self.checkpointer is not None  # a resume path comes with a checkpointer (build_checkpointer)
        # Before anything is loaded: another kind of windows has another kind of LR scheduler state.
        self._check_window_plan(checkpoint, _stored_window_plan(checkpoint))
        state = self.checkpointer.resume(checkpoint, self.plan.micro_batches)
        self.result.updates = [UpdateLog(**update) for update in state.log_history]
        self.stepper.magnitude.value = state.window_magnitude
        self.boundary.guard.consecutive = state.consecutive_nonfinite
        if self.boundary.noise is not None and state.noise_scale:
            self.boundary.noise.load_state_dict(state.noise_scale)
        self.first_epoch = state.epoch
        progress.update(state.update)
        if self.accelerator.is_main_process:
            if state.planned_updates != self.plan.total_updates:
                logger.warning(
                    "%s was planned for %d updates, this run plans %d: the LR schedule differs from the interrupted "
                    "run's from here on", checkpoint, state.planned_updates, self.plan.total_updates,
                )
            logger.info("resuming from %s: %d updates done, epoch %d, %d micro-batches of it consumed",
                        checkpoint, state.update, state.epoch, state.micro_batches_in_epoch)

    def _check_window_plan(self, checkpoint: str, stored: str | None) -> None:
        if self.plan.window_digest != stored:
            raise ResumeMismatchError(
                f"cannot resume from {checkpoint}: it was planned with other windows (rampup_batch_size / "
                "tokens_per_update or the data differ); resume with the checkpoint's settings and data"
            )

    def epoch_batches(self, dataloader: Any, epoch: int) -> tuple[Any, int]:
        """The epoch's micro-batches still to train (a resumed epoch skips what was consumed) and how many
        were consumed already."""
        if self.checkpointer is None:
            return dataloader, 0
        return self.checkpointer.epoch_batches(dataloader, epoch)

    def after_update(self, update: UpdateLog, decision: Decision, epoch: int, consumed: int) -> str | None:
        """Write a checkpoint when one is due; returns it (None when none was written)."""
        if not self.config.output_dir or not self._save_due(update.step, decision, consumed):
            return None
        assert self.checkpointer is not None  # an output directory comes with a checkpointer
        self.result.checkpoint = self.checkpointer.save(
            LoopState(
                update=update.step, epoch=epoch, micro_batches_in_epoch=consumed,
                planned_updates=self.plan.total_updates, micro_batches_per_epoch=self.plan.micro_batches,
                window_magnitude=self.stepper.magnitude.value,
                consecutive_nonfinite=self.boundary.guard.consecutive, log_history=self.result.as_dicts(),
                window_plan=self.plan.window_digest,
                noise_scale=self.boundary.noise.state_dict() if self.boundary.noise is not None else None,
            )
        )
        return self.result.checkpoint

    def _save_due(self, step: int, decision: Decision, consumed: int) -> bool:
        config = self.config
        return bool(
            decision.save
            or (config.save_strategy == "steps" and step % config.save_steps == 0)
            or (config.save_strategy == "epoch" and consumed == self.plan.micro_batches)
        )

    def halt_if_decided(self, update: UpdateLog, decision: Decision, checkpoint: str | None) -> None:
        """Raise :class:`~hf_accum.control.TrainingStopped` after a stop signal or request on any rank, or
        :class:`~hf_accum.control.NonFiniteLossError` at the inf/NaN limit (after the checkpoint)."""
        error = decision.halt_error(self.boundary.guard, update.step, checkpoint)
        if error is None:
            return
        if self.accelerator.is_main_process and isinstance(error, SystemExit):
            logger.warning("%s", error)
        raise error


def _stored_window_plan(checkpoint: str) -> str | None:
    with open(os.path.join(checkpoint, LOOP_STATE_FILE)) as handle:
        return json.load(handle).get("window_plan")


def build_checkpointer(
    config: LoopConfig, accelerator: Accelerator, resume_from_checkpoint: Any, model: Any, optimizer: Any,
    scheduler: Any, dataloader: Any, plan: RunPlan,
) -> tuple[LoopCheckpointer | None, str | None]:
    """Probe ``output_dir`` before any work; the checkpointer (None without checkpoints) and the checkpoint to
    resume from (None for a fresh start)."""
    if config.output_dir:
        check_output_dir_writable(config.output_dir, "LoopConfig.output_dir")
    resume_path = resolve_resume_checkpoint(resume_from_checkpoint, config.output_dir)
    if not (config.output_dir or resume_path):
        return None, None
    checkpointer = LoopCheckpointer(config.output_dir, accelerator, model, optimizer, scheduler, dataloader,
                                    plan.batch, config.save_total_limit)
    return checkpointer, resume_path
