"""``train()``: the Accelerate loop, read as a table of contents. Each line names a collaborator:

* :class:`~hf_accum.loop.plan.RunPlan` -- micro-batches, planned updates (the LR horizon), batch arithmetic;
* :mod:`~hf_accum.loop.steppers` -- one epoch as a stream of updates (DDP / single process, or DeepSpeed);
* :class:`~hf_accum.boundary.UpdateBoundary` -- every update's one all-reduce and its skip / save / halt;
* :class:`~hf_accum.loop.supervisor.Supervisor` -- checkpoints, the halt, resuming.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, TypedDict, cast

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm
from typing_extensions import Unpack

from hf_accum.boundary import UpdateBoundary
from hf_accum.checkpointing.run_lock import locks_output_dir
from hf_accum.compat import keep_4bit_training_layout
from hf_accum.compile import CompileError, compile_blocks, whole_model_compiled
from hf_accum.control import NonFiniteGuard, StopSignals, TrainingControl
from hf_accum.loop.config import LoopConfig, LoopConfigError
from hf_accum.loop.ddp import set_find_unused_parameters
from hf_accum.loop.evaluation import evaluate_loss, evaluation_due
from hf_accum.loop.plan import RunPlan, check_supported
from hf_accum.loop.steppers import Step, Stepper, build_stepper, is_deepspeed
from hf_accum.loop.supervisor import Supervisor, build_checkpointer
from hf_accum.losses.micro_batch import LossSumFn, MicroBatchLoss
from hf_accum.losses.sequence_norm import refuse_custom_loss
from hf_accum.losses.token_loss import model_problem_type, unwrap_model
from hf_accum.measure.utilization import UtilizationMeter, meter_run, summarize
from hf_accum.planning.schedule import create_update_scheduler
from hf_accum.records import TrainResult, UpdateLog

logger = logging.getLogger("hf_accum.loop")


class TrainOptions(TypedDict, total=False):
    """:func:`train`'s optional keyword arguments (its docstring says what each does)."""

    lr_scheduler: Any
    loss_sum_fn: LossSumFn | None
    on_update: Callable[[UpdateLog], None] | None
    eval_dataloader: Any
    resume_from_checkpoint: str | bool | None
    control: TrainingControl | None


@dataclass
class _Run:
    """One :func:`train` call's collaborators, built by :func:`_start`."""

    model: torch.nn.Module
    accelerator: Accelerator
    config: LoopConfig
    plan: RunPlan
    stepper: Stepper
    supervisor: Supervisor
    meter: UtilizationMeter
    progress: Any
    control: TrainingControl
    options: TrainOptions
    result: TrainResult


@locks_output_dir(  # one run per output directory (hf_accum.checkpointing.run_lock), for the whole call
    lambda a: ((a["config"] or LoopConfig()).output_dir, a["accelerator"].is_main_process), "LoopConfig.output_dir"
)
def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_dataloader: Any,
    accelerator: Accelerator,
    config: LoopConfig | None = None,
    **options: Unpack[TrainOptions],
) -> TrainResult:
    """Train with exact accumulation. ``model``, ``optimizer`` and ``train_dataloader`` must come
    from ``accelerator.prepare``; the accumulation steps K are ``accelerator.gradient_accumulation_steps``.
    The options (keywords, :class:`TrainOptions`):

    ``lr_scheduler``: leave None to get ``config.lr_scheduler_type`` over the planned number of
    updates, or pass a factory ``(optimizer, total_updates) -> scheduler`` (do not ``prepare`` it).
    ``loss_sum_fn(outputs, labels, inputs) -> (loss_sum, n_targets)`` replaces the default token-summed
    cross-entropy (the same signature as ``AccumTrainer.loss_sum_and_count``; ``inputs`` are the forward's
    inputs, labels removed); it must return a *sum* over targets, never a mean. It receives real logits:
    the run then takes the logits path instead of the fused loss (logged).
    ``on_update``: called with every update's :class:`~hf_accum.records.UpdateLog`.
    ``eval_dataloader`` (one disjoint shard per rank, see :func:`evaluate_loss`): with
    ``config.eval_strategy``, each evaluated update carries the exact per-token held-out loss
    (``UpdateLog.eval_loss``; summed over every batch and rank, then divided once).
    ``resume_from_checkpoint``: a checkpoint directory, or True for the latest complete one in
    ``config.output_dir``; the run continues exactly (same gradients, LRs and data order) with the same
    model, optimizer, dataloader and config as the interrupted run. ``control``: request a checkpoint or a
    stop from a callback or another thread (:class:`hf_accum.control.TrainingControl`).
    """
    run = _start(model, optimizer, train_dataloader, accelerator, (config or LoopConfig()).validate(), options)
    remaining = max(0, run.plan.total_updates - len(run.result.updates))
    run.meter.start()
    with _cache_disabled(run.model), run.stepper.running(), \
            StopSignals(run.control, run.config.accumulation.stop_on_signals), contextlib.closing(run.progress):
        # The one exit: islice stops pulling updates once the planned number is reached.
        for epoch, consumed, step in islice(_updates(run.stepper, run.supervisor, train_dataloader, run.result),
                                            remaining):
            _close_update(run, epoch, consumed, step)
    return _finish(run)


