"""The Accelerate training loop with exact gradient accumulation.

Built on ``accelerator.accumulate(model)``: it decides, per micro-batch, whether this is the
window's last micro-batch (every K-th, or the last batch of the epoch) and wraps the other
micro-batches in DDP's ``no_sync`` so gradients are all-reduced once per update.

The normalization (see :mod:`hf_accum.accumulation` for the math) works like fairseq's:

1. every micro-batch backpropagates its *summed* token loss -- no look-ahead is needed, so
   streams and short last windows work unchanged;
2. at the window boundary the target counts are all-reduced and the gradients are scaled
   once by ``K * W / N``. ``K`` undoes the fixed ``1 / K`` that ``Accelerator.backward``
   applies to every micro-batch (that fixed factor is what gives a short last window the
   wrong weight ``r / K``); ``W / N`` is :func:`~hf_accum.accumulation.exact_mean_factor`;
3. clip (after unscaling, done by ``accelerator.clip_grad_norm_``), step, and step the LR
   scheduler only if the optimizer step was applied.

The scheduler horizon is planned in updates before training (:mod:`hf_accum.schedule`).

Under DeepSpeed the engine owns the gradients -- it reduces, clips and applies them inside
``accelerator.backward`` of the window's last micro-batch -- so nothing can be rescaled after
backward. There the window is counted *before* backward instead (:func:`_deepspeed_epoch_updates`,
as AccumTrainer does): fetch the window's micro-batches, count their targets, all-reduce once, and
backpropagate ``loss_sum * K * W / N``.

Between updates (:class:`_Supervisor`): a window whose loss or gradients hold an inf/NaN on any rank is
skipped like a window without targets (no optimizer or scheduler step); checkpoints are written every
``save_steps`` updates, on request and on a stop signal (:mod:`hf_accum.checkpoint`, :mod:`hf_accum.control`);
``train(..., resume_from_checkpoint=...)`` continues a run exactly where a checkpoint left it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from itertools import count
from typing import Any, Callable, Iterator, Mapping

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from hf_accum.accumulation import (
    Fp32GradientAccumulator,
    WindowTally,
    WindowTotals,
    drop_gradients_,
    exact_mean_factor,
    global_sum,
    nonfinite_flag,
    rescale_gradients_,
)
from hf_accum.checkpoint import (
    LoopCheckpointer,
    LoopState,
    check_output_dir_writable,
    resolve_resume_checkpoint,
)
from hf_accum.compat import keep_4bit_training_layout
from hf_accum.control import (
    DEFAULT_MAX_CONSECUTIVE_NONFINITE,
    NonFiniteGuard,
    StopSignals,
    TrainingControl,
    TrainingStopped,
)
from hf_accum.distributed import is_partitioned, num_nodes
from hf_accum.fused_loss import LossSumFn, MicroBatchLoss
from hf_accum.loss import (
    LossKind,
    count_targets,
    infer_loss_kind,
    model_problem_type,
    unwrap_model,
)
from hf_accum.schedule import (
    BatchPlan,
    create_update_scheduler,
    epochs_needed,
    planned_updates,
    repeated_examples_warning,
)

logger = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    """Training-loop settings; names follow ``transformers.TrainingArguments`` where they overlap."""

    num_train_epochs: float = 1.0
    """Passes over the data (a fraction counts the started epoch's full windows)."""
    max_steps: int = -1
    """Optimizer updates to run; overrides ``num_train_epochs`` when > 0."""
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    max_grad_norm: float = 1.0
    """Clip the global gradient norm once per update (0 disables clipping)."""
    label_smoothing: float = 0.0
    loss_kind: LossKind | None = None
    """``causal_lm``, ``token`` or ``sequence`` (:data:`hf_accum.loss.LOSS_KIND_SPECS`); when None, inferred
    from the model class, else from the model's own loss on the first micro-batch."""
    fused_loss: bool = True
    """Causal LMs: sum the loss from the last hidden states and the output layer, chunk by chunk,
    never holding the (tokens x vocab) logits (:mod:`hf_accum.fused_loss`). Heads that are not a plain
    linear map (soft-capping, logit scale, ...) and a custom ``loss_sum_fn`` keep the logits path."""
    disable_tqdm: bool = False
    fp32_grad_accumulation: bool = True
    """Sum the micro-batch gradients of bf16/fp16 *weights* in fp32 (single process; with
    mixed_precision='bf16' and fp32 weights, gradients are fp32 anyway)."""
    output_dir: str | None = None
    """Where ``checkpoint-<update>`` directories go (one directory shared by all processes); None: no
    checkpoints."""
    save_strategy: str = "steps"
    """``"steps"`` (every ``save_steps`` updates), ``"epoch"`` (after each epoch's last update) or ``"no"``.
    With an ``output_dir``, a stop signal or request writes a checkpoint whatever the strategy."""
    save_steps: int = 500
    save_total_limit: int | None = None
    """Keep only this many newest checkpoints (older ones are deleted after the new one is complete)."""
    max_consecutive_nonfinite: int = DEFAULT_MAX_CONSECUTIVE_NONFINITE
    """Updates skipped for inf/NaN losses or gradients in a row before the run writes a checkpoint and raises
    :class:`hf_accum.control.NonFiniteLossError`."""
    stop_on_signals: bool = True
    """SIGTERM/SIGUSR1/SIGINT during ``train``: finish the update, checkpoint, raise
    :class:`hf_accum.control.TrainingStopped` (exit code 75, or 130 for Ctrl-C)."""
    eval_strategy: str = "no"
    """With ``train(eval_dataloader=...)``: ``steps`` (every ``eval_steps`` updates and after the last),
    ``epoch`` (after each epoch's last update) or ``no``. Evaluates the exact per-token held-out loss."""
    eval_steps: float | None = None
    """Updates between evaluations for ``eval_strategy='steps'``."""


    @classmethod
    def from_training_arguments(cls, args: Any, **changes: Any) -> "LoopConfig":
        """The loop settings a ``transformers.TrainingArguments`` holds (same names, except that
        ``label_smoothing_factor`` is ``label_smoothing`` and a ``warmup_steps`` below 1 is a ratio)."""
        warmup = args.warmup_steps
        values = {name: getattr(args, name) for name in cls.training_argument_names() if hasattr(args, name)}
        for strategy in ("eval_strategy", "save_strategy"):  # TrainingArguments holds enums
            values[strategy] = str(getattr(getattr(args, strategy), "value", getattr(args, strategy)))
        if values["eval_strategy"] == "steps" and not args.eval_steps:
            values["eval_steps"] = args.logging_steps  # Trainer's rule: eval_steps defaults to logging_steps
        values.update(
            warmup_steps=int(warmup) if warmup >= 1 else 0,
            warmup_ratio=warmup if warmup < 1 else 0.0,
            label_smoothing=args.label_smoothing_factor,
        )
        values.pop("label_smoothing_factor", None)
        return cls(**{**values, **changes})

    @classmethod
    def training_argument_names(cls) -> set[str]:
        """The ``TrainingArguments`` fields this config mirrors."""
        names = {f.name for f in fields(cls)} - {
            "label_smoothing", "loss_kind", "fp32_grad_accumulation", "warmup_ratio", "fused_loss",
            "max_consecutive_nonfinite", "stop_on_signals",
        }
        return names | {"label_smoothing_factor"}


@dataclass
class UpdateLog:
    """One optimizer update, as logged. ``loss`` is the exact per-target mean of the window."""

    step: int
    epoch: float
    loss: float
    learning_rate: float
    grad_norm: float | None
    targets: int
    sequences: int
    padding_fraction: float
    micro_batches: int
    applied: bool = True
    skip_reason: str = ""
    nonfinite: bool = False
    """Skipped because a loss or gradient was inf/NaN."""
    eval_loss: float | None = None
    """Exact per-token held-out loss after this update, when it was evaluated (``eval_strategy``)."""
    aux_loss: float | None = None
    """MoE models: the router-loss term the update also minimized (``coef`` x the token-weighted mean of its
    micro-batches' aux losses; ``loss`` stays the cross-entropy). None for models without one."""

    def tracked(self) -> dict[str, float]:
        """The numbers an experiment tracker gets for this update (names as Trainer logs them)."""
        values = {"train/loss": self.loss, "train/learning_rate": self.learning_rate,
                  "train/tokens_per_update": self.targets, "train/sequences_per_update": self.sequences,
                  "train/padding_fraction": self.padding_fraction, "train/epoch": self.epoch}
        if self.grad_norm is not None:
            values["train/grad_norm"] = self.grad_norm
        if self.eval_loss is not None:
            values["eval/loss"] = self.eval_loss
        if self.aux_loss is not None:
            values["train/aux_loss"] = self.aux_loss
        return values

    def line(self) -> str:
        grad = f"{self.grad_norm:.4f}" if self.grad_norm is not None else "-"
        state = "" if self.applied else f" (skipped: {self.skip_reason})"
        state += f" | eval_loss {self.eval_loss:.4f}" if self.eval_loss is not None else ""
        state += f" | aux_loss {self.aux_loss:.4f}" if self.aux_loss is not None else ""
        return (
            f"update {self.step} | epoch {self.epoch:.2f} | loss {self.loss:.4f} | lr {self.learning_rate:.3e} | "
            f"grad_norm {grad} | tokens {self.targets} | seqs {self.sequences} | "
            f"pad {self.padding_fraction:.1%}{state}"
        )


@dataclass
class TrainResult:
    updates: list[UpdateLog] = field(default_factory=list)
    """Every update of the run, the ones before a resume included."""
    batch_plan: BatchPlan | None = None
    checkpoint: str | None = None
    """The last checkpoint this call wrote."""

    def as_dicts(self) -> list[dict]:
        """Every update as a dict (what a checkpoint keeps of the log, and what a resumed run continues)."""
        return [asdict(u) for u in self.updates]

    @property
    def skipped_nonfinite(self) -> list[int]:
        """Updates skipped because a loss or gradient was inf/NaN."""
        return [u.step for u in self.updates if u.nonfinite]


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_dataloader: Any,
    accelerator: Accelerator,
    config: LoopConfig | None = None,
    lr_scheduler: Any = None,
    loss_sum_fn: LossSumFn | None = None,
    on_update: Callable[[UpdateLog], None] | None = None,
    eval_dataloader: Any = None,
    resume_from_checkpoint: str | bool | None = None,
    control: TrainingControl | None = None,
) -> TrainResult:
    """Train with exact accumulation. ``model``, ``optimizer`` and ``train_dataloader`` must come
    from ``accelerator.prepare``; the accumulation steps K are ``accelerator.gradient_accumulation_steps``.

    ``lr_scheduler``: leave None to get ``config.lr_scheduler_type`` over the planned number of
    updates, or pass a factory ``(optimizer, total_updates) -> scheduler`` (do not ``prepare`` it).
    ``loss_sum_fn(outputs, labels, inputs) -> (loss_sum, n_targets)`` replaces the default token-summed
    cross-entropy (the same signature as ``AccumTrainer.loss_sum_and_count``; ``inputs`` are the forward's
    inputs, labels removed); it must return a *sum* over targets, never a mean. It receives real logits:
    the run then takes the logits path instead of the fused loss (logged).
    ``eval_dataloader`` (one disjoint shard per rank, see :func:`evaluate_loss`): with
    ``config.eval_strategy``, each evaluated update carries the exact per-token held-out loss
    (``UpdateLog.eval_loss``; summed over every batch and rank, then divided once).
    ``resume_from_checkpoint``: a checkpoint directory, or True for the latest complete one in
    ``config.output_dir``; the run continues exactly (same gradients, LRs and data order) with the same
    model, optimizer, dataloader and config as the interrupted run. ``control``: request a checkpoint or a
    stop from a callback or another thread (:class:`hf_accum.control.TrainingControl`).
    """
    config = config or LoopConfig()
    _check_supported(accelerator, train_dataloader)
    resume_path = _check_checkpointing(config, accelerator, resume_from_checkpoint)
    accumulation_steps = accelerator.gradient_accumulation_steps
    micro_batches = _micro_batches_per_epoch(train_dataloader, accelerator, config)
    total_updates = planned_updates(micro_batches or 0, accumulation_steps, config.num_train_epochs, config.max_steps)
    scheduler = (lr_scheduler or _default_scheduler(config))(optimizer, total_updates)
    # Under DeepSpeed the engine owns the (ZeRO-3: partitioned) head weight: the logits path there.
    micro_batch_loss = _micro_batch_loss(model, config, loss_sum_fn, fused_allowed=not _is_deepspeed(accelerator))
    plan = BatchPlan(_micro_batch_size(train_dataloader), accumulation_steps, accelerator.num_processes, num_nodes())
    _log_start(accelerator, plan, micro_batches, total_updates)
    _warn_repeated_samples(accelerator, train_dataloader, plan)

    result = TrainResult(batch_plan=plan)
    progress = tqdm(total=total_updates, desc="updates", disable=config.disable_tqdm or not accelerator.is_main_process)
    params = [p for p in model.parameters() if p.requires_grad]
    fp32_sums = _fp32_accumulator(params, accelerator, config)
    keep_4bit_training_layout(model)  # held-out forwards must not repack 4-bit weights (hf_accum.compat)
    model.train()
    control = control or TrainingControl()
    window = _WindowState(
        WindowTally(device=accelerator.device), fp32_sums, accelerator.scaler is not None, control=control
    )
    supervisor = _Supervisor(config, accelerator, control, window, result, micro_batches, total_updates)
    if config.output_dir or resume_path:
        supervisor.checkpointer = LoopCheckpointer(
            config.output_dir, accelerator, model, optimizer, scheduler, train_dataloader, plan, config.save_total_limit
        )
    if resume_path:
        supervisor.resume(resume_path, progress)
    first = supervisor.first_epoch
    last = epochs_needed(total_updates, micro_batches, accumulation_steps) if micro_batches else None
    epochs = range(first, last) if micro_batches else count(first)
    epoch_updates = _deepspeed_epoch_updates if _is_deepspeed(accelerator) else _epoch_updates
    stop_signals = StopSignals(control, config.stop_on_signals)
    with _cache_disabled(model), _removing(fp32_sums), stop_signals, contextlib.closing(progress):
        for epoch in epochs:
            if len(result.updates) >= total_updates:  # resumed from the run's last checkpoint: nothing left
                break
            _set_epoch(train_dataloader, epoch)
            batches, consumed = supervisor.epoch_batches(train_dataloader, epoch)
            for step_in_epoch, totals, grad_norm, skip_reason, lr in epoch_updates(
                model, optimizer, scheduler, batches, accelerator, params, micro_batch_loss, config, window
            ):
                step_in_epoch += consumed
                update = UpdateLog(
                    step=len(result.updates) + 1,
                    epoch=epoch + (step_in_epoch / micro_batches if micro_batches else 0.0),
                    loss=totals.mean_loss,
                    learning_rate=lr,
                    grad_norm=grad_norm,
                    targets=totals.targets,
                    sequences=totals.sequences,
                    padding_fraction=totals.padding_fraction,
                    micro_batches=totals.micro_batches,
                    applied=not skip_reason,
                    skip_reason=skip_reason,
                    nonfinite=totals.nonfinite,
                    aux_loss=totals.mean_aux_loss if totals.aux_loss_sum else None,
                )
                if _evaluation_due(config, update.step, total_updates, step_in_epoch == micro_batches):
                    update.eval_loss = evaluate_loss(model, eval_dataloader, accelerator, micro_batch_loss)
                result.updates.append(update)
                checkpoint = supervisor.after_update(update, totals, epoch, step_in_epoch)
                _report(update, progress, accelerator, on_update)
                supervisor.stop_if_requested(update, totals, checkpoint)
                if len(result.updates) >= total_updates:
                    break
            if len(result.updates) >= total_updates:
                break
    return result


