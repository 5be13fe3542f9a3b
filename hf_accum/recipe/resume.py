"""The recipe's resume policy: which checkpoint a run continues from, and whether it may.

``training.resume_from_checkpoint`` is ``true`` (the newest checkpoint of the output directory that verifies),
a path, or unset. A requeued job passes ``true`` every time, so ``true`` with no checkpoint yet starts afresh
(removing what killed writes left behind) instead of failing; ``true`` where every checkpoint is damaged is
refused for a person to look at. A checkpoint from other batch arithmetic or another engine is refused before
any model loads (:func:`check_resume_fits`).
"""

from __future__ import annotations

import os
from typing import Any

from hf_accum.checkpointing.checkpoint import (
    check_resume_engine,
    check_resume_plan,
    complete_checkpoints,
    remove_staging_debris,
    resolve_resume_checkpoint,
    verified_resume_checkpoint,
)
from hf_accum.distributed import is_main_process
from hf_accum.planning.schedule import BatchPlan
from hf_accum.recipe.config import ConfigError
from hf_accum.recipe.outputs import say


def resume_checkpoint(given: str | bool | None, out: str, state: str) -> str | None:
    """The checkpoint a run with ``training.resume_from_checkpoint=given`` and ``training.output_dir=out``
    resumes from (None: a fresh start). ``state`` is what :func:`hf_accum.recipe.outputs.check_output_dir`
    found (``"resume"`` or ``"fresh"``).

    Raises :class:`~hf_accum.recipe.config.ConfigError` (exit 2) for an incomplete checkpoint, a path that is
    none, or a damaged one (the named one, or every one), naming the newest that verifies."""
    resume = given
    if resume is True:
        # The newest checkpoint whose files match its manifest (damaged ones are named and skipped).
        resume = verified_resume_checkpoint(out, report=say) if state == "resume" else None
        if resume is None and complete_checkpoints(out):
            resume = True  # every one is damaged: refused below (exit 2), for a person to look at
        elif resume is None:
            _start_afresh(out)
    try:
        return resolve_resume_checkpoint(resume, out)
    except ValueError as error:  # an incomplete checkpoint, or none where one was named
        raise ConfigError(f"training.resume_from_checkpoint: {error}") from None


def _start_afresh(out: str) -> None:
    debris = remove_staging_debris(out) if is_main_process() else []
    cleaned = f" (removed {len(debris)} unfinished checkpoint write(s))" if debris else ""
    say(f"note: training.resume_from_checkpoint=true but no checkpoint exists yet{cleaned}: starting from scratch")


def check_resume_fits(checkpoint: str | None, args: Any, deepspeed: bool) -> None:
    """Refuse a checkpoint written by another engine setting (DeepSpeed's files or ours) or with another
    micro-batch, accumulation or world size (it would misplace the data position); says what resumes."""
    if checkpoint is None:
        return
    check_resume_engine(checkpoint, deepspeed=deepspeed)
    plan = BatchPlan(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size)
    check_resume_plan(checkpoint, plan, same_global_batch_ok=args.auto_find_batch_size)
    say(f"resuming from {checkpoint}")


def checkpoint_step(checkpoint: str | None) -> int:
    """The update a checkpoint directory (``checkpoint-N``) was written after; 0 for None (a fresh start)."""
    name = os.path.basename(os.path.normpath(checkpoint)) if checkpoint else ""
    return int(name.rsplit("-", 1)[1]) if name.startswith("checkpoint-") and name.rsplit("-", 1)[1].isdigit() else 0
