"""AccumTrainer: a drop-in ``transformers.Trainer`` whose every update applies the exact big-batch gradient.

The class is a map of Trainer's hooks onto collaborators; ``Trainer._inner_training_loop`` and ``_run_epoch``
are not overridden. For every update Trainer fetches the window's K micro-batches at once, runs
``training_step`` on each, then clips and steps:

* ``get_batch_samples`` -- :class:`~hf_accum.trainer.window.TrainerWindow` counts the window's targets on all
  ranks; the count ``N`` goes to ``training_step`` as ``num_items_in_batch``;
* ``compute_loss`` -- the forward runs *without* labels (the model's own loss, with its own normalization, is
  never computed); the loss is summed (fused for causal LMs, :mod:`hf_accum.fused.loss`, else
  :meth:`AccumTrainer.loss_sum_and_count`, the one override point) and returned as ``loss_sum * W / N``;
* ``training_step`` on the window's last micro-batch -- the one :class:`~hf_accum.boundary.UpdateBoundary`
  (all-reduce, count check, skip / save / halt); :class:`~hf_accum.trainer.callbacks.BoundaryActions` carries
  the decision out through Trainer's flow;
* ``_maybe_log_save_evaluate`` -- the update's :class:`~hf_accum.records.UpdateLog`
  (:class:`~hf_accum.trainer.updates.UpdateRecorder`);
* ``_save_checkpoint`` / ``_get_output_dir`` / ``train`` -- atomic checkpoints, resume checks, the halt
  (:class:`~hf_accum.trainer.checkpoints.TrainerCheckpoints`);
* ``get_train_dataloader`` / ``create_scheduler`` -- the batch plan and the LR horizon in updates
  (:class:`~hf_accum.trainer.batch_plan.BatchPlanner`).

Every private transformers / accelerate attribute touched is in :mod:`hf_accum.compat`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput, TrainOutput

from hf_accum.accumulation import WindowTally
from hf_accum.checkpointing.run_lock import locks_output_dir
from hf_accum.compat import (
    check_trainer_hooks,
    keep_4bit_training_layout,
    keep_accelerate_from_compiling,
    prepare_inputs,
    trainer_learning_rate,
)
from hf_accum.compile import compile_blocks
from hf_accum.control import StopSignals, TrainingControl
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.losses.model_loss import resolve_loss_kind
from hf_accum.losses.sequence_norm import refuse_custom_loss
from hf_accum.losses.token_loss import LossKind, infer_loss_kind, model_problem_type, token_loss_sum
from hf_accum.measure.noise_probe import NOT_UNDER_DEEPSPEED, NOT_UNDER_FSDP
from hf_accum.measure.noise_scale import NoiseScaleTracker
from hf_accum.measure.utilization import meter_run, summarize
from hf_accum.planning.planned_windows import refuse_planned_windows
from hf_accum.planning.schedule import BatchPlan
from hf_accum.records import UpdateLog
from hf_accum.settings import AccumulationSettings
from hf_accum.trainer.batch_plan import BatchPlanner
from hf_accum.trainer.callbacks import BoundaryActions
from hf_accum.trainer.checkpoints import TrainerCheckpoints
from hf_accum.trainer.evaluation import without_repeated_eval_rows
from hf_accum.trainer.updates import UpdateRecorder
from hf_accum.trainer.window import TrainerWindow

logger = logging.getLogger("hf_accum.trainer")
# Trainer's hooks keep Trainer's own parameter types; ``trial`` (optuna's Trial or a dict) is Any, as the
# optional optuna has no types here. Trainer types ``self.model`` Optional: it is set once __init__ ran.
check_trainer_hooks(Trainer)


class AccumTrainer(Trainer):
    """``transformers.Trainer`` with exact gradient accumulation for every model and rank setting.

    Same constructor and ``TrainingArguments`` as ``Trainer``, plus ``accumulation``, an
    :class:`~hf_accum.settings.AccumulationSettings` (loss kind, fused loss, fp32 gradient sums, normalization,
    noise scale, peak FLOP/s, the inf/NaN limit, stop signals; its fields may also be given flat:
    ``AccumTrainer(..., fused_loss=False)``), and ``on_update`` (called with every update's
    :class:`~hf_accum.records.UpdateLog`; all of them are in ``updates``).

    ``TrainingArguments(torch_compile=True)`` compiles the model's repeated blocks in place
    (:mod:`hf_accum.compile`; with ``torch_compile_backend`` / ``torch_compile_mode``), not the whole model: the
    head and the fused loss stay eager, and the guarantees below hold compiled.

    Guarantees, per optimizer update (window of K micro-batches on each of W ranks):

    * the applied gradient is the gradient of the mean loss over all N prediction targets of the window
      on all ranks, whatever the model's ``forward`` signature, its head, the lengths, the ranks or the
      short last window of an epoch; ``N`` is always summed over ranks (``average_tokens_across_devices``
      is ignored); label smoothing is computed by :func:`hf_accum.losses.token_loss.token_loss_sum` (or the fused loss);
    * a window with no target, or with an inf/NaN loss or gradient on any rank, applies no gradient and
      does not step the LR scheduler (logged as a skipped update); after ``max_consecutive_nonfinite``
      inf/NaN updates in a row: a checkpoint and :class:`~hf_accum.control.NonFiniteLossError` (DeepSpeed
      steps inside backward: it stops at the first);
    * the LR scheduler's horizon is :func:`hf_accum.planning.schedule.planned_updates` (updates, not micro-batches);
    * ``auto_find_batch_size`` keeps the effective batch (K grows as the micro-batch shrinks, logged);
    * resuming refuses another micro-batch, accumulation or world size; ``train(resume_from_checkpoint=True)``
      takes the latest *complete* checkpoint; checkpoints are written atomically;
    * SIGTERM/SIGUSR1/SIGINT (``stop_on_signals``) or ``trainer.run_control.request_stop()``: the update
      finishes, a checkpoint is written, and ``train`` raises :class:`~hf_accum.control.TrainingStopped`;
      ``run_control.request_checkpoint()`` saves and continues.

    Subclass and override :meth:`loss_sum_and_count` to change the loss (it must return a *sum* over targets
    and the number of targets); everything else stays exact. An override receives real logits, so it switches
    a causal LM from the fused loss to the logits path (logged).
    """

    # compute_loss returns the window-normalized loss; Trainer must not divide by K again.
    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, accumulation: AccumulationSettings | None = None,
                 on_update: Callable[[UpdateLog], None] | None = None, **kwargs: Any) -> None:
        # The settings are checked before the heavy set-up (flat keyword arguments: the thin adapter).
        self.accumulation = AccumulationSettings.adapt(accumulation, kwargs, "AccumTrainer({})")
        """This trainer's :class:`~hf_accum.settings.AccumulationSettings`."""
        refuse_planned_windows("AccumTrainer: ", self.accumulation.rampup_batch_size,
                               self.accumulation.tokens_per_update)  # the loop engine has them
        super().__init__(*args, **kwargs)
        _refuse_unverifiable_settings(self)
        if self.args.torch_compile:  # the blocks, in place (hf_accum.compile); Accelerate compiles nothing
            assert self.model is not None  # set by Trainer.__init__
            compile_blocks(self.model, self.args.torch_compile_backend, self.args.torch_compile_mode)
        assert self.model is not None  # Trainer.__init__ holds the model (or model_init's)
        # Read once: the head's problem type does not change during a run (sequence heads only).
        self._problem_type = model_problem_type(self.model)
        settings = self.accumulation
        self._micro_batch_loss = self._build_micro_batch_loss(settings.loss_kind, settings.fused_loss,
                                                              settings.normalization)
        # We compute the loss ourselves, so the model never sees labels or num_items_in_batch:
        # this also stops Trainer's own (rank-local when average_tokens_across_devices=False) count.
        self.model_accepts_loss_kwargs = False
        self.run_control = TrainingControl()  # request_checkpoint() / request_stop(), from callbacks or threads
        _refuse_unmeasured_noise_scale(self)
        extra_terms = self._micro_batch_loss.extra_terms
        clips = bool(self.args.max_grad_norm and self.args.max_grad_norm > 0)
        self._window = TrainerWindow(self.accelerator, self.run_control, settings, self.is_deepspeed_enabled,
                                     self.is_fsdp_enabled, clips, extra_terms, self._micro_batch_loss.term_names[0])
        self.noise_scale_advice: str | None = None
        """With ``noise_scale=True``: the end-of-run line on the batch size (also logged)."""
        self.utilization: dict[str, Any] | None = None
        """After ``train``: model FLOPs per update, achieved FLOP/s and MFU
        (:func:`hf_accum.measure.utilization.summarize`; every update's own are in ``updates``, and the log lines carry
        ``flops_per_second`` and ``mfu``)."""
        self._records = UpdateRecorder(self._window.boundary, on_update)
        self._checkpoints = TrainerCheckpoints(self)
        self._planner = BatchPlanner(self)
        self._eval_tally = WindowTally(device=self.args.device, extra_terms=extra_terms)  # the exact eval_loss
        self.add_callback(BoundaryActions(self._window, settings.fp32_grad_accumulation, lambda: self.model))

    @property
    def updates(self) -> list[UpdateLog]:
        """Every update of the run, as the loop logs them, whatever ``logging_steps`` is; a resumed run's include
        those before its checkpoint."""
        return self._records.updates

    @property
    def noise_scale_tracker(self) -> NoiseScaleTracker | None:
        """The gradient noise scale's moving averages (None without ``noise_scale=True``)."""
        return self._window.boundary.noise

    @property
    def batch_plan(self) -> BatchPlan | None:
        return self._planner.plan

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's set-up, plus FSDP2 on CPU processes, where Accelerate 1.15 would silently run DDP."""
        from hf_accum.fsdp import refuse_fsdp1

        refuse_fsdp1(self.args.fsdp_plugin_args)  # before Accelerate, which fails on CPU with a vaguer message
        super().create_accelerator_and_postprocess()
        if self.args.torch_compile:
            keep_accelerate_from_compiling(self.accelerator)  # AccumTrainer compiles the blocks (hf_accum.compile)
        if self.args.fsdp_plugin_args is not None and not self.is_fsdp_enabled:
            from hf_accum.fsdp import force_trainer_fsdp2

            force_trainer_fsdp2(self.accelerator, self.args)
            self.is_fsdp_enabled = True

    # -- the loss and its override point ------------------------------------------------------------------
    @property
    def loss_kind(self) -> LossKind:
        """Target layout of the model's head (``causal_lm`` shifts labels by one)."""
        if self._micro_batch_loss.kind is None:
            assert self.model is not None  # set by Trainer.__init__
            self._micro_batch_loss.kind = infer_loss_kind(self.model)
        return self._micro_batch_loss.kind

    def _build_micro_batch_loss(self, loss_kind: LossKind | None, fused_loss: bool,
                                normalization: str = "token") -> MicroBatchLoss:
        overridden = type(self).loss_sum_and_count is not AccumTrainer.loss_sum_and_count
        refuse_custom_loss(normalization, f"{type(self).__name__}.loss_sum_and_count" if overridden else None,
                           "AccumTrainer(normalization)")
        if overridden and fused_loss:
            logger.info("%s overrides loss_sum_and_count, which receives the logits: this run takes the logits "
                        "path, not the fused loss", type(self).__name__)
        # Sequence mode brings its own weighted loss (MicroBatchLoss); under DeepSpeed the engine owns the
        # (ZeRO-3: partitioned) head weight: the logits path there.
        return MicroBatchLoss(
            loss_kind, self.args.label_smoothing_factor, self._problem_type,
            None if normalization == "sequence" else self.loss_sum_and_count,
            fused=fused_loss and not overridden, normalization=normalization,
        )

    def loss_sum_and_count(
        self, outputs: Any, labels: torch.Tensor, inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss over one micro-batch's prediction targets, and the number of targets.

        Override to change the loss. Return a SUM over targets (never a mean) and the same target count as
        :func:`hf_accum.losses.token_loss.count_targets`; AccumTrainer divides by the window's global count once.
        ``inputs`` are the forward's inputs (labels removed). Causal LMs that keep this default are trained with the
        fused loss instead (same sum, no logits); overriding it gives the override real ``outputs.logits``.
        """
        return token_loss_sum(outputs.logits, labels, kind=self.loss_kind,
                              label_smoothing=self.args.label_smoothing_factor, problem_type=self._problem_type)

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device) -> tuple[list[Any], int]:
        """Fetch the window's micro-batches and return its global target count as ``num_items_in_batch``."""
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._records.window_opened()  # the first window starts the utilization clock
        if batch_samples and self._micro_batch_loss.kind is None:
            # Before the first window is counted: the class's layout, else the one the model's own loss shows.
            batch = prepare_inputs(self, batch_samples[0])
            inputs = {key: value for key, value in batch.items() if key != "labels"}
            assert self.model is not None  # set by Trainer.__init__
            self._micro_batch_loss.kind = resolve_loss_kind(self.model, inputs, _labels(batch))
        return batch_samples, self._window.count(batch_samples, self._micro_batch_loss.count_units)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Training: ``loss_sum * W / N`` (N = the window's targets on all ranks). Evaluation
        (``num_items_in_batch`` None): the plain per-target mean of this batch."""
        labels = _labels(inputs)
        if num_items_in_batch is None:  # evaluation
            labels = without_repeated_eval_rows(self.accelerator, labels)
        forward_inputs = {key: value for key, value in inputs.items() if key != "labels"}
        # No labels to the model: no model-side loss. Fused for causal LMs while training (outputs.logits
        # then holds the loss), else the forward's logits through loss_sum_and_count.
        outputs, loss_sum, n_targets = self._micro_batch_loss(model, forward_inputs, labels, need_logits=return_outputs)
        if num_items_in_batch is None:
            self._eval_tally.add(loss_sum, n_targets, inputs)
            loss = loss_sum / torch.clamp(torch.as_tensor(n_targets, device=loss_sum.device), min=1)
            loss = loss.sum() if loss.dim() else loss  # several terms: each one's mean, added
        else:
            self._window.boundary.add(loss_sum, n_targets, inputs, aux_sum=self._micro_batch_loss.aux_sum)
            self._window.micro_batch_targets = n_targets
            loss = self._window.scaled_loss(loss_sum, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        if num_items_in_batch is not None:
            self._window.after_backward(model)  # noise scale: this micro-batch as a small batch
        # _run_epoch sets sync_gradients on the window's last micro-batch, before training_step.
        if num_items_in_batch is not None and self.accelerator.sync_gradients:
            self._records.window_closed(self._window.close(model, self.state.global_step + 1))
        return loss

    # -- batch plan and LR horizon ------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        # Called at the start of every (re)try of the training loop (auto_find_batch_size after an OOM).
        self._window.start()
        self._records.start(self._checkpoints.resumed_history())
        self._checkpoints.restore_noise_scale(self.noise_scale_tracker)
        self._planner.keep_effective_batch()
        dataloader = super().get_train_dataloader()
        self._planner.planned(dataloader)
        return dataloader

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> torch.optim.lr_scheduler.LRScheduler:
        return super().create_scheduler(num_training_steps=self._planner.lr_horizon(num_training_steps),
                                        optimizer=optimizer)

    # -- records and logs ---------------------------------------------------------------------------------
    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: torch.Tensor | float | None,
                                 model: nn.Module, trial: Any, epoch: float, ignore_keys_for_eval: list[str] | None,
                                 start_time: float, learning_rate: float | None = None) -> None:
        # Trainer calls this after every update (and once more at an epoch's end, with no new window).
        self._records.closing(grad_norm, learning_rate, self._window.unclipped_grad_sq)
        super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=learning_rate
        )
        self._records.commit(self.state.global_step, float(self.state.epoch or 0.0), self._current_lr)

    def update_history(self) -> list[dict]:
        """Every update so far as dicts, the one being closed included (what a checkpoint stores)."""
        return self._records.history(self.state.global_step, float(self.state.epoch or 0.0), self._current_lr)

    def _current_lr(self) -> float:
        return trainer_learning_rate(self)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training logs carry the exact per-target loss of the logged updates and their shape."""
        if "loss" in logs:
            logs.update(self._window.take_interval_logs())
            logs.update(self._records.noise_logs())
            logs.update(self._records.utilization_logs())
        if "train_loss" in logs and self._window.run_totals.targets:
            # Trainer's final train_loss is a mean of per-update means; ours weighs every target alike.
            logs["train_loss"] = self._window.run_totals.mean_loss
        super().log(logs, start_time)

    def evaluation_loop(self, dataloader: DataLoader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """``eval_loss``: the mean over every target of the evaluation set (all batches, all ranks)."""
        self._eval_tally.reset()
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        totals = self._eval_tally.reduce(self.accelerator)  # every rank runs the evaluation loop
        assert output.metrics is not None  # Trainer.evaluation_loop always returns its metrics dict
        if totals.targets and f"{metric_key_prefix}_loss" in output.metrics:
            output.metrics[f"{metric_key_prefix}_loss"] = totals.mean_loss
            self._records.eval_loss = totals.mean_loss  # recorded with the update that triggered it, if any
        return output

    # -- checkpoints, resume, halt ------------------------------------------------------------------------
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Trainer's checkpoint, written atomically (:mod:`hf_accum.trainer.checkpoints`)."""
        self._checkpoints.save(self._get_output_dir(trial), functools.partial(super()._save_checkpoint, model, trial))

    def _get_output_dir(self, trial: Any) -> str:
        return self._checkpoints.staging_run_dir or super()._get_output_dir(trial)

    @locks_output_dir(lambda a: (a["self"].args.output_dir, a["self"].args.process_index == 0), "output_dir")
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> TrainOutput:
        """``resume_from_checkpoint=True``: the latest complete checkpoint of ``output_dir``. Raises
        :class:`~hf_accum.control.TrainingStopped` after a stop signal or request (checkpoint written) and
        :class:`~hf_accum.control.NonFiniteLossError` at the inf/NaN limit."""
        checkpoint = self._checkpoints.resolve(resume_from_checkpoint, self._planner.requested_plan(),
                                               self.args.auto_find_batch_size)
        self._window.new_run()
        self.run_control.reset()
        assert self.model is not None  # set by Trainer.__init__
        self._records.meter = meter_run(
            self._window.boundary, self.model, self._micro_batch_loss.term_names[0], device=self.args.device,
            mixed_precision=self.accelerator.mixed_precision, world_size=self.args.world_size,
            configured=self.accumulation.peak_flops, key="AccumTrainer(peak_flops)",
        )
        keep_4bit_training_layout(self.model)  # evaluations must not repack 4-bit weights (hf_accum.compat)
        with StopSignals(self.run_control, self.accumulation.stop_on_signals):
            output = super().train(checkpoint, *args, **kwargs)
        self._checkpoints.raise_if_halted(self._window.halting, self._window.boundary.guard)
        self.noise_scale_advice = self._window.boundary.noise_advice(self.updates)
        self.utilization = summarize(self.updates, self._records.meter.peak, self.args.world_size)
        if self.noise_scale_advice and self.args.process_index == 0:
            logger.info("%s", self.noise_scale_advice)
        if "train_loss" in output.metrics:  # set by log() above: the per-target mean of the whole run
            output = output._replace(training_loss=output.metrics["train_loss"])
        return output


def _refuse_unverifiable_settings(trainer: AccumTrainer) -> None:
    """Settings under which AccumTrainer could not keep its guarantees, refused before training."""
    if trainer.is_deepspeed_enabled and trainer.optimizer is not None:
        # Trainer drops an optimizer passed in optimizers= under DeepSpeed, saying nothing.
        raise ValueError(
            "under DeepSpeed, Trainer replaces the optimizer passed in optimizers= "
            f"({type(trainer.optimizer).__name__}) with one built from TrainingArguments.optim / optim_args (or the "
            "DeepSpeed config's 'optimizer' section); choose the optimizer there instead"
        )
    if trainer.args.torch_compile and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
        raise ValueError("torch_compile=True with DeepSpeed or FSDP: not verified by hf_accum's exactness tests (only "
                         "single process and DDP are); train without torch_compile there")
    if trainer.compute_loss_func is not None:
        raise ValueError(
            "AccumTrainer cannot verify that compute_loss_func normalizes exactly; override "
            "AccumTrainer.loss_sum_and_count(outputs, labels, inputs) -> (loss_sum, n_targets) instead"
        )
    if trainer.args.world_size > 1 and not trainer.args.average_tokens_across_devices:
        logger.info("average_tokens_across_devices=False is ignored: AccumTrainer always normalizes by the "
                    "target count summed over all ranks (the only exact mean under DDP)")


def _refuse_unmeasured_noise_scale(trainer: AccumTrainer) -> None:
    """``noise_scale`` where the micro-batch gradients cannot be read, or of a loss of several terms."""
    if not trainer.accumulation.noise_scale:
        return
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        reason = NOT_UNDER_DEEPSPEED if trainer.is_deepspeed_enabled else NOT_UNDER_FSDP
        raise ValueError(f"AccumTrainer(noise_scale=True): {reason}")
    if trainer._micro_batch_loss.extra_terms:
        raise ValueError(f"AccumTrainer(noise_scale=True): not measured for a loss of several terms "
                         f"{trainer._micro_batch_loss.term_names}")


def _labels(batch: dict[str, Any]) -> torch.Tensor:
    if "labels" not in batch:
        raise KeyError(f"AccumTrainer needs 'labels' in every batch (the collator gave {sorted(batch)})")
    return batch["labels"]