class _Supervisor:
    """Between updates: checkpoints when due or requested, the stop on a signal or request, the inf/NaN
    limit; and resuming. Every rank runs it in lockstep: its decisions come from all-reduced window totals."""

    def __init__(self, config: LoopConfig, accelerator: Accelerator, control: TrainingControl, window: "_WindowState",
                 result: TrainResult, micro_batches: int | None, total_updates: int) -> None:
        if config.save_strategy == "epoch" and config.output_dir and micro_batches is None:
            raise ValueError(
                "LoopConfig.save_strategy='epoch' needs a dataloader with a length (a stream has no epochs)"
            )
        self.config = config
        self.accelerator = accelerator
        self.control = control
        self.window = window
        self.result = result
        self.micro_batches = micro_batches
        self.guard = NonFiniteGuard(config.max_consecutive_nonfinite)
        self.checkpointer: LoopCheckpointer | None = None
        self.first_epoch = 0
        self.total_updates = total_updates
        self._nonfinite_limit = False

    def resume(self, checkpoint: str, progress) -> None:
        state = self.checkpointer.resume(checkpoint, self.micro_batches)
        self.result.updates = [UpdateLog(**update) for update in state.log_history]
        self.window.magnitude = state.window_magnitude
        self.guard.consecutive = state.consecutive_nonfinite
        self.first_epoch = state.epoch
        progress.update(state.update)
        if self.accelerator.is_main_process:
            if state.planned_updates != self.total_updates:
                logger.warning(
                    "%s was planned for %d updates, this run plans %d: the LR schedule differs from the interrupted "
                    "run's from here on", checkpoint, state.planned_updates, self.total_updates,
                )
            logger.info("resuming from %s: %d updates done, epoch %d, %d micro-batches of it consumed",
                        checkpoint, state.update, state.epoch, state.micro_batches_in_epoch)

    def epoch_batches(self, dataloader: Any, epoch: int) -> tuple[Any, int]:
        if self.checkpointer is None:
            return dataloader, 0
        return self.checkpointer.epoch_batches(dataloader, epoch)

    def after_update(self, update: UpdateLog, totals: WindowTotals, epoch: int, consumed: int) -> str | None:
        """Count inf/NaN skips; write a checkpoint when one is due. Returns the checkpoint written, if any."""
        self._nonfinite_limit = self.guard.record(totals.nonfinite)
        if totals.nonfinite and self.accelerator.is_main_process:
            logger.warning(
                "update %d: %s; skipped (weights, optimizer state and LR schedule untouched), %d in a row "
                "(limit max_consecutive_nonfinite=%d)", update.step, totals.nonfinite_reason, self.guard.consecutive,
                self.guard.max_consecutive,
            )
        if not self.config.output_dir or not self._save_due(update.step, totals, consumed):
            return None
        self.result.checkpoint = self.checkpointer.save(
            LoopState(
                update=update.step, epoch=epoch, micro_batches_in_epoch=consumed,
                planned_updates=self.total_updates, micro_batches_per_epoch=self.micro_batches,
                window_magnitude=self.window.magnitude,
                consecutive_nonfinite=self.guard.consecutive, log_history=self.result.as_dicts(),
            )
        )
        return self.result.checkpoint

    def _save_due(self, step: int, totals: WindowTotals, consumed: int) -> bool:
        config = self.config
        return bool(
            totals.stop_requests
            or totals.checkpoint_requests
            or self._nonfinite_limit
            or (config.save_strategy == "steps" and step % config.save_steps == 0)
            or (config.save_strategy == "epoch" and consumed == self.micro_batches)
        )

    def stop_if_requested(self, update: UpdateLog, totals: WindowTotals, checkpoint: str | None) -> None:
        """Raise :class:`TrainingStopped` after a stop signal or request on any rank, or
        :class:`~hf_accum.control.NonFiniteLossError` at the inf/NaN limit (after the checkpoint)."""
        if totals.stop_requests:
            stopped = TrainingStopped(self.control.stop_reason or "stop requested on another process", update.step,
                                      checkpoint)
            if self.accelerator.is_main_process:
                logger.warning("%s", stopped)
            raise stopped
        if self._nonfinite_limit:
            raise self.guard.error(update.step, checkpoint)


