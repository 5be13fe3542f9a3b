"""AccumTrainer: a drop-in ``transformers.Trainer`` whose every update applies the exact big-batch gradient.

This module owns the Trainer front-end only. The math lives in the core and is called, not
copied: what a target is and how a micro-batch's loss is summed (:mod:`hf_accum.loss`), the one
normalization ``W / N`` (:mod:`hf_accum.accumulation`), the update-counted schedule and the
batch arithmetic (:mod:`hf_accum.schedule`).

How it plugs into ``Trainer._run_epoch`` (which is *not* overridden): for every update the
Trainer fetches the window's K micro-batches at once (``get_batch_samples``), then runs
``training_step`` on each, then clips and steps. We pre-count:

1. ``get_batch_samples`` counts the window's prediction targets with
   :func:`~hf_accum.loss.count_targets` and all-reduces the count over ranks, ALWAYS -- also
   when ``average_tokens_across_devices=False``, where stock Trainer divides by each rank's own
   count and DDP then averages those differently-normalized gradients. The global count ``N``
   is handed to ``training_step`` as ``num_items_in_batch``.
2. ``compute_loss`` runs the forward *without* labels (the model's own loss, with its own
   normalization and fp32 upcasts, is never computed), sums the loss itself -- for causal LMs with
   the fused linear cross-entropy (:mod:`hf_accum.fused_loss`: no logits are materialized), else
   through :meth:`AccumTrainer.loss_sum_and_count`, the one override point -- and returns
   ``loss_sum * W / N``. DDP averages over ``W`` ranks, so the applied gradient is
   ``grad(sum of every target's loss) / N``: one big batch. Because the loss is scaled *before*
   backward (not the gradients after), this also holds under DeepSpeed/FSDP, which keep
   gradients out of reach.
3. ``training_step`` on the window's last micro-batch all-reduces the window's loss/token
   tallies once (for logging and for a consistency check) and, if the window had no target
   at all, drops the gradients so the optimizer applies nothing.

``loss_is_scaled_for_ga = True`` tells ``Trainer.training_step`` not to divide by K again.

At the same all-reduce every rank adds its inf/NaN-gradient flag and its stop/checkpoint requests
(:mod:`hf_accum.control`): a window with an inf/NaN loss or gradient is skipped (gradients dropped, the LR
scheduler left alone), and a stop signal ends training after the update with a checkpoint, on all ranks
alike. Checkpoints are written atomically and resumed from the latest complete one
(:mod:`hf_accum.checkpoint`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict
from typing import Any, Callable

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import has_length, rotate_checkpoints

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
    PLAN_FILE,
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
from hf_accum.compat import keep_4bit_training_layout
from hf_accum.control import (
    DEFAULT_MAX_CONSECUTIVE_NONFINITE,
    NonFiniteGuard,
    NonFiniteLossError,
    StopSignals,
    TrainingControl,
    TrainingStopped,
)
from hf_accum.distributed import num_nodes
from hf_accum.fused_loss import MicroBatchLoss
from hf_accum.loop import UpdateLog
from hf_accum.loss import (
    LossKind,
    count_targets,
    infer_loss_kind,
    model_problem_type,
    resolve_loss_kind,
    token_loss_sum,
)
from hf_accum.schedule import BatchPlan, planned_updates, repeated_examples_warning

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
_NONFINITE_LIMIT = "inf/nan limit"


class AccumTrainer(Trainer):
    """``transformers.Trainer`` with exact gradient accumulation for every model and rank setting.

    Same constructor and ``TrainingArguments`` as ``Trainer``, plus ``loss_kind`` (``"causal_lm"``,
    ``"token"`` or ``"sequence"``; when omitted, inferred from the model class, else from the model's
    own loss on the first micro-batch), ``fused_loss`` (causal LMs: the loss from the hidden states and
    the output layer, never the full logits; default True) and ``fp32_grad_accumulation`` (bf16/fp16
    weights sum their micro-batch gradients in fp32; default True, single process),
    ``max_consecutive_nonfinite`` (default 5) and ``stop_on_signals`` (default True).

    Guarantees, per optimizer update (window of K micro-batches on each of W ranks):

    * the applied gradient is the gradient of the mean loss over all N prediction targets of
      the window on all ranks -- whatever the model's ``forward`` signature, whether its head
      honours ``num_items_in_batch``, and however uneven the lengths, the ranks or the short
      last window of an epoch are;
    * ``N`` is always summed over ranks: ``average_tokens_across_devices`` is ignored (with
      ``False`` stock Trainer normalizes each rank by its own count, which is not a mean);
    * label smoothing is computed by :func:`hf_accum.loss.token_loss_sum` (or the fused loss) in at
      least fp32 (fp64 for fp64 models); Trainer's ``LabelSmoother`` is disabled;
    * a window with no target applies no gradient (``.grad`` set to None, so torch optimizers
      skip every parameter, including weight decay); the step and the scheduler still count it,
      because the update horizon and checkpoint positions are counted in windows;
    * the LR scheduler's horizon is :func:`hf_accum.schedule.planned_updates` (updates, not
      micro-batches), and it steps once per update;
    * ``auto_find_batch_size`` keeps the effective batch: when it shrinks the micro-batch, the
      accumulation steps grow so that micro-batch x accumulation is unchanged (logged);
    * resuming checks the checkpoint's batch plan and refuses a different micro-batch,
      accumulation or world size (it would silently change the effective batch);
      ``train(resume_from_checkpoint=True)`` takes the latest *complete* checkpoint;
    * checkpoints are written atomically (staging directory, renamed once every rank is done);
      ``save_total_limit`` deletes old ones only after the new one is complete;
    * an update whose loss or gradients hold an inf/NaN on any rank is skipped: weights, optimizer
      state and LR schedule untouched, logged (``updates_skipped_nonfinite``); after
      ``max_consecutive_nonfinite`` in a row, a checkpoint and :class:`~hf_accum.control.NonFiniteLossError`
      (under fp16 the GradScaler's own skip does it; DeepSpeed steps inside backward: the run stops);
    * SIGTERM/SIGUSR1/SIGINT (``stop_on_signals``) or ``trainer.run_control.request_stop()``: the update
      finishes, a checkpoint is written, and ``train`` raises :class:`~hf_accum.control.TrainingStopped`
      (exit code 75, 130 for Ctrl-C); ``run_control.request_checkpoint()`` saves and continues.

    Subclass and override :meth:`loss_sum_and_count` to change the loss (it must return a *sum*
    over targets and the number of targets); everything else stays exact. An override receives real
    logits, so it switches a causal LM from the fused loss to the logits path (logged).
    """

    # compute_loss returns the window-normalized loss; Trainer must not divide by K again.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        loss_kind: LossKind | None = None,
        on_update: Callable[[UpdateLog], None] | None = None,
        fused_loss: bool = True,
        fp32_grad_accumulation: bool = True,
        max_consecutive_nonfinite: int = DEFAULT_MAX_CONSECUTIVE_NONFINITE,
        stop_on_signals: bool = True,
        **kwargs: Any,
    ) -> None:
        self._nonfinite = NonFiniteGuard(max_consecutive_nonfinite)  # validates before the heavy set-up
        super().__init__(*args, **kwargs)
        self._refuse_optimizer_deepspeed_replaces()
        if self.compute_loss_func is not None:
            raise ValueError(
                "AccumTrainer cannot verify that compute_loss_func normalizes exactly; override "
                "AccumTrainer.loss_sum_and_count(outputs, labels, inputs) -> (loss_sum, n_targets) instead"
            )
        # Read once: the head's problem type does not change during a run (sequence heads only).
        self._problem_type = model_problem_type(self.model)
        self._micro_batch_loss = self._build_micro_batch_loss(loss_kind, fused_loss)
        self._fp32_grad_accumulation = fp32_grad_accumulation
        self._fp32_sums: Fp32GradientAccumulator | None = None
        self.add_callback(_Fp32SumsForTraining(self))
        # We compute the loss ourselves, so the model never sees labels or num_items_in_batch:
        # this also stops Trainer's own (rank-local when average_tokens_across_devices=False) count.
        self.model_accepts_loss_kwargs = False
        # The effective batch the user asked for; auto_find_batch_size must keep it.
        self._requested_batch = (self._train_batch_size, self.args.gradient_accumulation_steps)
        self._micro_batches_per_epoch: int | None = None
        self.batch_plan: BatchPlan | None = None
        self._window_targets = 0
        self._tally = WindowTally(device=self.args.device)
        self._interval = _LogInterval()
        self._run_totals = WindowTotals()  # every window trained by this train() call: the exact final train_loss
        self._eval_tally = WindowTally(device=self.args.device)  # the exact eval_loss
        # Every update of the run, as the loop logs them (hf_accum.UpdateLog), whatever logging_steps is; a
        # resumed run's include those before its checkpoint (hf_accum_updates.json).
        self.updates: list[UpdateLog] = []
        self._resume_checkpoint: str | None = None
        self._on_update = on_update
        self._closed_window: WindowTotals | None = None
        self._closing_update_args: tuple[Any, Any] = (None, None)  # grad_norm, learning_rate of that update
        self._eval_loss_of_update: float | None = None
        self.run_control = TrainingControl()  # request_checkpoint() / request_stop(), from callbacks or threads
        self._stop_on_signals = stop_on_signals
        self._halt: str | None = None  # agreed by all ranks: a stop reason, or _NONFINITE_LIMIT
        self._skip_step = False  # this update's window was skipped (inf/NaN, no targets): no LR scheduler step
        self._save_requested = False
        self._staging_run_dir: str | None = None  # set while Trainer writes a checkpoint
        self.add_callback(_BoundaryActions(self))
        if self.args.world_size > 1 and not self.args.average_tokens_across_devices:
            logger.info(
                "average_tokens_across_devices=False is ignored: AccumTrainer always normalizes by the "
                "target count summed over all ranks (the only exact mean under DDP)"
            )

    def _refuse_optimizer_deepspeed_replaces(self) -> None:
        """Under DeepSpeed, ``Trainer`` drops an optimizer passed in ``optimizers=`` and builds its own from
        ``TrainingArguments.optim`` (or the DeepSpeed config's ``optimizer`` section), saying nothing."""
        if self.is_deepspeed_enabled and self.optimizer is not None:
            raise ValueError(
                f"under DeepSpeed, Trainer replaces the optimizer passed in optimizers= ({type(self.optimizer).__name__}) "
                "with one built from TrainingArguments.optim / optim_args (or the DeepSpeed config's 'optimizer' "
                "section); choose the optimizer there instead"
            )

    # -- the override point -----------------------------------------------------------------
    @property
    def loss_kind(self) -> LossKind:
        """Target layout of the model's head (``causal_lm`` shifts labels by one)."""
        if self._micro_batch_loss.kind is None:
            self._micro_batch_loss.kind = infer_loss_kind(self.model)
        return self._micro_batch_loss.kind

    def _build_micro_batch_loss(self, loss_kind: LossKind | None, fused_loss: bool) -> MicroBatchLoss:
        overridden = type(self).loss_sum_and_count is not AccumTrainer.loss_sum_and_count
        if overridden and fused_loss:
            logger.info("%s overrides loss_sum_and_count, which receives the logits: this run takes the logits "
                        "path, not the fused loss", type(self).__name__)
        # Under DeepSpeed the engine owns the (ZeRO-3: partitioned) head weight: the logits path there.
        return MicroBatchLoss(
            loss_kind, self.args.label_smoothing_factor, self._problem_type, self.loss_sum_and_count,
            fused=fused_loss and not overridden and not self.is_deepspeed_enabled,
        )

    def _resolve_loss_kind(self, batch: dict[str, Any]) -> None:
        """Before the first window is counted: the class's layout, else the one the model's own loss shows."""
        if self._micro_batch_loss.kind is None:
            batch = self._prepare_inputs(batch)
            inputs = {key: value for key, value in batch.items() if key != "labels"}
            self._micro_batch_loss.kind = resolve_loss_kind(self.model, inputs, _labels(batch))

    def loss_sum_and_count(
        self, outputs: Any, labels: torch.Tensor, inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss over one micro-batch's prediction targets, and the number of targets.

        Override to change the loss. Return a SUM over targets (never a mean) and the same
        target count as :func:`hf_accum.loss.count_targets`; AccumTrainer divides by the
        window's global count once. ``inputs`` are the forward's inputs (labels removed).
        Causal LMs that keep this default are trained with the fused loss instead (same sum, no
        logits); overriding it gives the override real ``outputs.logits`` on every micro-batch.
        """
        return token_loss_sum(
            outputs.logits,
            labels,
            kind=self.loss_kind,
            label_smoothing=self.args.label_smoothing_factor,
            problem_type=self._problem_type,
        )

    # -- counting the window (before any forward) ---------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Fetch the window's micro-batches and return its global target count as ``num_items_in_batch``."""
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batch_samples:
            self._resolve_loss_kind(batch_samples[0])
        local = torch.zeros((), dtype=torch.float64, device=device)
        for batch in batch_samples:  # summed on the device: one host sync per window, below
            local += count_targets(_labels(batch), self.loss_kind).to(device, torch.float64)
        # Every rank joins this all-reduce once per window (Trainer fetches windows in lockstep).
        self._window_targets = int(round(global_sum(local, self.accelerator).item()))
        # A Python int: compute_loss needs it as a number, and an int avoids a device sync per micro-batch.
        return batch_samples, self._window_targets

    # -- the loss -----------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Training: ``loss_sum * W / N`` (N = the window's targets on all ranks). Evaluation
        (``num_items_in_batch`` None): the plain per-target mean of this batch."""
        labels = _labels(inputs)
        if num_items_in_batch is None:  # evaluation
            labels = self._without_repeated_eval_rows(labels)
        forward_inputs = {key: value for key, value in inputs.items() if key != "labels"}
        # No labels to the model: no model-side loss. Fused for causal LMs while training (outputs.logits
        # then holds the loss), else the forward's logits through loss_sum_and_count.
        outputs, loss_sum, n_targets = self._micro_batch_loss(model, forward_inputs, labels, need_logits=return_outputs)
        if num_items_in_batch is None:
            self._eval_tally.add(loss_sum, n_targets, inputs)
            loss = loss_sum / torch.clamp(torch.as_tensor(n_targets, device=loss_sum.device), min=1)
        else:
            self._tally.add(loss_sum, n_targets, inputs, aux_sum=self._micro_batch_loss.aux_sum)
            loss = loss_sum * self._backward_scale(self._window_scale(num_items_in_batch))
        return (loss, outputs) if return_outputs else loss

    def _without_repeated_eval_rows(self, labels: torch.Tensor) -> torch.Tensor:
        """``labels`` with the rows Accelerate repeated to even out the ranks masked (-100).

        A sharded evaluation set that does not fill ``batch x ranks`` gets its last step filled with
        examples from its start (``even_batches``), so every rank runs as many batches. Stock
        ``gather_for_metrics`` cuts them off the gathered tensors: the real rows of that step are the
        first ``remainder`` of the rank-major concatenation. The exact eval_loss sums targets rank by
        rank, so it leaves them out the same way here, or they would count twice."""
        state = self.accelerator.gradient_state
        world, rows = self.accelerator.num_processes, labels.shape[0]
        if world < 2 or not state.end_of_dataloader or state.remainder is None or state.remainder <= 0:
            return labels
        from accelerate.data_loader import DataLoaderShard

        loader = state.active_dataloader
        if not isinstance(loader, DataLoaderShard) or getattr(loader, "total_batch_size", None) != rows * world:
            return labels  # not the even_batches layout (packed rows, a dispatched iterable): left as it is
        real = min(rows, max(0, state.remainder - self.accelerator.process_index * rows))
        if real == rows:
            return labels
        labels = labels.clone()
        labels[real:] = -100
        return labels

    def _window_scale(self, window_targets: int | torch.Tensor) -> float:
        """``W / N`` from the core; 0 for a window without targets (its gradients are dropped later,
        multiplying by 0 keeps every rank's backward -- and DDP's collectives -- in step)."""
        n = int(window_targets)
        return exact_mean_factor(n, self.accelerator.num_processes) if n > 0 else 0.0

    def _backward_scale(self, window_scale: float) -> float:
        """The factor the loss is multiplied by before backward: ``W / N`` itself, except with fp32
        gradient sums, where the power of two nearest to it (exact in any binary float, so the bf16
        backward rounds exactly as it would for the plain sum) and the remaining factor is applied to the
        fp32 sums when the window closes -- the loop's arithmetic, and mean-sized gradients for fp16."""
        if self._fp32_sums is None or window_scale == 0.0:
            return window_scale
        return 2.0 ** round(math.log2(window_scale))

    def _fp32_gradient_sums(self) -> Fp32GradientAccumulator | None:
        """bf16/fp16 weights: sum the window's micro-batch gradients in fp32, round once at its end
        (as the loop does). Not under DDP/DeepSpeed/FSDP, which own the gradient buffers."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
            return None
        if self.accelerator.num_processes > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            logger.info("low-precision weights: gradients accumulate in their own dtype (fp32 accumulation is "
                        "single-process only)")
            return None
        return Fp32GradientAccumulator(params)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        # _run_epoch sets sync_gradients on the window's last micro-batch, before training_step.
        if num_items_in_batch is not None and self.accelerator.sync_gradients:
            self._close_window(model)
        return loss

    def _close_window(self, model) -> None:
        self._mark_boundary(model)
        totals = self._tally.reduce(self.accelerator)  # one small all-reduce per update
        self._tally.reset()
        if totals.targets != self._window_targets:
            raise ValueError(
                f"loss_sum_and_count counted {totals.targets} targets in this window but count_targets "
                f"counted {self._window_targets}; the normalization uses the latter, so the override must "
                "return the same count (a sum over exactly the targets of hf_accum.loss.count_targets)"
            )
        self._take_requests(totals)
        if totals.nonfinite:
            if self._fp32_sums is not None:
                self._fp32_sums.clear()
            self._skip_nonfinite_window(model, totals)
            self._closed_window = totals  # recorded as a skipped update
            return
        if self._fp32_sums is not None:
            self._write_fp32_sums(model, totals.targets)
        if totals.targets == 0:
            self._skip_window_without_targets(model)
            logger.warning(
                "update %d: no prediction targets in the window; no gradient applied%s", self.state.global_step + 1,
                # The engine steps inside backward, before this point: it applied a zero gradient.
                " (DeepSpeed stepped with a zero gradient: momentum and weight decay still moved the weights, and "
                "the LR schedule advanced one step)"
                if self.is_deepspeed_enabled else "",
            )
        self._interval.add(totals)
        self._run_totals.add(totals)
        self._closed_window = totals

    def _skip_window_without_targets(self, model) -> None:
        """No mean exists, and zero gradients would still let AdamW decay and move weights by momentum:
        no optimizer step and, as in the loop, no LR scheduler step (the update is logged as skipped).
        Under fp16 the GradScaler insists on seeing gradients: it gets the window as an overflow, skips
        the step and the scheduler itself (and halves its scale, as after any overflow)."""
        if self.accelerator.scaler is not None:
            _poison_gradients_(model)
        else:
            drop_gradients_(model.parameters())
            self._skip_step = True

    def _write_fp32_sums(self, model, targets: int) -> None:
        """The window's fp32 gradient sums -> ``.grad``, times what ``_backward_scale`` left of ``W / N``."""
        if targets == 0:
            self._fp32_sums.clear()
            return
        window_scale = self._window_scale(self._window_targets)
        remainder = window_scale / self._backward_scale(window_scale)
        self._fp32_sums.write_gradients_(remainder)  # rounded once to the weights' dtype
        rescale_gradients_(self._fp32_sums.other_parameters(model.parameters()), remainder)

    # -- inf/NaN windows, stop and checkpoint requests -----------------------------------------
    def _mark_boundary(self, model) -> None:
        """This rank's inf/NaN-gradient flag and its pending requests join the window's all-reduce."""
        gradients: torch.Tensor | bool = False
        if self.accelerator.scaler is None and not self.is_deepspeed_enabled:
            # fp16's GradScaler skips inf/NaN gradients itself; DeepSpeed keeps gradients inside its engine.
            gradients = nonfinite_flag([p.grad for p in model.parameters()], self.args.device)
        self._tally.mark_boundary(
            nonfinite_gradients=gradients,
            stop_requested=self.run_control.stop_reason is not None,
            checkpoint_requested=self.run_control.take_checkpoint_request(),
        )

    def _take_requests(self, totals: WindowTotals) -> None:
        if self._nonfinite.record(totals.nonfinite):
            self._halt = _NONFINITE_LIMIT
        elif totals.stop_requests:
            self._halt = self.run_control.stop_reason or "stop requested on another process"
        self._save_requested = bool(totals.checkpoint_requests)

    def _skip_nonfinite_window(self, model, totals: WindowTotals) -> None:
        """Keep the window out of the weights. Without a GradScaler: drop the gradients (the optimizer then
        touches no parameter: AdamW's moments and step count stay) and tell Trainer the step was skipped (no
        LR scheduler step). Under fp16 the GradScaler skips it (and lowers its scale), as for any overflow."""
        update = self.state.global_step + 1
        if self.is_deepspeed_enabled:
            raise NonFiniteLossError(
                f"update {update}: {totals.nonfinite_reason}; DeepSpeed applies the update inside backward, so it "
                "cannot be skipped; stopping (resume from the last checkpoint after checking the data)"
            )
        if self.accelerator.scaler is not None:
            _poison_gradients_(model)
        else:
            drop_gradients_(model.parameters())
            self._skip_step = True
        self._interval.add_nonfinite()
        logger.warning(
            "update %d: %s; skipped (weights, optimizer state and LR schedule untouched), %d in a row (limit "
            "max_consecutive_nonfinite=%d)", update, totals.nonfinite_reason, self._nonfinite.consecutive,
            self._nonfinite.max_consecutive,
        )

    # -- batch plan, auto_find_batch_size, LR horizon -----------------------------------------
    def get_train_dataloader(self):
        # Called at the start of every (re)try of the training loop: an OOM retry must not
        # inherit a half-tallied window.
        self._tally.reset()
        self._interval = _LogInterval()
        self._run_totals = WindowTotals()
        # A resumed run starts from the checkpoint's updates, so `updates` holds the whole run.
        resumed = load_update_history(self._resume_checkpoint) if self._resume_checkpoint else []
        self.updates = [UpdateLog(**update) for update in resumed]
        if self._fp32_sums is not None:
            self._fp32_sums.clear()
        self._keep_effective_batch()
        dataloader = super().get_train_dataloader()
        self._micro_batches_per_epoch = len(dataloader) if has_length(dataloader) else None
        self.batch_plan = BatchPlan(
            self._train_batch_size // max(1, self.args.n_gpu),
            self.args.gradient_accumulation_steps,
            self.accelerator.num_processes,
            num_nodes(),
        )
        if self.args.should_log:
            logger.info("%s (sequences per update)", self.batch_plan.describe())
            dataset = self.train_dataset
            if dataset is not None and has_length(dataset):
                message = repeated_examples_warning(len(dataset), self.batch_plan, self.accelerator.even_batches)
                if message:
                    logger.warning(message)
        return dataloader

    def _keep_effective_batch(self) -> None:
        """auto_find_batch_size shrinks ``_train_batch_size`` after an OOM (accelerate: x0.9 per retry);
        raise K so that micro-batch x K stays the requested number of sequences per device.

        The offered size need not divide that number (4 -> 3 for 8 = 4 x 2), so we take the largest
        divisor not above it (3 -> 2, K = 4): still below the size that ran out of memory, and exact.
        """
        requested_batch, requested_steps = self._requested_batch
        if self._train_batch_size == requested_batch:
            self.args.gradient_accumulation_steps = requested_steps
            return
        sequences = requested_batch * requested_steps
        offered = self._train_batch_size
        micro_batch = max(size for size in range(1, offered + 1) if sequences % size == 0)
        steps = sequences // micro_batch
        logger.warning(
            "auto_find_batch_size: micro-batch %d -> %d (offered %d), gradient_accumulation_steps %d -> %d: "
            "effective batch kept at %d sequences per device",
            requested_batch, micro_batch, offered, requested_steps, steps, sequences,
        )
        self._train_batch_size = micro_batch
        self.args.gradient_accumulation_steps = steps

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Horizon in optimizer updates, from the data plan (short last windows count as updates)."""
        planned = num_training_steps
        if self._micro_batches_per_epoch is not None:
            planned = planned_updates(
                self._micro_batches_per_epoch,
                self.args.gradient_accumulation_steps,
                self.args.num_train_epochs,
                self.args.max_steps,
            )
            if planned != num_training_steps:
                logger.warning("LR horizon: Trainer planned %d steps, the data plan has %d updates; using %d",
                               num_training_steps, planned, planned)
            if self.args.should_log:
                logger.info("LR schedule over %d updates (%d micro-batches per epoch per process)",
                            planned, self._micro_batches_per_epoch)
        return super().create_scheduler(num_training_steps=planned, optimizer=optimizer)

    # -- logging ------------------------------------------------------------------------------
    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                 learning_rate=None):
        # Trainer calls this after every update (and once more at the end of an epoch, with no new window);
        # the update is recorded after it, so that an evaluation it ran is part of the record.
        self._eval_loss_of_update = None
        self._closing_update_args = (grad_norm, learning_rate)
        super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=learning_rate
        )
        update = self._closing_update()
        self._closed_window = None
        if update is not None:
            self.updates.append(update)
            if self._on_update is not None:
                self._on_update(update)

    def _closing_update(self) -> UpdateLog | None:
        """The log of the update Trainer is closing (None at an epoch end without a new window); a
        checkpoint written meanwhile includes it."""
        totals = self._closed_window
        if totals is None:
            return None
        grad_norm, learning_rate = self._closing_update_args
        skip_reason = totals.nonfinite_reason if totals.nonfinite else "" if totals.targets else "no targets in window"
        applied = not skip_reason
        return UpdateLog(
            step=self.state.global_step, epoch=float(self.state.epoch or 0.0), loss=totals.mean_loss,
            learning_rate=float(learning_rate if learning_rate is not None else self._get_learning_rate()),
            grad_norm=float(grad_norm) if grad_norm is not None and applied else None, targets=totals.targets,
            sequences=totals.sequences, padding_fraction=totals.padding_fraction, micro_batches=totals.micro_batches,
            applied=applied, skip_reason=skip_reason, nonfinite=totals.nonfinite, eval_loss=self._eval_loss_of_update,
            aux_loss=totals.mean_aux_loss if totals.aux_loss_sum else None,
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training logs carry the exact per-target loss of the logged updates and their shape."""
        if "loss" in logs and self._interval.updates:
            logs.update(self._interval.as_logs())
            self._interval = _LogInterval()
        if "train_loss" in logs and self._run_totals.targets:
            # Trainer's final train_loss is a mean of per-update means; ours weighs every target alike.
            logs["train_loss"] = self._run_totals.mean_loss
        super().log(logs, start_time)

    # -- checkpoints and resume ---------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, written atomically: into a staging directory (Trainer writes where
        ``_get_output_dir`` says), renamed into place once every rank is done and the batch plan -- the
        completion marker -- is written; only then are old checkpoints rotated out."""
        run_dir = self._get_output_dir(trial)
        with staged_checkpoint(
            run_dir, self.state.global_step, commits=self.args.should_save,
            barrier=self.accelerator.wait_for_everyone, seal=self._seal_checkpoint,
        ) as staged:
            self._staging_run_dir = os.path.dirname(staged)
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging_run_dir = None
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)

    def _get_output_dir(self, trial) -> str:
        return self._staging_run_dir or super()._get_output_dir(trial)

    def _seal_checkpoint(self, staged: str) -> None:
        """Before the rename: paths Trainer recorded inside the staging directory point to the final one."""
        best = self.state.best_model_checkpoint
        staging = os.path.dirname(staged)
        if best is not None and os.path.dirname(best) == staging:
            final_dir = os.path.dirname(staging)
            self.state.best_model_checkpoint = os.path.join(final_dir, os.path.basename(best))
            if os.path.isfile(os.path.join(staged, TRAINER_STATE_NAME)):
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        closing = self._closing_update()  # Trainer saves before this update is recorded
        history = self.updates + ([closing] if closing is not None else [])
        save_update_history(staged, [asdict(update) for update in history])
        save_batch_plan(staged, self.batch_plan)

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        """``resume_from_checkpoint=True``: the latest complete checkpoint of ``output_dir``. Raises
        :class:`~hf_accum.control.TrainingStopped` after a stop signal or request (checkpoint written) and
        :class:`~hf_accum.control.NonFiniteLossError` at the inf/NaN limit."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = resolve_resume_checkpoint(True, self.args.output_dir)
        if isinstance(checkpoint, str):
            self._check_resume_plan(checkpoint)
        self._resume_checkpoint = checkpoint if isinstance(checkpoint, str) else None
        self._halt, self._skip_step, self._save_requested = None, False, False
        self._nonfinite.consecutive = 0
        self.run_control.reset()
        keep_4bit_training_layout(self.model)  # evaluations must not repack 4-bit weights (hf_accum.compat)
        with StopSignals(self.run_control, self._stop_on_signals):
            output = super().train(checkpoint, *args, **kwargs)
        self._raise_if_halted()
        if "train_loss" in output.metrics:  # set by log() above: the per-target mean of the whole run
            output = output._replace(training_loss=output.metrics["train_loss"])
        return output

    def _raise_if_halted(self) -> None:
        if self._halt is None:
            return
        step = self.state.global_step
        checkpoint = checkpoint_path(self.args.output_dir, step)
        checkpoint = checkpoint if is_complete_checkpoint(checkpoint) else None
        if self._halt == _NONFINITE_LIMIT:
            raise self._nonfinite.error(step, checkpoint)
        stopped = TrainingStopped(self._halt, step, checkpoint)
        if self.args.should_log:
            logger.warning("%s", stopped)
        raise stopped

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """Stock ``eval_loss`` averages per-batch means weighted by rows; ours is the mean over every
        target of the evaluation set (all batches, all ranks), like the training loss."""
        self._eval_tally.reset()
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        totals = self._eval_tally.reduce(self.accelerator)  # every rank runs the evaluation loop
        self._eval_tally.reset()
        if totals.targets and f"{metric_key_prefix}_loss" in output.metrics:
            output.metrics[f"{metric_key_prefix}_loss"] = totals.mean_loss
            self._eval_loss_of_update = totals.mean_loss  # recorded with the update that triggered it, if any
        return output

    def _check_resume_plan(self, checkpoint: str) -> None:
        """Refuse to resume with other batch arithmetic: Trainer maps ``global_step`` to a data position
        with the *current* K and micro-batch, and the effective batch would silently change."""
        check_resume_engine(checkpoint, deepspeed=self.is_deepspeed_enabled)
        micro_batch, accumulation = self._requested_batch
        current = BatchPlan(micro_batch // max(1, self.args.n_gpu), accumulation, self.accelerator.num_processes)
        # auto_find_batch_size re-derives (micro-batch, K) for the same effective batch.
        if check_resume_plan(checkpoint, current, same_global_batch_ok=self.args.auto_find_batch_size) is None:
            logger.warning("%s has no %s; cannot check that the batch plan is unchanged", checkpoint, PLAN_FILE)


class _BoundaryActions(TrainerCallback):
    """Carries out AccumTrainer's update-boundary decisions through Trainer's own flow (``_run_epoch`` is
    not overridden): a skipped inf/NaN window must not step the LR scheduler; a checkpoint request or a
    stop saves a checkpoint; a stop ends training."""

    def __init__(self, trainer: AccumTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args, state: TrainerState, control, optimizer=None, **kwargs):
        if self.trainer._skip_step:
            _set_step_skipped(optimizer, True)

    def on_step_end(self, args, state: TrainerState, control, optimizer=None, **kwargs):
        trainer = self.trainer
        if trainer._skip_step:
            _set_step_skipped(optimizer, False)
            trainer._skip_step = False
        if trainer._save_requested or trainer._halt is not None:
            control.should_save = True
            trainer._save_requested = False
        if trainer._halt is not None:
            control.should_training_stop = True


def _set_step_skipped(optimizer, skipped: bool) -> None:
    """Trainer steps the LR scheduler unless ``accelerator.optimizer_step_was_skipped``, which reads the
    overflow flag of each ``AcceleratedOptimizer`` (set by fp16's GradScaler). A window we skipped sets it
    between ``optimizer.step()`` and that check (``on_optimizer_step``), and clears it after."""
    if not hasattr(optimizer, "_is_overflow"):
        raise RuntimeError(
            "accelerate's AcceleratedOptimizer has no _is_overflow flag any more: AccumTrainer cannot keep the LR "
            "scheduler still on a skipped inf/NaN update with this accelerate version"
        )
    optimizer._is_overflow = skipped


def _poison_gradients_(model) -> None:
    """fp16: make sure the GradScaler sees the window as an overflow (an inf/NaN loss nearly always leaves
    inf/NaN gradients already) so that it skips the step and the scheduler, as for any overflow. With no
    gradient at all it would refuse to step ("No inf checks were recorded"): one NaN gradient is made."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in trainable:
        if parameter.grad is not None:
            parameter.grad.fill_(float("nan"))
            return
    if trainable:
        trainable[0].grad = torch.full_like(trainable[0], float("nan"))


class _Fp32SumsForTraining(TrainerCallback):
    """The fp32 accumulation hooks live from the start to the end of training (the model may be used
    without the trainer afterwards)."""

    def __init__(self, trainer: AccumTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer._fp32_grad_accumulation and self.trainer._fp32_sums is None:
            self.trainer._fp32_sums = self.trainer._fp32_gradient_sums()

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer._fp32_sums is not None:
            self.trainer._fp32_sums.remove()
            self.trainer._fp32_sums = None


class _LogInterval:
    """Window totals (already summed over ranks) since the last log line."""

    def __init__(self) -> None:
        self.totals = WindowTotals()
        self.updates = 0
        self.skipped = 0
        self.skipped_nonfinite = 0

    def add(self, window: WindowTotals) -> None:
        self.totals.add(window)
        self.updates += 1
        self.skipped += window.targets == 0

    def add_nonfinite(self) -> None:
        """A window skipped for inf/NaN: counted, its (inf/nan) loss kept out of the interval's mean."""
        self.updates += 1
        self.skipped_nonfinite += 1

    def as_logs(self) -> dict[str, float]:
        logs = {
            # Token-weighted over the interval: with logging_steps=1, the exact mean of the window.
            "loss": self.totals.mean_loss,
            "tokens_per_update": self.totals.targets / self.updates,
            "sequences_per_update": self.totals.sequences / self.updates,
            "padding_fraction": self.totals.padding_fraction,
        }
        if self.totals.aux_loss_sum:  # MoE router loss, logged apart from the cross-entropy "loss"
            logs["aux_loss"] = self.totals.mean_aux_loss
        if self.skipped:
            logs["updates_without_targets"] = self.skipped
        if self.skipped_nonfinite:
            logs["updates_skipped_nonfinite"] = self.skipped_nonfinite
        return logs


def _labels(batch: dict[str, Any]) -> torch.Tensor:
    if "labels" not in batch:
        raise KeyError(f"AccumTrainer needs 'labels' in every batch (the collator gave {sorted(batch)})")
    return batch["labels"]
