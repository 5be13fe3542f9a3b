"""What a loop run will do, decided before its first micro-batch: micro-batches per epoch, updates planned
(the LR horizon, :func:`hf_accum.planning.schedule.planned_updates`), the batch arithmetic; said once at the start."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from itertools import count
from typing import Any, Iterable

import torch
from accelerate import Accelerator

from hf_accum.distributed import num_nodes
from hf_accum.loop.config import LoopConfig, LoopConfigError
from hf_accum.loop.windows import AutoRampPlan, WindowPlan, auto_plan, ramp_plan, token_plan
from hf_accum.losses.token_loss import infer_loss_kind
from hf_accum.planning.auto_ramp import is_auto
from hf_accum.planning.schedule import BatchPlan, epochs_needed, planned_updates, warn_repeated_examples

logger = logging.getLogger("hf_accum.loop")


@dataclass(frozen=True)
class RunPlan:
    micro_batches: int | None
    """Micro-batches per epoch on each process (the same on all); None for a stream."""
    total_updates: int
    batch: BatchPlan
    windows: WindowPlan | None = None
    """Ramp-up or token budget: every update's window, planned (None: fixed K windows)."""
    auto: AutoRampPlan | None = None
    """``rampup_batch_size='auto'``: windows decided between updates; ``total_updates`` is then an upper bound."""

    @classmethod
    def of(cls, dataloader: Any, accelerator: Accelerator, config: LoopConfig, model: Any = None) -> RunPlan:
        """Plan the run and say so (main process); warns when examples repeat to even out the ranks."""
        accumulation_steps = accelerator.gradient_accumulation_steps
        micro_batches = _micro_batches_per_epoch(dataloader, accelerator, config)
        total = planned_updates(micro_batches or 0, accumulation_steps, config.num_train_epochs, config.max_steps)
        batch = BatchPlan(_micro_batch_size(dataloader), accumulation_steps, accelerator.num_processes, num_nodes())
        if is_auto(config.rampup_batch_size):
            return cls._auto(micro_batches, accelerator, config, batch, dataloader)
        windows = _window_plan(dataloader, accelerator, config, micro_batches, batch, model)
        plan = cls(micro_batches, windows.total_updates if windows else total, batch, windows)
        if windows is None:
            _log_start(accelerator, batch, micro_batches, plan.total_updates)
        elif accelerator.is_main_process:
            logger.info("micro-batch %d x %d processes; %d micro-batches/epoch per process; %s; %d updates planned",
                        batch.micro_batch_size, batch.num_processes, micro_batches, windows.description,
                        plan.total_updates)
        if accelerator.is_main_process:
            dataset = getattr(dataloader, "dataset", None)
            warn_repeated_examples(logger, dataset, batch, getattr(accelerator, "even_batches", True))
        return plan

    @classmethod
    def _auto(cls, micro_batches: int | None, accelerator: Accelerator, config: LoopConfig, batch: BatchPlan,
              dataloader: Any) -> RunPlan:
        if micro_batches is None:
            raise LoopConfigError("LoopConfig.rampup_batch_size='auto' needs a dataloader with a length (its LR "
                                  "schedule runs over the run's samples); allowed with a stream: None")
        auto = auto_plan(config.rampup_auto, micro_batches, batch.micro_batch_size, batch.accumulation_steps,
                         batch.num_processes, config.num_train_epochs)
        if accelerator.is_main_process:
            logger.info("micro-batch %d x %d processes; %d micro-batches/epoch per process (the auto ramp's line "
                        "follows)", batch.micro_batch_size, batch.num_processes, micro_batches)
            warn_repeated_examples(logger, getattr(dataloader, "dataset", None), batch,
                                   getattr(accelerator, "even_batches", True))
        return cls(micro_batches, auto.max_updates, batch, None, auto)

    @property
    def window_digest(self) -> str | None:
        """What a checkpoint stores of the windows: the planned windows' fingerprint, ``"auto"`` for the auto ramp
        (its state is in the scheduler's), None for fixed K; a resume under another one is refused."""
        if self.windows is not None:
            return self.windows.digest()
        return "auto" if self.auto is not None else None

    def epochs(self, first: int) -> Iterable[int]:
        """The epochs to run from ``first`` (endless for a stream: ``max_steps`` ends it)."""
        if self.micro_batches is None:
            return count(first)
        if self.windows is not None:
            return range(first, len(self.windows.epochs))
        if self.auto is not None:
            return range(first, len(self.auto.epoch_micro_batches))
        return range(first, epochs_needed(self.total_updates, self.micro_batches, self.batch.accumulation_steps))