def _start(model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataloader: Any, accelerator: Accelerator,
           config: LoopConfig, options: TrainOptions) -> _Run:
    """Every collaborator of the run, in order, and the resumed state (if any) loaded."""
    check_supported(accelerator, dataloader)
    model = _compiled(model, config, accelerator)
    set_find_unused_parameters(model, config.ddp_find_unused_parameters, accelerator.is_main_process)
    plan = RunPlan.of(dataloader, accelerator, config, model)
    scheduler = _scheduler(plan, config, optimizer, options.get("lr_scheduler"), accelerator)
    control = options.get("control") or TrainingControl()
    micro_batch_loss = _micro_batch_loss(model, config, options.get("loss_sum_fn"))
    stepper = build_stepper(model, optimizer, scheduler, accelerator, config, micro_batch_loss,
                            _boundary(accelerator, config, control, micro_batch_loss.extra_terms))
    checkpointer, resume_path = build_checkpointer(config, accelerator, options.get("resume_from_checkpoint"), model,
                                                   optimizer, scheduler, dataloader, plan)
    result = TrainResult(batch_plan=plan.batch)
    supervisor = Supervisor(config, accelerator, stepper, result, plan, checkpointer)
    progress = tqdm(total=plan.total_updates, desc="updates",
                    disable=config.disable_tqdm or not accelerator.is_main_process)
    if resume_path:
        supervisor.resume(resume_path, progress)
    keep_4bit_training_layout(model)  # held-out forwards must not repack 4-bit weights (hf_accum.compat)
    model.train()
    return _Run(model, accelerator, config, plan, stepper, supervisor,
                _utilization(model, accelerator, config, micro_batch_loss, stepper), progress, control, options, result)


def _close_update(run: _Run, epoch: int, consumed: int, step: Step) -> None:
    """The boundary's record of one update, then the controller, evaluation, checkpoint, report and halt."""
    plan, result = run.plan, run.result
    update = run.stepper.boundary.record(
        step.decision, step=len(result.updates) + 1, learning_rate=step.learning_rate,
        epoch=epoch + (consumed / plan.micro_batches if plan.micro_batches else 0.0), grad_norm=step.grad_norm,
        noise=step.noise,
    )
    run.meter.observe(update)  # its time, FLOP/s and MFU (evaluation and checkpoints count in the next one)
    if plan.auto is not None:  # the next window's size, decided before checkpoint and report
        update.batch_change = _observe(plan, update, run.accelerator)
    # The auto ramp's last update is known when it closes (total_updates is only its upper bound).
    total = update.step if plan.auto is not None and plan.auto.ends_run(epoch, consumed) else plan.total_updates
    if evaluation_due(run.config, update.step, total, consumed == plan.micro_batches):
        update.eval_loss = evaluate_loss(run.model, run.options.get("eval_dataloader"), run.accelerator,
                                         run.stepper.loss)
    result.updates.append(update)
    checkpoint = run.supervisor.after_update(update, step.decision, epoch, consumed)
    _report(update, run.progress, run.accelerator, run.options.get("on_update"))
    run.supervisor.halt_if_decided(update, step.decision, checkpoint)


