"""AccumTrainer's checkpoints: Trainer's own contents, written atomically, with the batch plan (the completion
marker) and the update history; the resume checks; and the exception a halted run ends with.

Trainer writes where ``_get_output_dir`` says: while a checkpoint is written that is a staging directory,
renamed into place once every rank is done and the marker is written
(:func:`hf_accum.checkpointing.checkpoint.staged_checkpoint`); only then are old checkpoints rotated out.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

from transformers.trainer_utils import rotate_checkpoints

from hf_accum.boundary import Decision
from hf_accum.checkpointing.checkpoint import (
    PLAN_FILE,
    check_checkpoint_files,
    check_resume_engine,
    check_resume_plan,
    checkpoint_path,
    is_complete_checkpoint,
    load_update_history,
    resolve_resume_checkpoint,
    save_batch_plan,
    save_update_history,
    staged_checkpoint,
)
from hf_accum.compat import TRAINER_STATE_NAME
from hf_accum.planning.schedule import BatchPlan

logger = logging.getLogger("hf_accum.trainer")

NOISE_SCALE_FILE = "noise_scale.json"
"""The noise-scale moving averages (``NoiseScaleTracker.state_dict``): a resumed run continues them."""


class TrainerCheckpoints:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.staging_run_dir: str | None = None
        """Set while Trainer writes a checkpoint: where ``_get_output_dir`` points it."""
        self.resume_checkpoint: str | None = None

    # -- resuming -----------------------------------------------------------------------------------------
    def resolve(self, resume_from_checkpoint: Any, current: BatchPlan, auto_find_batch_size: bool) -> Any:
        """``True`` -> the latest complete checkpoint of ``output_dir``; a path is checked against this run's
        engine and batch plan. Returns what to hand to ``Trainer.train``."""
        trainer = self.trainer
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = resolve_resume_checkpoint(True, trainer.args.output_dir)
        if isinstance(checkpoint, str):
            check_checkpoint_files(checkpoint)  # its manifest, before anything loads
            self._check_plan(checkpoint, current, auto_find_batch_size)
        self.resume_checkpoint = checkpoint if isinstance(checkpoint, str) else None
        return checkpoint

    def _check_plan(self, checkpoint: str, current: BatchPlan, auto_find_batch_size: bool) -> None:
        """Refuse to resume with other batch arithmetic: Trainer maps ``global_step`` to a data position
        with the *current* K and micro-batch, and the effective batch would silently change."""
        check_resume_engine(checkpoint, deepspeed=self.trainer.is_deepspeed_enabled)
        # auto_find_batch_size re-derives (micro-batch, K) for the same effective batch.
        if check_resume_plan(checkpoint, current, same_global_batch_ok=auto_find_batch_size) is None:
            logger.warning("%s has no %s; cannot check that the batch plan is unchanged", checkpoint, PLAN_FILE)

    def restore_noise_scale(self, tracker: Any) -> None:
        """Continue the checkpoint's noise-scale averages (nothing for a fresh start or an untracked run)."""
        path = os.path.join(self.resume_checkpoint, NOISE_SCALE_FILE) if self.resume_checkpoint else None
        if tracker is not None and path and os.path.isfile(path):
            with open(path) as handle:
                tracker.load_state_dict(json.load(handle))

    def resumed_history(self) -> list[dict]:
        """The updates before the checkpoint this run resumes from ([] for a fresh start)."""
        return load_update_history(self.resume_checkpoint) if self.resume_checkpoint else []

    # -- writing ------------------------------------------------------------------------------------------
    def save(self, run_dir: str, write: Callable[[], None]) -> None:
        """Run Trainer's ``_save_checkpoint`` (``write``) into a staging directory, then seal and rename."""
        trainer = self.trainer
        with staged_checkpoint(
            run_dir, trainer.state.global_step, commits=trainer.args.should_save,
            barrier=trainer.accelerator.wait_for_everyone, seal=self._seal,
        ) as staged:
            self.staging_run_dir = os.path.dirname(staged)
            try:
                write()
            finally:
                self.staging_run_dir = None
        if trainer.args.should_save:
            rotate_checkpoints(run_dir, trainer.args.save_total_limit, trainer.state.best_model_checkpoint,
                               use_mtime=True)

    def _seal(self, staged: str) -> None:
        """Before the rename: paths Trainer recorded inside the staging directory point to the final one; the
        update history and the batch plan (the completion marker) are written."""
        trainer = self.trainer
        best = trainer.state.best_model_checkpoint
        staging = os.path.dirname(staged)
        if best is not None and os.path.dirname(best) == staging:
            final_dir = os.path.dirname(staging)
            trainer.state.best_model_checkpoint = os.path.join(final_dir, os.path.basename(best))
            if os.path.isfile(os.path.join(staged, TRAINER_STATE_NAME)):
                trainer.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        save_update_history(staged, trainer.update_history())
        noise = trainer.noise_scale_tracker
        if noise is not None:
            with open(os.path.join(staged, NOISE_SCALE_FILE), "w") as handle:
                json.dump(noise.state_dict(), handle)
        save_batch_plan(staged, trainer.batch_plan)

    # -- ending a halted run ------------------------------------------------------------------------------
    def raise_if_halted(self, halting: Decision | None, guard: Any) -> None:
        """After ``Trainer.train`` returned: the exception of a stop or of the inf/NaN limit, naming the
        checkpoint written at the halt (if it is complete)."""
        if halting is None:
            return
        step = self.trainer.state.global_step
        checkpoint = checkpoint_path(self.trainer.args.output_dir, step)
        error = halting.halt_error(guard, step, checkpoint if is_complete_checkpoint(checkpoint) else None)
        if error is None:
            return
        if isinstance(error, SystemExit) and self.trainer.args.should_log:
            logger.warning("%s", error)
        raise error