def _window_plan(dataloader: Any, accelerator: Accelerator, config: LoopConfig, micro_batches: int | None,
                 batch: BatchPlan, model: Any) -> WindowPlan | None:
    """The planned windows of a ramp-up or a token budget (None for fixed K)."""
    if not config.planned_windows:
        return None
    if micro_batches is None:
        raise LoopConfigError(
            "LoopConfig.rampup_batch_size / tokens_per_update need a dataloader with a length (a stream cannot be "
            "planned); allowed with a stream: neither"
        )
    if config.rampup_batch_size is not None:
        assert not isinstance(config.rampup_batch_size, str)  # 'auto' is RunPlan._auto's
        return ramp_plan(config.rampup_batch_size, micro_batches, batch.micro_batch_size, batch.accumulation_steps,
                         accelerator.num_processes, config.num_train_epochs, config.max_steps)
    kind = config.loss_kind or infer_loss_kind(model)
    assert config.tokens_per_update is not None  # planned_windows without a ramp-up: a token budget
    return token_plan(dataloader, accelerator, kind, config.tokens_per_update, config.num_train_epochs,
                      config.max_steps)


def check_supported(accelerator: Accelerator, dataloader: Any) -> None:
    if not hasattr(dataloader, "end_of_dataloader") and not hasattr(dataloader, "gradient_state"):
        raise TypeError(
            "pass a dataloader returned by accelerator.prepare: accumulate() needs it to close the short "
            "last window of an epoch"
        )
    if not accelerator.gradient_state.sync_with_dataloader:
        raise ValueError(
            "GradientAccumulationPlugin(sync_with_dataloader=False) carries the short last window into the next "
            "epoch, where its targets would be counted in no window; hf_accum needs sync_with_dataloader=True"
        )


def _micro_batches_per_epoch(dataloader: Any, accelerator: Accelerator, config: LoopConfig) -> int | None:
    """Micro-batches per epoch on this process, the same on every process; None for a stream."""
    try:
        micro_batches = len(dataloader)
    except TypeError:
        if not config.max_steps or config.max_steps <= 0:
            raise LoopConfigError(
                "the dataloader has no length (a stream): set LoopConfig(max_steps=...) so the LR schedule "
                "has a horizon in updates"
            ) from None
        return None
    if accelerator.num_processes > 1:
        lengths = accelerator.gather(torch.tensor([micro_batches], device=accelerator.device)).tolist()
        if min(lengths) != max(lengths):
            # A rank with fewer micro-batches would leave the others waiting in the last window's all-reduce.
            raise ValueError(
                f"micro-batches per epoch differ across processes ({lengths}): with even_batches=False the "
                "dataset must be a multiple of micro_batch_size x num_processes; keep Accelerate's even_batches=True "
                "or trim the dataset"
            )
    return micro_batches


def _micro_batch_size(dataloader: Any) -> int:
    size = getattr(dataloader, "total_batch_size", None)
    per_process = getattr(dataloader, "batch_size", None)
    if per_process is None and getattr(dataloader, "batch_sampler", None) is not None:
        per_process = getattr(dataloader.batch_sampler, "batch_size", None)
    return int(per_process or size or 1)


def _log_start(accelerator: Accelerator, plan: BatchPlan, micro_batches: int | None, total_updates: int) -> None:
    if not accelerator.is_main_process:
        return
    if micro_batches is None:
        logger.info("%s; a stream: %d updates planned (max_steps)", plan.describe(), total_updates)
        return
    short = micro_batches % plan.accumulation_steps
    logger.info(
        "%s; %d micro-batches/epoch per process -> %d updates/epoch%s; %d updates planned",
        plan.describe(),
        micro_batches,
        math.ceil(micro_batches / plan.accumulation_steps),
        f" (last window {short} micro-batches, normalized by its own token count)" if short else "",
        total_updates,
    )