def _finish(run: _Run) -> TrainResult:
    """The run's end: the noise-scale advice and the utilization summary."""
    result = run.result
    result.noise_scale_advice = run.stepper.boundary.noise_advice(result.updates)
    result.utilization = summarize(result.updates, run.meter.peak, run.accelerator.num_processes)
    if result.noise_scale_advice and run.accelerator.is_main_process:
        logger.info("%s", result.noise_scale_advice)
    return result


def _updates(stepper: Stepper, supervisor: Supervisor, dataloader: Any,
             result: TrainResult) -> Iterator[tuple[int, int, Step]]:
    """Every update of the run as ``(epoch, micro-batches of the epoch consumed, step)``, epoch after epoch."""
    for epoch in supervisor.plan.epochs(supervisor.first_epoch):
        if hasattr(dataloader, "set_epoch"):
            dataloader.set_epoch(epoch)
        batches, consumed = supervisor.epoch_batches(dataloader, epoch)
        windows, auto = supervisor.plan.windows, supervisor.plan.auto
        planned: Iterable[int] | None = windows.windows_from(epoch, consumed) if windows else None
        targets = windows.window_targets(epoch, consumed) if windows else None
        if auto is not None:  # lazy: each size is read when its window opens, after the last update's reading
            planned = auto.windows(epoch, consumed, stepper.scheduler)
        for step in stepper.epoch(batches, done=len(result.updates), windows=planned, targets=targets):
            yield epoch, consumed + step.consumed, step


def _scheduler(plan: RunPlan, config: LoopConfig, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
               accelerator: Accelerator) -> Any:
    """The LR scheduler: over the planned updates, or (auto ramp) over the run's samples with the LR rule.
    (Any: the user's factory may build any scheduler; the loop calls get_last_lr() and step() only.)"""
    if plan.auto is None:
        return (lr_scheduler or _default_scheduler(config))(optimizer, plan.total_updates)
    if lr_scheduler is not None:
        raise LoopConfigError("train(lr_scheduler=...) with rampup_batch_size='auto': the LR is the ramp's schedule "
                              "over consumed samples (lr_scheduler_type, warmup_ratio, rampup_auto.lr_rule); "
                              "allowed: lr_scheduler=None")
    scheduler = plan.auto.schedule(optimizer, config.lr_scheduler_type, config.warmup_ratio)
    if accelerator.is_main_process:
        logger.info("%s", plan.auto.describe(scheduler))
    return scheduler


def _observe(plan: RunPlan, update: UpdateLog, accelerator: Accelerator) -> str | None:
    """The controller's reading of ``update`` (reduced values only: every rank decides the same); a change is
    logged with its reason and returned for the update's record."""
    assert plan.auto is not None  # called for the auto ramp only
    change = plan.auto.observe(update.step, update.noise_scale, update.targets, update.applied)
    if change is None:
        return None
    reason = change.reason()
    if accelerator.is_main_process:
        logger.info("auto batch ramp: %s; LR rule %s: x%.4f from update %d", reason,
                    plan.auto.controller.settings.lr_rule, plan.auto.controller.lr_factor(), update.step + 1)
    return reason


def _boundary(accelerator: Accelerator, config: LoopConfig, control: TrainingControl,
              extra_terms: tuple[str, ...] = ()) -> UpdateBoundary:
    settings = config.accumulation
    return UpdateBoundary(accelerator, control, NonFiniteGuard(settings.max_consecutive_nonfinite), logger,
                          count_source="loss_sum_fn", steps_in_backward=is_deepspeed(accelerator),
                          noise_scale=settings.noise_scale, extra_terms=extra_terms,
                          noise_micro_batches=settings.noise_scale_micro_batches)


def _utilization(model: torch.nn.Module, accelerator: Accelerator, config: LoopConfig,
                 micro_batch_loss: MicroBatchLoss, stepper: Stepper) -> UtilizationMeter:
    """Model FLOPs at the boundary, and the meter of time and MFU (the peak: ``config.peak_flops``, else
    :mod:`hf_accum.measure.peak_flops`)."""
    return meter_run(stepper.boundary, model, micro_batch_loss.term_names[0], device=accelerator.device,
                     mixed_precision=accelerator.mixed_precision, world_size=accelerator.num_processes,
                     configured=config.accumulation.peak_flops, key="LoopConfig.peak_flops")