def _check_checkpointing(config: LoopConfig, accelerator: Accelerator, resume_from_checkpoint) -> str | None:
    """Validate the checkpoint settings and probe ``output_dir`` before any work; returns the checkpoint to
    resume from (None for a fresh start)."""
    if config.save_strategy not in ("no", "steps", "epoch"):
        raise ValueError(f"LoopConfig.save_strategy={config.save_strategy!r}; allowed: 'no', 'steps', 'epoch'")
    if config.save_strategy == "steps" and (not isinstance(config.save_steps, int) or config.save_steps < 1):
        raise ValueError(f"LoopConfig.save_steps={config.save_steps!r} must be an integer >= 1")
    limit = config.save_total_limit
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"LoopConfig.save_total_limit={limit!r} must be None or an integer >= 1")
    NonFiniteGuard(config.max_consecutive_nonfinite)  # raises on a bad value
    checkpointing = config.output_dir or resume_from_checkpoint not in (None, False)
    if checkpointing and accelerator.distributed_type == DistributedType.FSDP:
        raise NotImplementedError(
            "loop checkpoints of FSDP-sharded models are not implemented (and FSDP cannot run on this project's "
            "CPU test machines); use engine: trainer (AccumTrainer) for checkpoints with FSDP"
        )
    if config.output_dir:
        check_output_dir_writable(config.output_dir, "LoopConfig.output_dir")
    return resolve_resume_checkpoint(resume_from_checkpoint, config.output_dir)


