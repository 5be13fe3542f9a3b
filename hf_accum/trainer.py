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
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, has_length

from hf_accum.accumulation import (
    Fp32GradientAccumulator,
    WindowTally,
    WindowTotals,
    drop_gradients_,
    exact_mean_factor,
    global_sum,
    rescale_gradients_,
)
from hf_accum.fused_loss import MicroBatchLoss
from hf_accum.loss import LossKind, count_targets, infer_loss_kind, model_problem_type, resolve_loss_kind, token_loss_sum
from hf_accum.schedule import BatchPlan, planned_updates, repeated_examples_warning

logger = logging.getLogger(__name__)

# Written into every checkpoint folder: the batch arithmetic the checkpoint was trained with.
PLAN_FILE = "hf_accum_plan.json"


class AccumTrainer(Trainer):
    """``transformers.Trainer`` with exact gradient accumulation for every model and rank setting.

    Same constructor and ``TrainingArguments`` as ``Trainer``, plus ``loss_kind`` (``"causal_lm"``,
    ``"token"`` or ``"sequence"``; when omitted, inferred from the model class, else from the model's
    own loss on the first micro-batch), ``fused_loss`` (causal LMs: the loss from the hidden states and
    the output layer, never the full logits; default True) and ``fp32_grad_accumulation`` (bf16/fp16
    weights sum their micro-batch gradients in fp32; default True, single process).

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
      accumulation or world size (it would silently change the effective batch).

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
        fused_loss: bool = True,
        fp32_grad_accumulation: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
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
        self._run_totals = WindowTotals()  # every window of this train() call: the exact final train_loss
        self._eval_tally = WindowTally(device=self.args.device)  # the exact eval_loss
        if self.args.world_size > 1 and not self.args.average_tokens_across_devices:
            logger.info(
                "average_tokens_across_devices=False is ignored: AccumTrainer always normalizes by the "
                "target count summed over all ranks (the only exact mean under DDP)"
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
        return MicroBatchLoss(
            loss_kind, self.args.label_smoothing_factor, self._problem_type, self.loss_sum_and_count,
            fused=fused_loss and not overridden,
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
        forward_inputs = {key: value for key, value in inputs.items() if key != "labels"}
        # No labels to the model: no model-side loss. Fused for causal LMs while training (outputs.logits
        # then holds the loss), else the forward's logits through loss_sum_and_count.
        outputs, loss_sum, n_targets = self._micro_batch_loss(model, forward_inputs, labels, need_logits=return_outputs)
        if num_items_in_batch is None:
            self._eval_tally.add(loss_sum, n_targets, inputs)
            loss = loss_sum / torch.clamp(torch.as_tensor(n_targets, device=loss_sum.device), min=1)
        else:
            self._tally.add(loss_sum, n_targets, inputs)
            loss = loss_sum * self._backward_scale(self._window_scale(num_items_in_batch))
        return (loss, outputs) if return_outputs else loss

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
        totals = self._tally.reduce(self.accelerator)  # one small all-reduce per update
        self._tally.reset()
        if totals.targets != self._window_targets:
            raise ValueError(
                f"loss_sum_and_count counted {totals.targets} targets in this window but count_targets "
                f"counted {self._window_targets}; the normalization uses the latter, so the override must "
                "return the same count (a sum over exactly the targets of hf_accum.loss.count_targets)"
            )
        if self._fp32_sums is not None:
            self._write_fp32_sums(model, totals.targets)
        if totals.targets == 0:
            # No mean exists; zero gradients would still let AdamW decay and move weights by momentum.
            drop_gradients_(model.parameters())
            logger.warning(
                "update %d: no prediction targets in the window; no gradient applied", self.state.global_step + 1
            )
        self._interval.add(totals)
        self._run_totals.add(totals)

    def _write_fp32_sums(self, model, targets: int) -> None:
        """The window's fp32 gradient sums -> ``.grad``, times what ``_backward_scale`` left of ``W / N``."""
        if targets == 0:
            self._fp32_sums.clear()
            return
        window_scale = self._window_scale(self._window_targets)
        remainder = window_scale / self._backward_scale(window_scale)
        self._fp32_sums.write_gradients_(remainder)  # rounded once to the weights' dtype
        rescale_gradients_(self._fp32_sums.other_parameters(model.parameters()), remainder)

    # -- batch plan, auto_find_batch_size, LR horizon -----------------------------------------
    def get_train_dataloader(self):
        # Called at the start of every (re)try of the training loop: an OOM retry must not
        # inherit a half-tallied window.
        self._tally.reset()
        self._interval = _LogInterval()
        self._run_totals = WindowTotals()
        if self._fp32_sums is not None:
            self._fp32_sums.clear()
        self._keep_effective_batch()
        dataloader = super().get_train_dataloader()
        self._micro_batches_per_epoch = len(dataloader) if has_length(dataloader) else None
        self.batch_plan = BatchPlan(
            self._train_batch_size // max(1, self.args.n_gpu),
            self.args.gradient_accumulation_steps,
            self.accelerator.num_processes,
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
        super()._save_checkpoint(model, trial)
        if self.args.should_save and self.batch_plan is not None:
            folder = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, PLAN_FILE), "w") as handle:
                json.dump(_plan_dict(self.batch_plan), handle)

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, str):
            self._check_resume_plan(checkpoint)
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        if "train_loss" in output.metrics:  # set by log() above: the per-target mean of the whole run
            output = output._replace(training_loss=output.metrics["train_loss"])
        return output

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
        return output

    def _check_resume_plan(self, checkpoint: str) -> None:
        """Refuse to resume with other batch arithmetic: Trainer maps ``global_step`` to a data position
        with the *current* K and micro-batch, and the effective batch would silently change."""
        path = os.path.join(checkpoint, PLAN_FILE)
        if not os.path.isfile(path):
            logger.warning("%s has no %s; cannot check that the batch plan is unchanged", checkpoint, PLAN_FILE)
            return
        with open(path) as handle:
            saved = BatchPlan(**json.load(handle))
        micro_batch, accumulation = self._requested_batch
        current = BatchPlan(micro_batch // max(1, self.args.n_gpu), accumulation, self.accelerator.num_processes)
        if saved == current:
            return
        if (
            self.args.auto_find_batch_size  # it re-derives (micro-batch, K) for the same effective batch
            and saved.global_batch_size == current.global_batch_size
            and saved.num_processes == current.num_processes
        ):
            return
        raise ValueError(
            f"cannot resume from {checkpoint}: it was trained with {saved.describe()}, this run has "
            f"{current.describe()} ({_plan_differences(saved, current)}). Resuming would change the effective "
            "batch and misplace the data position; resume with the checkpoint's settings"
        )


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

    def add(self, window: WindowTotals) -> None:
        self.totals.add(window)
        self.updates += 1
        self.skipped += window.targets == 0

    def as_logs(self) -> dict[str, float]:
        logs = {
            # Token-weighted over the interval: with logging_steps=1, the exact mean of the window.
            "loss": self.totals.mean_loss,
            "tokens_per_update": self.totals.targets / self.updates,
            "sequences_per_update": self.totals.sequences / self.updates,
            "padding_fraction": self.totals.padding_fraction,
        }
        if self.skipped:
            logs["updates_without_targets"] = self.skipped
        return logs


def _labels(batch: dict[str, Any]) -> torch.Tensor:
    if "labels" not in batch:
        raise KeyError(f"AccumTrainer needs 'labels' in every batch (the collator gave {sorted(batch)})")
    return batch["labels"]


def _plan_differences(saved: BatchPlan, current: BatchPlan) -> str:
    labels = {
        "micro_batch_size": "per-device micro-batch",
        "accumulation_steps": "gradient_accumulation_steps",
        "num_processes": "number of processes",
    }
    return "; ".join(
        f"{label} {getattr(saved, key)} -> {getattr(current, key)}"
        for key, label in labels.items()
        if getattr(saved, key) != getattr(current, key)
    )


def _plan_dict(plan: BatchPlan) -> dict[str, int]:
    return {
        "micro_batch_size": plan.micro_batch_size,
        "accumulation_steps": plan.accumulation_steps,
        "num_processes": plan.num_processes,
    }
