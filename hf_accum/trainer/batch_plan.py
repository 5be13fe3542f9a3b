"""AccumTrainer's batch arithmetic: the effective batch the user asked for (kept through
``auto_find_batch_size``), the :class:`~hf_accum.planning.schedule.BatchPlan` said at the start, and the LR horizon in
updates (:func:`hf_accum.planning.schedule.planned_updates`, short last windows counted)."""

from __future__ import annotations

import logging
from typing import Any

from transformers.trainer_utils import has_length

from hf_accum.compat import set_train_batch_size, train_batch_size
from hf_accum.distributed import num_nodes
from hf_accum.planning.schedule import BatchPlan, planned_updates, warn_repeated_examples

logger = logging.getLogger("hf_accum.trainer")


class BatchPlanner:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        # The effective batch the user asked for; auto_find_batch_size must keep it.
        self.requested = (train_batch_size(trainer), trainer.args.gradient_accumulation_steps)
        self.micro_batches_per_epoch: int | None = None
        self.plan: BatchPlan | None = None

    def requested_plan(self) -> BatchPlan:
        """The plan the user asked for (what a checkpoint to resume from must match)."""
        micro_batch, accumulation = self.requested
        trainer = self.trainer
        return BatchPlan(micro_batch // max(1, trainer.args.n_gpu), accumulation, trainer.accelerator.num_processes)

    def keep_effective_batch(self) -> None:
        """auto_find_batch_size shrinks the micro-batch after an OOM (accelerate: x0.9 per retry); raise K so
        that micro-batch x K stays the requested number of sequences per device.

        The offered size need not divide that number (4 -> 3 for 8 = 4 x 2), so we take the largest
        divisor not above it (3 -> 2, K = 4): still below the size that ran out of memory, and exact.
        """
        trainer = self.trainer
        requested_batch, requested_steps = self.requested
        offered = train_batch_size(trainer)
        if offered == requested_batch:
            trainer.args.gradient_accumulation_steps = requested_steps
            return
        sequences = requested_batch * requested_steps
        micro_batch = max(size for size in range(1, offered + 1) if sequences % size == 0)
        steps = sequences // micro_batch
        logger.warning(
            "auto_find_batch_size: micro-batch %d -> %d (offered %d), gradient_accumulation_steps %d -> %d: "
            "effective batch kept at %d sequences per device",
            requested_batch, micro_batch, offered, requested_steps, steps, sequences,
        )
        set_train_batch_size(trainer, micro_batch)
        trainer.args.gradient_accumulation_steps = steps

    def planned(self, dataloader: Any) -> BatchPlan:
        """The plan of the dataloader Trainer just built; said once (with the repeated-examples warning)."""
        trainer = self.trainer
        self.micro_batches_per_epoch = len(dataloader) if has_length(dataloader) else None
        self.plan = BatchPlan(
            train_batch_size(trainer) // max(1, trainer.args.n_gpu),
            trainer.args.gradient_accumulation_steps,
            trainer.accelerator.num_processes,
            num_nodes(),
        )
        if trainer.args.should_log:
            logger.info("%s (sequences per update)", self.plan.describe())
            warn_repeated_examples(logger, trainer.train_dataset, self.plan, trainer.accelerator.even_batches)
        return self.plan

    def lr_horizon(self, num_training_steps: int) -> int:
        """Horizon in optimizer updates, from the data plan (short last windows count as updates)."""
        if self.micro_batches_per_epoch is None:
            return num_training_steps
        args = self.trainer.args
        planned = planned_updates(self.micro_batches_per_epoch, args.gradient_accumulation_steps,
                                  args.num_train_epochs, args.max_steps)
        if planned != num_training_steps:
            logger.warning("LR horizon: Trainer planned %d steps, the data plan has %d updates; using %d",
                           num_training_steps, planned, planned)
        if args.should_log:
            logger.info("LR schedule over %d updates (%d micro-batches per epoch per process)",
                        planned, self.micro_batches_per_epoch)
        return planned