@dataclass
class _WindowState:
    """What carries from micro-batch to micro-batch: the window's tally, the fp32 gradient sums, and
    the magnitude hint for fp16.

    ``magnitude`` multiplies every micro-batch's summed loss and the boundary divides it out again,
    so it never changes the applied gradient. It exists for fp16's GradScaler only: a summed loss
    is ~N/K times a mean, and its gradients overflow fp16 at scales a mean's would not -- each
    overflow skips a whole window. It is the previous window's ``K * W / N`` (the same on every
    rank, since N is all-reduced), which makes each micro-batch's loss about a per-token mean; the
    first window takes ``W / n`` from the very first micro-batch (one extra all-reduce per run).
    """

    tally: WindowTally
    fp32_sums: Fp32GradientAccumulator | None
    track_magnitude: bool
    """A GradScaler is active (fp16): it also finds and skips inf/NaN gradients itself."""
    magnitude: float | None = None
    control: TrainingControl | None = None

    def scaled(self, loss_sum: torch.Tensor, n_targets: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
        """The loss to backpropagate: the sum, times the window's magnitude when fp16 needs one."""
        if not self.track_magnitude:
            return loss_sum
        if self.magnitude is None:  # first micro-batch of the run: every rank is here together
            first = global_sum(torch.as_tensor(n_targets, dtype=torch.float64, device=accelerator.device), accelerator)
            self.magnitude = accelerator.num_processes / max(1.0, float(first))
        return loss_sum * self.magnitude

    def unscale_factor(self) -> float:
        return 1.0 / self.magnitude if self.track_magnitude else 1.0

    def next_magnitude(self, totals: WindowTotals, accelerator: Accelerator) -> None:
        if self.track_magnitude and totals.targets > 0:
            self.magnitude = accelerator.gradient_accumulation_steps * accelerator.num_processes / totals.targets

    def mark_boundary(self, params: list[torch.nn.Parameter]) -> None:
        """Before the window's all-reduce: this rank's inf/NaN-gradient flag and its pending stop/checkpoint
        requests join the tally, so every rank takes the same decision from the same sums."""
        gradients: torch.Tensor | bool = False
        if not self.track_magnitude:  # under fp16 the GradScaler skips inf/NaN gradients (and lowers its scale)
            pending = self.fp32_sums.pending_sums() if self.fp32_sums is not None else []
            gradients = nonfinite_flag([p.grad for p in params] + pending, self.tally.device)
        control = self.control
        self.tally.mark_boundary(
            nonfinite_gradients=gradients,
            stop_requested=control is not None and control.stop_reason is not None,
            checkpoint_requested=control is not None and control.take_checkpoint_request(),
        )


def _epoch_updates(
    model, optimizer, scheduler, dataloader, accelerator, params, micro_batch_loss, config, window: _WindowState
) -> Iterator[tuple[int, WindowTotals, float | None, str, float]]:
    """Run one epoch; yield ``(micro_batches_done, totals, grad_norm, skip_reason, lr)`` per update."""
    for step, batch in enumerate(dataloader, start=1):
        with accelerator.accumulate(model):
            labels, inputs = _split_labels(batch)
            _, loss_sum, n_targets = micro_batch_loss(model, inputs, labels)
            # Backward of the *sum* (times a constant of the window): the one normalization is at the boundary.
            accelerator.backward(window.scaled(loss_sum, n_targets, accelerator))
            window.tally.add(loss_sum, n_targets, batch, aux_sum=micro_batch_loss.aux_sum)
            if not accelerator.sync_gradients:
                continue
            window.mark_boundary(params)
            totals = window.tally.reduce(accelerator)
            window.tally.reset()
            lr = scheduler.get_last_lr()[0]
            grad_norm, skip_reason = _apply_update(optimizer, scheduler, accelerator, params, totals, config, window)
            window.next_magnitude(totals, accelerator)
        yield step, totals, grad_norm, skip_reason, lr


def _deepspeed_epoch_updates(
    model, optimizer, scheduler, dataloader, accelerator, params, micro_batch_loss, config, window: _WindowState
) -> Iterator[tuple[int, WindowTotals, float | None, str, float]]:
    """One epoch under DeepSpeed; yields like :func:`_epoch_updates`.

    The engine applies the update inside ``accelerator.backward`` of the window's last micro-batch
    (reduce, clip at its ``gradient_clipping``, step), so the normalization goes into the loss:
    ``loss_sum * K * W / N`` with ``N`` counted over the window's micro-batches on all ranks before
    any backward. ``engine.backward`` divides every loss by its ``gradient_accumulation_steps``
    (``scale_wrt_gas``, the engine's own K) and ZeRO averages gradients over the ``W`` data-parallel
    ranks; ``K * W / N`` undoes both and leaves ``grad(sum of all targets' losses) / N``.
    A window without targets is skipped whole: no forward, no engine step, no scheduler step.
    """
    engine = accelerator.deepspeed_engine_wrapped.engine
    _check_deepspeed_clipping(engine, config)
    kind = micro_batch_loss.kind or infer_loss_kind(model)
    step = 0
    for batches in _windows(dataloader, accelerator.gradient_accumulation_steps):
        step += len(batches)
        n_window = _window_target_count(batches, kind, accelerator)
        lr = scheduler.get_last_lr()[0]
        if n_window == 0:
            yield step, _tally_skipped_window(batches, window, accelerator), None, "no targets in window", lr
            continue
        totals = _deepspeed_window(model, batches, n_window, engine, accelerator, micro_batch_loss, window)
        skipped = accelerator.optimizer_step_was_skipped  # fp16 overflow: the engine skipped the step
        if not skipped:
            with warnings.catch_warnings():
                # The engine stepped its own copy of the optimizer, not the object the scheduler
                # wraps, so torch believes the scheduler runs first. It does not: the LR at update n
                # is the big batch's (tested), so the "skipping the first value" warning is false here.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
                scheduler.step()
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        yield step, totals, grad_norm, "inf/nan gradients (fp16 loss scale lowered)" if skipped else "", lr


def _deepspeed_window(model, batches, n_window: int, engine, accelerator, micro_batch_loss, window: _WindowState):
    """Forward and backward every micro-batch of one window; the engine steps on the last one."""
    # K undoes the engine's own 1/K (engine.backward's scale_wrt_gas); W / N is the exact mean over ranks.
    factor = engine.gradient_accumulation_steps() * exact_mean_factor(n_window, accelerator.num_processes)
    for index, batch in enumerate(batches):
        # The engine's boundary (reduce + step) is the window's last micro-batch, short windows included.
        # Set by hand, as Trainer._run_epoch does for its prefetched windows: accumulate() would see
        # the dataloader's end while the last window's first micro-batch is still being processed.
        accelerator.gradient_state._set_sync_gradients(index == len(batches) - 1)
        labels, inputs = _split_labels(batch)
        _, loss_sum, n_targets = micro_batch_loss(model, inputs, labels)
        accelerator.backward(loss_sum * factor)
        window.tally.add(loss_sum, n_targets, batch, aux_sum=micro_batch_loss.aux_sum)
    totals = window.tally.reduce(accelerator)
    window.tally.reset()
    _check_window_count(totals, n_window)
    return totals


def _tally_skipped_window(batches, window: _WindowState, accelerator) -> WindowTotals:
    """Totals (sequences, padding) of a window without targets, which runs no forward at all."""
    for batch in batches:
        window.tally.add(torch.zeros((), device=accelerator.device), torch.zeros(()), batch)
    totals = window.tally.reduce(accelerator)
    window.tally.reset()
    return totals


def _windows(dataloader, size: int) -> Iterator[list]:
    """The dataloader's micro-batches in windows of ``size``; the epoch's last window may be shorter."""
    window = []
    for batch in dataloader:
        window.append(batch)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def _window_target_count(batches, kind: LossKind, accelerator: Accelerator) -> int:
    """Targets in the window's micro-batches on every rank: one all-reduce per window."""
    local = sum(count_targets(batch["labels"], kind).to(accelerator.device, torch.float64) for batch in batches)
    return int(round(float(global_sum(torch.as_tensor(local, dtype=torch.float64), accelerator))))


def _check_window_count(totals: WindowTotals, counted: int) -> None:
    if totals.targets != counted:
        raise ValueError(
            f"loss_sum_fn counted {totals.targets} targets in this window but count_targets counted {counted}; "
            "the normalization uses the latter, so loss_sum_fn must sum over exactly the targets of "
            "hf_accum.loss.count_targets"
        )


def _check_deepspeed_clipping(engine, config: LoopConfig) -> None:
    """The engine clips (at its config's ``gradient_clipping``); it must be the loop's ``max_grad_norm``."""
    clipping = float(engine.gradient_clipping() or 0.0)
    if clipping != float(config.max_grad_norm or 0.0):
        raise ValueError(
            f"DeepSpeed clips at gradient_clipping={clipping} but LoopConfig.max_grad_norm={config.max_grad_norm}; "
            "build the Accelerator with hf_accum.distributed.loop_accelerator (it fills the config's \"auto\" "
            "from max_grad_norm) or make the two equal"
        )


def _is_deepspeed(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def _apply_update(optimizer, scheduler, accelerator, params, totals: WindowTotals, config, window: _WindowState):
    """Scale to the exact mean, clip, step. Returns ``(grad_norm, skip_reason)``; '' when applied."""
    fp32_sums = window.fp32_sums
    if totals.targets == 0 or totals.nonfinite:
        # No target anywhere in the window, or an inf/NaN loss or gradient on some rank (all ranks agree: counts
        # and flags were all-reduced). Nothing of the window may reach the weights: no mean exists, and even
        # zero gradients would let AdamW move weights via momentum/decay. No optimizer step (its moments and
        # step count stay) and no scheduler step.
        if fp32_sums is not None:
            fp32_sums.clear()
        drop_gradients_(params)
        return None, totals.nonfinite_reason or "no targets in window"
    # accelerator.backward divided each micro-batch by K (and we multiplied by the magnitude hint):
    # replace both by the exact W / N.
    factor = accelerator.gradient_accumulation_steps * exact_mean_factor(totals.targets, accelerator.num_processes)
    factor *= window.unscale_factor()
    if fp32_sums is not None:
        fp32_sums.write_gradients_(factor)  # low-precision weights: scaled in fp32, rounded once
    rescale_gradients_(params if fp32_sums is None else fp32_sums.other_parameters(params), factor)
    grad_norm = None
    if config.max_grad_norm and config.max_grad_norm > 0:
        grad_norm = float(accelerator.clip_grad_norm_(params, config.max_grad_norm))
    optimizer.step()
    skipped = accelerator.optimizer_step_was_skipped  # fp16 overflow: no update, so no scheduler step
    if not skipped:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, "inf/nan gradients (fp16 loss scale lowered)" if skipped else ""


def _fp32_accumulator(params, accelerator: Accelerator, config: LoopConfig) -> Fp32GradientAccumulator | None:
    if not config.fp32_grad_accumulation or not any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        return None
    if _is_deepspeed(accelerator):
        return None  # DeepSpeed accumulates in its own buffers (its config's data_types.grad_accum_dtype)
    if accelerator.num_processes > 1:
        raise NotImplementedError(
            "fp32 gradient accumulation for bf16/fp16 weights is single-process only (DDP all-reduces .grad "
            "buckets itself). Keep fp32 weights with Accelerator(mixed_precision='bf16') -- gradients are then "
            "fp32 -- or pass LoopConfig(fp32_grad_accumulation=False) to accept bf16 accumulation."
        )
    return Fp32GradientAccumulator(params)


@contextlib.contextmanager
def _removing(fp32_sums: Fp32GradientAccumulator | None):
    try:
        yield
    finally:
        if fp32_sums is not None:
            fp32_sums.remove()


def _micro_batch_loss(
    model: torch.nn.Module, config: LoopConfig, loss_sum_fn: LossSumFn | None, fused_allowed: bool = True
) -> MicroBatchLoss:
    """Forward + summed loss per micro-batch: fused for causal LMs unless a custom loss needs the logits."""
    if loss_sum_fn is not None and config.fused_loss:
        logger.info("a custom loss_sum_fn receives the logits: this run takes the logits path, not the fused loss")
    return MicroBatchLoss(
        config.loss_kind, config.label_smoothing, model_problem_type(model), loss_sum_fn,
        fused=config.fused_loss and loss_sum_fn is None and fused_allowed,
    )


def _evaluation_due(config: LoopConfig, step: int, total_updates: int, epoch_ended: bool) -> bool:
    if config.eval_strategy == "epoch":
        return epoch_ended
    if config.eval_strategy == "steps":
        every = max(1, int(config.eval_steps or 1))
        return step % every == 0 or step == total_updates
    return False


@torch.no_grad()
def evaluate_loss(model, dataloader, accelerator: Accelerator, micro_batch_loss: MicroBatchLoss) -> float:
    """The exact per-token loss of a held-out set: every batch's summed loss and target count are
    added up on each rank and all-reduced once, then divided once (not a mean of batch means).

    Each rank evaluates the batches *its* ``dataloader`` yields: give each rank a disjoint shard
    (e.g. ``examples[rank::world_size]``) and do not ``prepare`` it -- a prepared loader with
    ``even_batches`` repeats examples to even out the ranks, which would count them twice. The
    forward runs on the unwrapped model, so ranks may hold different numbers of batches (a DDP
    forward would broadcast buffers, a collective, per batch) -- except under ZeRO-3, where every
    forward gathers the parameters from all ranks: there the ranks with fewer batches run extra
    forwards that count no target. Every rank must call it (it ends in one all-reduce)."""
    if dataloader is None:
        raise ValueError("LoopConfig.eval_strategy is set but train() got no eval_dataloader")
    tally = WindowTally(device=accelerator.device)
    bare = accelerator.unwrap_model(model)
    was_training = bare.training
    bare.eval()
    inputs = None
    batches = dataloader if hasattr(dataloader, "__len__") else list(dataloader)
    shortfall = _forward_shortfall(bare, batches, accelerator)  # agreed before any forward
    for batch in batches:
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        labels, inputs = _split_labels(batch)
        with accelerator.autocast():
            _, loss_sum, n_targets = micro_batch_loss(bare, inputs, labels)
        tally.add(loss_sum, n_targets, batch)
    if shortfall:
        _extra_forwards(bare, shortfall, inputs, accelerator)
    bare.train(was_training)
    return tally.reduce(accelerator).mean_loss


def _forward_shortfall(model, batches, accelerator: Accelerator) -> int:
    """How many forwards this rank must add to run as many as the rank with the most batches: under
    ZeRO-3 each forward is a collective (parameter gathers), and a rank that stopped early would leave
    the others waiting forever. 0 for a model that is not partitioned."""
    if not is_partitioned(model):
        return 0
    most = torch.tensor([len(batches)], device=accelerator.device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most) - len(batches)


def _extra_forwards(model, count: int, inputs: dict | None, accelerator: Accelerator) -> None:
    """Forwards that count nothing: the last batch again, or one token where this rank had no batch."""
    if inputs is None:
        inputs = {"input_ids": torch.zeros((1, 1), dtype=torch.long, device=accelerator.device)}
    with torch.no_grad(), accelerator.autocast():
        for _ in range(count):
            model(**inputs)


def _split_labels(batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict]:
    """Labels stay out of the forward: the model would otherwise compute its own (discarded) loss."""
    if "labels" not in batch:
        raise KeyError(f"batch has no 'labels' (keys: {sorted(batch)}); the collator must provide them")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return batch["labels"], inputs


@contextlib.contextmanager
def _cache_disabled(model: torch.nn.Module):
    """``use_cache=False`` while training: with a KV cache, padding-free packed rows (position_ids)
    lose their packed-sequence mask and attend across sequences."""
    config = getattr(unwrap_model(model), "config", None)
    previous = getattr(config, "use_cache", None)
    if config is not None and previous is not None:
        config.use_cache = False
    try:
        yield
    finally:
        if config is not None and previous is not None:
            config.use_cache = previous


def _default_scheduler(config: LoopConfig):
    def factory(optimizer, total_updates):
        return create_update_scheduler(
            optimizer, total_updates, config.lr_scheduler_type, config.warmup_steps, config.warmup_ratio
        )

    return factory


def _check_supported(accelerator: Accelerator, dataloader: Any) -> None:
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
            raise ValueError(
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


def _set_epoch(dataloader: Any, epoch: int) -> None:
    if hasattr(dataloader, "set_epoch"):
        dataloader.set_epoch(epoch)


def _warn_repeated_samples(accelerator: Accelerator, dataloader: Any, plan: BatchPlan) -> None:
    dataset = getattr(dataloader, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        message = repeated_examples_warning(len(dataset), plan, getattr(accelerator, "even_batches", True))
        if message:
            logger.warning(message)


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


def _report(update: UpdateLog, progress, accelerator: Accelerator, on_update) -> None:
    progress.update(1)
    progress.set_postfix(loss=f"{update.loss:.4f}", lr=f"{update.learning_rate:.2e}", refresh=False)
    if accelerator.is_main_process:
        logger.debug(update.line())  # the caller decides what to print (on_update); the bar shows progress
    if on_update is not None:
        on_update(update)
