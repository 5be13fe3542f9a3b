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

from hf_accum.accumulation import batch_shape_counts
from hf_accum.losses.token_loss import unwrap_model
from hf_accum.trainer.trl_metrics import MODES, ExactTrlMetrics, UnitMeans, current_mode

try:
    from trl import SFTTrainer
except ImportError as error:  # TRL is an optional extra
    raise ImportError("AccumSFTTrainer needs TRL: pip install 'hf_accum[trl]'") from error

# TRL warns that label smoothing costs it an extra forward pass; AccumTrainer computes label
# smoothing from its one forward's logits, so the warning does not apply here.
_NOT_APPLICABLE_WARNING = r"`label_smoothing_factor` is deprecated in `SFTTrainer`"

# TRL's metrics as per-target means: the summed column -> the name TRL logs.
_TOKEN_METRICS = {"entropy_sum": "entropy", "top1_hits": "mean_token_accuracy"}


class AccumSFTTrainer(ExactTrlMetrics, SFTTrainer):  # type: ignore[misc]  # TRL types loss_is_scaled_for_ga as None
    """``trl.SFTTrainer`` whose every update applies the exact big-batch gradient.

    Same constructor as ``SFTTrainer`` (model, ``SFTConfig``, datasets in TRL's formats,
    ``processing_class``, ``peft_config``, ...), plus AccumTrainer's ``loss_kind``. Everything
    AccumTrainer guarantees holds (see :class:`hf_accum.AccumTrainer`); TRL's logged metrics
    ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` (and their ``eval_`` versions) are kept.

    A MoE router auxiliary loss (``output_router_logits=True``) is added as in every front-end
    (:class:`hf_accum.losses.micro_batch.MicroBatchLoss`) and logged as ``aux_loss``. Refused, because
    AccumTrainer's loss would silently drop it: ``loss_type="dft"``, as well as ``compute_loss_func``.
    """

    metric_tallies: dict[str, UnitMeans]

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
        self.metric_tallies = {mode: UnitMeans("targets", _TOKEN_METRICS, self.args.device) for mode in MODES}
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
            self.metric_tallies[current_mode(self)].add(targets=stats.targets, entropy_sum=stats.entropy_sum,
                                                        top1_hits=stats.top1_hits, tokens=real_tokens)
        return result