def _micro_batch_loss(model: torch.nn.Module, config: LoopConfig, loss_sum_fn: LossSumFn | None) -> MicroBatchLoss:
    """Forward + summed loss per micro-batch: fused for causal LMs unless a custom loss needs the logits.
    Under DeepSpeed the engine owns the (ZeRO-3: partitioned) head weight: the logits path there."""
    settings = config.accumulation
    refuse_custom_loss(settings.normalization, "a custom loss_sum_fn" if loss_sum_fn else None,
                       "LoopConfig.normalization", LoopConfigError)
    unit = getattr(loss_sum_fn, "term_names", ("target",))[0]
    if settings.tokens_per_update and unit != "target":
        raise LoopConfigError(f"LoopConfig.tokens_per_update={settings.tokens_per_update}: a token budget counts "
                              f"target tokens, but loss_sum_fn counts {unit}s; use fixed windows (tokens_per_update="
                              "None)")
    if loss_sum_fn is not None and settings.fused_loss:
        logger.info("a custom loss_sum_fn receives the logits: this run takes the logits path, not the fused loss")
    return MicroBatchLoss(
        settings.loss_kind, config.label_smoothing, model_problem_type(model), loss_sum_fn,
        fused=settings.fused_loss and loss_sum_fn is None,
        normalization=settings.normalization,
    )


def _compiled(model: torch.nn.Module, config: LoopConfig, accelerator: Accelerator) -> torch.nn.Module:
    """``config.compile``: the model's blocks compiled in place (:mod:`hf_accum.compile`). A model that
    ``Accelerator(dynamo_backend=...)`` compiled whole is unwrapped and compiled the same way, with the
    Accelerator's settings: the fused loss would break a whole-model graph at every micro-batch."""
    settings: dict[str, Any] = {"backend": config.compile_backend, "mode": config.compile_mode,
                                "dynamic": config.compile_dynamic}
    if whole_model_compiled(model):
        plugin = accelerator.state.dynamo_plugin.to_kwargs()
        settings = {"backend": plugin.get("backend"), "mode": plugin.get("mode"), "dynamic": plugin.get("dynamic")}
        model = cast(torch.nn.Module, model._orig_mod)  # torch.compile's OptimizedModule wraps a Module
        logger.info("the model was compiled whole (Accelerator dynamo_backend): its blocks are compiled instead")
    elif not config.compile:
        return model
    if is_deepspeed(accelerator) or accelerator.distributed_type == DistributedType.FSDP:
        raise LoopConfigError("LoopConfig.compile with DeepSpeed or FSDP: not verified by hf_accum's exactness tests "
                              "(only single process and DDP are); allowed: compile=False there")
    try:
        compile_blocks(model, **settings)
    except CompileError as error:
        raise LoopConfigError(str(error)) from None
    return model


@contextlib.contextmanager
def _cache_disabled(model: torch.nn.Module) -> Iterator[None]:
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


def _default_scheduler(config: LoopConfig) -> Callable[[torch.optim.Optimizer, int], Any]:
    def factory(optimizer: torch.optim.Optimizer, total_updates: int) -> torch.optim.lr_scheduler.LRScheduler:
        return create_update_scheduler(
            optimizer, total_updates, config.lr_scheduler_type, config.warmup_steps, config.warmup_ratio
        )

    return factory


def _report(update: UpdateLog, progress: Any, accelerator: Accelerator,
            on_update: Callable[[UpdateLog], None] | None) -> None:
    progress.update(1)
    mfu = {"mfu": f"{update.mfu:.1%}"} if update.mfu is not None else {}
    progress.set_postfix(loss=f"{update.loss:.4f}", lr=f"{update.learning_rate:.2e}", **mfu, refresh=False)
    if accelerator.is_main_process:
        logger.debug(update.line())  # the caller decides what to print (on_update); the bar shows progress
    if on_update is not None:
        on_update(update)
