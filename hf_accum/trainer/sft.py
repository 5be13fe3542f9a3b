"""AccumSFTTrainer: TRL's ``SFTTrainer`` with AccumTrainer's exact gradient accumulation.

This module owns the composition of the two trainers and nothing else. TRL keeps what it owns:
dataset preparation (chat templates, prompt/completion, ``assistant_only_loss`` masks, packing),
its collators (padding, ``padding_free``), PEFT wrapping, model cards. AccumTrainer keeps what it
owns: the loss is summed over the prediction targets and normalized once per update by the target
count of the whole update on all ranks (:func:`hf_accum.accumulation.exact_mean_factor`), whatever
``average_tokens_across_devices`` says; the LR horizon in updates. TRL encodes every masking
choice in ``labels`` (-100), so AccumTrainer's target count is TRL's.

What the composition has to repair: ``AccumTrainer.compute_loss`` replaces
``SFTTrainer.compute_loss``, where TRL records its training metrics (``entropy``,
``mean_token_accuracy``, ``num_tokens``). The micro-batch loss computes them as sums with a count
(:class:`hf_accum.fused.loss.TokenStats`: entropy of ``softmax(logits)`` and first-arg-max hits over
the prediction targets, TRL's definitions) in the same pass as the loss: inside the fused linear
cross-entropy's chunks while training (no ``(tokens x vocab)`` logits, so the fused path stays on),
from the logits on the logits path (evaluation, DeepSpeed, heads that are not fused).
:meth:`AccumSFTTrainer.compute_loss` collects them. They are summed per rank on the device and
reduced over ranks with one all-reduce per update (stock TRL gathers three scalars and syncs the host
on every micro-batch), and logged as token-weighted means over the logged updates (stock TRL averages
per-micro-batch ratios; the two agree when a log line covers one micro-batch).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers.trainer_utils import EvalLoopOutput

from hf_accum.accumulation import DeviceSums, batch_shape_counts
from hf_accum.compat import add_trl_train_tokens, trl_metrics, trl_train_tokens
from hf_accum.losses.token_loss import unwrap_model
from hf_accum.trainer import AccumTrainer

try:
    from trl import SFTTrainer
except ImportError as error:  # TRL is an optional extra
    raise ImportError("AccumSFTTrainer needs TRL: pip install 'hf_accum[trl]'") from error

# TRL warns that label smoothing costs it an extra forward pass; AccumTrainer computes label
# smoothing from its one forward's logits, so the warning does not apply here.
_NOT_APPLICABLE_WARNING = r"`label_smoothing_factor` is deprecated in `SFTTrainer`"

# Per-rank sums kept for TRL's metrics, in this order.
_STATS = ("targets", "entropy_sum", "top1_hits", "tokens")


class AccumSFTTrainer(AccumTrainer, SFTTrainer):  # type: ignore[misc]  # TRL types loss_is_scaled_for_ga as None
    """``trl.SFTTrainer`` whose every update applies the exact big-batch gradient.

    Same constructor as ``SFTTrainer`` (model, ``SFTConfig``, datasets in TRL's formats,
    ``processing_class``, ``peft_config``, ...), plus AccumTrainer's ``loss_kind``. Everything
    AccumTrainer guarantees holds (see :class:`hf_accum.AccumTrainer`); TRL's logged metrics
    ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` (and their ``eval_`` versions) are kept.

    A MoE router auxiliary loss (``output_router_logits=True``) is added as in every front-end
    (:class:`hf_accum.losses.micro_batch.MicroBatchLoss`) and logged as ``aux_loss``. Refused, because
    AccumTrainer's loss would silently drop it: ``loss_type="dft"``, as well as ``compute_loss_func``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        sft_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        loss_type = getattr(sft_args, "loss_type", "nll")
        if loss_type != "nll":
            raise ValueError(
                f"AccumSFTTrainer supports loss_type='nll' only (got {loss_type!r}); for another loss override "
                "AccumSFTTrainer.loss_sum_and_count(outputs, labels, inputs) -> (loss_sum, n_targets)"
            )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOT_APPLICABLE_WARNING, category=FutureWarning)
            super().__init__(*args, **kwargs)
        self._sync_router_coef()
        self._stats = {"train": _TokenStats(self.args.device), "eval": _TokenStats(self.args.device)}
        self._micro_batch_loss.token_stats = True  # TRL's metrics, from the loss's own pass (fused or not)

    def _sync_router_coef(self) -> None:
        """TRL writes ``SFTConfig.router_aux_loss_coef`` into the model's config, but MoE models read the
        coefficient they copied at construction (``model.router_aux_loss_coef``), as does the router term every
        front-end adds (:func:`hf_accum.losses.model_loss.model_loss_terms`): copy TRL's value there too."""
        inner = unwrap_model(self.model)
        if self.aux_loss_enabled and hasattr(inner, "router_aux_loss_coef"):
            inner.router_aux_loss_coef = self.router_aux_loss_coef

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """AccumTrainer's loss; TRL's metric sums of the same micro-batch are recorded on the side."""
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        stats = self._micro_batch_loss.last_token_stats
        if stats is not None:
            _, real_tokens, _ = batch_shape_counts(inputs)
            mode = "train" if self.model is not None and self.model.training else "eval"
            self._stats[mode].add(stats.targets, stats.entropy_sum, stats.top1_hits, real_tokens)
        return result

    def get_train_dataloader(self) -> DataLoader:
        # Called at the start of every (re)try of the training loop: an auto_find_batch_size retry
        # after an OOM must not inherit a half-counted window (AccumTrainer resets its tallies too).
        self._stats["train"].reset()
        return super().get_train_dataloader()

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        # The window's last micro-batch (as in AccumTrainer): one all-reduce for the metrics.
        if num_items_in_batch is not None and self.accelerator.sync_gradients:
            window = self._stats["train"].reduce(self.accelerator)
            add_trl_train_tokens(self, int(window["tokens"]))  # TRL's running count, all ranks
        return loss

    def evaluation_loop(self, dataloader: DataLoader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        self._stats["eval"].reset()
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        self._stats["eval"].reduce(self.accelerator)  # every rank runs the evaluation loop
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Hand TRL's ``log`` (which averages ``self._metrics[mode]``) one token-weighted value per metric."""
        mode = "train" if self.model is not None and self.model.training else "eval"
        metrics = self._stats[mode].take_means()
        if metrics:
            trl_logged = trl_metrics(self, mode)
            trl_logged.clear()
            trl_logged.update({name: [value] for name, value in metrics.items()})
            trl_logged["num_tokens"] = [trl_train_tokens(self)]
        super().log(logs, start_time)


class _TokenStats:
    """Per-rank sums of TRL's metric inputs (:class:`hf_accum.accumulation.DeviceSums`: on the device, one
    all-reduce per update), and the reduced totals since the last log line."""

    def __init__(self, device: torch.device | str) -> None:
        self._pending = DeviceSums(_STATS, device)
        self._totals = torch.zeros(len(_STATS), dtype=torch.float64)

    def add(self, targets: torch.Tensor, entropy_sum: torch.Tensor, top1_hits: torch.Tensor,
            tokens: int | torch.Tensor) -> None:
        self._pending.add(targets=targets, entropy_sum=entropy_sum, top1_hits=top1_hits, tokens=tokens)

    def reduce(self, accelerator: Any) -> dict[str, float]:
        """Fold this rank's pending sums, summed over all ranks, into the totals. A collective."""
        reduced = self._pending.reduce(accelerator)
        self._totals += torch.tensor([reduced[name] for name in _STATS], dtype=torch.float64)
        return reduced

    def take_means(self) -> dict[str, float]:
        """TRL's per-target means over the totals (then cleared); empty when no target was seen."""
        targets, entropy_sum, top1_hits, _ = self._totals.tolist()
        self._totals.zero_()
        if targets == 0:
            return {}
        return {"entropy": entropy_sum / targets, "mean_token_accuracy": top1_hits / targets}

    def reset(self) -> None:
        self._pending.reset()
        self._totals.zero_()
