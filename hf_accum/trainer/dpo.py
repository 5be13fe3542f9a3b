"""AccumDPOTrainer: TRL's ``DPOTrainer`` whose every update applies the big batch's gradient of the mean over ALL
its preference pairs.

This module owns the composition of AccumTrainer with TRL's ``DPOTrainer`` and nothing else. TRL keeps what it
owns: dataset preparation (prompt/chosen/rejected, chat templates, tokenization), its collator, the reference
model (a copy, the PEFT adapter disabled, or precomputed reference log-probs), ``sync_ref_model``, model cards.
:mod:`hf_accum.losses.preference` owns the math of one micro-batch (:class:`~hf_accum.losses.preference.DPOPairLoss`:
the SUM over the micro-batch's pairs of the pair loss and the number of pairs, and the ``sft`` term as a sum over the
chosen completions' tokens with their count). AccumTrainer owns the normalization: each term's count is taken
over the window's micro-batches on all ranks before backward and each micro-batch backpropagates
``sum_j S_jk * W / N_j`` (:mod:`hf_accum.trainer.window`).

Why it is needed: TRL 1.16 takes each micro-batch's *mean* over its pairs and divides it by K, which weighs a
pair by ``1 / (K * P_k)`` instead of ``1 / P`` -- wrong whenever micro-batches or ranks hold different numbers of
pairs (a short last batch, ``even_batches=False``) -- and its ``sft`` term is a per-micro-batch token mean. Its
metrics gather per-micro-batch tensors across ranks, which fails (gloo size mismatch) when ranks hold different
numbers of pairs.

What the composition has to repair:

* the batches: TRL's collator marks completions with ``completion_mask``; :class:`PairLabels` turns it into
  ``labels`` (-100 outside the completions), the convention every front-end counts from;
* the log-probs: TRL's fused LM head accumulates in float32 whatever the model's dtype; here they come from our
  fused log-probs (:mod:`hf_accum.fused.logprobs`: chunked, no ``[tokens, vocab]`` logits, sums in at least
  float32 and float64 for a float64 model), for the policy, the live reference and the precomputed reference
  alike; ``fused_loss=False`` (or a head that cannot be fused) takes the logits in the model's own dtype
  (:func:`hf_accum.losses.preference.completion_logps`). Both are exact to rounding on float64 models;
* the precomputed reference log-probs (``precompute_ref_log_probs=True``): TRL 1.16 hands them from rank 0 to the
  other ranks through a ``datasets`` cache file, which a dataset built in memory keeps in each process's own
  temporary directory (``FileNotFoundError`` on rank 1); here every rank gathers them all and keeps them in memory
  (:meth:`AccumDPOTrainer._precompute_ref_logps`), on any number of processes, uneven ranks included;
* the metrics: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
  ``logps/chosen``, ``logps/rejected`` are sums over pairs on each rank, all-reduced once per update and
  logged as pair-weighted means over the logged updates (exact over the update like the loss); ``num_tokens``
  counts the attended tokens of every rank.

Refused before any model loads (one line naming the setting): loss types that are not sums over pairs or chosen
tokens (``aot``, ``aot_unpaired``, ``apo_*``, ...: only :data:`hf_accum.losses.preference.SUPPORTED_LOSS_TYPES`),
``ld_alpha``, ``f_divergence_type`` other than ``reverse_kl``, ``use_weighting``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hf_accum.compat import (
    evened_batches,
    trl_precompute_model,
    trl_reference_context,
    trl_without_gradient_checkpointing,
)
from hf_accum.errors import InputError
from hf_accum.fused.logprobs import FusedLogProbs
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.losses.preference import (
    IGNORE_INDEX,
    REFERENCE_KEYS,
    SUPPORTED_LOSS_TYPES,
    DPOPairLoss,
    completion_logps,
    fused_completion_logps,
)
from hf_accum.trainer.trl_metrics import MODES, ExactTrlMetrics, UnitMeans, current_mode

try:
    from trl import DPOTrainer
except ImportError as error:  # TRL is an optional extra
    raise ImportError("AccumDPOTrainer needs TRL: pip install 'hf_accum[trl]'") from error

_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected")
# Batch keys that are not inputs of the model's forward (TRL's `_non_model_keys`, plus our labels).
_NOT_MODEL_INPUTS = {"completion_mask", "labels", *REFERENCE_KEYS}


def check_dpo_args(args: Any) -> None:
    """Refuse, before TRL loads anything, the settings whose loss is not a sum over pairs or chosen tokens."""
    if args is None:
        return  # TRL's defaults: loss_type sigmoid
    loss_types = args.loss_type if isinstance(args.loss_type, (list, tuple)) else [args.loss_type]
    for loss_type in loss_types:
        if loss_type not in SUPPORTED_LOSS_TYPES:
            whole_batch = " depends on the whole batch" if loss_type in ("aot", "aot_unpaired") else ""
            raise InputError(
                f"DPOConfig.loss_type={loss_type!r}{whole_batch}: AccumDPOTrainer supports loss types that are a sum "
                f"over pairs (or chosen tokens), exact over every update: {', '.join(SUPPORTED_LOSS_TYPES)}"
            )
    if not any(loss_type != "sft" for loss_type in loss_types):
        raise InputError(f"DPOConfig.loss_type={loss_types!r}: AccumDPOTrainer needs at least one pair loss type "
                         f"({', '.join(t for t in SUPPORTED_LOSS_TYPES if t != 'sft')})")
    refused = {
        "ld_alpha": (getattr(args, "ld_alpha", None), None),
        "f_divergence_type": (getattr(args, "f_divergence_type", "reverse_kl"), "reverse_kl"),
        "use_weighting": (getattr(args, "use_weighting", False), False),
    }
    for key, (value, supported) in refused.items():
        if value != supported:
            raise InputError(f"DPOConfig.{key}={value!r} is not supported by AccumDPOTrainer (allowed: {supported!r})")


class PairLabels:
    """Wraps TRL's preference collator: ``labels`` = ``input_ids`` with -100 outside the completions (TRL's
    ``completion_mask``), which is dropped. Rows stay TRL's: chosen ``[0, P)``, rejected ``[P, 2P)``.

    Precomputed reference log-probs are taken from the examples again in float64: TRL's collator builds them
    with ``torch.tensor(list of floats)``, i.e. in the default float32 (a ~1e-7 relative error floor)."""

    def __init__(self, collator: Callable) -> None:
        self.collator = collator

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return with_labels(self.collator(examples), examples)


def with_labels(batch: dict[str, Any], examples: list[dict] | None = None) -> dict[str, Any]:
    """``batch`` in :class:`PairLabels`' layout (unchanged when it has ``labels`` already)."""
    if "completion_mask" in batch:
        completion = batch.pop("completion_mask")
        batch["labels"] = batch["input_ids"].masked_fill(completion == 0, IGNORE_INDEX)
    for key in REFERENCE_KEYS:
        if examples and key in batch and all(key in example for example in examples):
            batch[key] = torch.tensor([float(example[key]) for example in examples], dtype=torch.float64)
    return batch


class AccumDPOTrainer(ExactTrlMetrics, DPOTrainer):  # type: ignore[misc]  # TRL types loss_is_scaled_for_ga as None
    """``trl.DPOTrainer`` whose every update applies the exact big-batch gradient of the mean pair loss.

    Same constructor as ``DPOTrainer`` (model, ``ref_model``, ``DPOConfig``, datasets in TRL's preference formats,
    ``processing_class``, ``peft_config``, ...), plus AccumTrainer's options. The update's loss is
    ``sum_t w_t * mean over all pairs of the update of loss_t`` over the pair loss types of ``loss_type`` (with
    ``loss_weights``), plus, for ``"sft"`` in ``loss_type``, its weight times the mean over all chosen completion
    tokens of the update of ``-log p`` -- all micro-batches, all ranks, short last windows, uneven ranks
    (``accelerator_config={"even_batches": False}``) included. See the module docstring for what is refused.
    """

    metric_tallies: dict[str, UnitMeans]
    log_eval_tokens = False  # TRL's DPOTrainer logs num_tokens in training only

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_dpo_args(kwargs.get("args", args[2] if len(args) > 2 else None))
        # The reference's log-probs, fused as the policy's (TRL's precompute pass runs inside its constructor).
        settings = kwargs.get("accumulation")  # AccumulationSettings, or the flat fused_loss (AccumTrainer's adapter)
        fused = settings.fused_loss if settings is not None else kwargs.get("fused_loss", True)
        self._reference_logps = FusedLogProbs() if fused else None
        super().__init__(*args, **kwargs)
        self.data_collator = PairLabels(self.data_collator)
        self.metric_tallies = {mode: UnitMeans("pairs", {name: name for name in _METRICS}, self.args.device)
                               for mode in MODES}

    def _build_micro_batch_loss(self, loss_kind: Any, fused_loss: bool, normalization: str = "token") -> MicroBatchLoss:
        """Called by AccumTrainer's constructor: the pair loss of TRL's settings, its log-probs fused unless
        ``fused_loss=False`` (:class:`~hf_accum.losses.preference.DPOPairLoss` runs the forward; the cross-entropy's own
        fused path is off: the loss is not a token cross-entropy)."""
        if normalization != "token":
            raise InputError(f"AccumDPOTrainer(normalization={normalization!r}): a DPO loss is normalized per pair")
        self.dpo_loss = DPOPairLoss(self.beta, self.loss_types, self.label_smoothing, loss_weights=self.loss_weights,
                                    fused=fused_loss)
        return MicroBatchLoss("causal_lm", loss_sum_fn=self.dpo_loss, fused=False)

    # -- the reference log-probs (live or precomputed), in the model's dtype -----------------------------
    def compute_ref_log_probs(self, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """The reference's summed completion log-probs ``(chosen[P], rejected[P])`` of one batch (TRL's or
        :class:`PairLabels`' layout), from the logits in the model's dtype. TRL's precompute pass calls it too."""
        labels = inputs.get("labels")
        if labels is None:
            labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX)
        model_inputs = {key: value for key, value in inputs.items() if key not in _NOT_MODEL_INPUTS}
        model_inputs["use_cache"] = False
        fused = self._reference_logps
        with torch.no_grad(), trl_without_gradient_checkpointing(self), trl_reference_context(self), \
                self.accelerator.autocast():
            result = fused_completion_logps(fused, model, model_inputs, labels) if fused is not None else None
            logps = result[1] if result is not None else completion_logps(model(**model_inputs).logits, labels)[0]
        return logps.chunk(2, dim=0)

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's precompute pass (``precompute_ref_log_probs=True``; TRL calls it for the train and eval datasets and
        in ``evaluate``), its result kept in memory on every process: ``dataset`` with the columns
        ``ref_chosen_logps`` / ``ref_rejected_logps`` (float64).

        TRL 1.16 has rank 0 write the values to a ``datasets`` cache file that the other ranks then read. A dataset
        built in memory has no cache directory: each process names a random file in a temporary directory of its
        own, and every rank but 0 fails (``FileNotFoundError``). Here each rank scores its share of the rows, all
        ranks gather every row's values, and each adds them to its own copy of the dataset: no file, on any number
        of processes, for datasets in memory or on disk alike (the price: no reuse across runs)."""
        from datasets import IterableDataset

        if isinstance(dataset, IterableDataset):
            return super()._precompute_ref_logps(dataset, name, batch_size)  # TRL's refusal, in its words
        chosen, rejected = self._gathered_reference_logps(dataset, name, batch_size)
        return dataset.add_column(REFERENCE_KEYS[0], chosen).add_column(REFERENCE_KEYS[1], rejected)

    def _gathered_reference_logps(self, dataset: Any, name: str, batch_size: int) -> tuple[list[float], list[float]]:
        """Every row's reference log-probs ``(chosen, rejected)`` in row order, on every rank. The rows are dealt
        out with even batches: ``gather_for_metrics`` needs batches of one size on every rank
        (``even_batches=False`` would crash it), and drops the rows repeated to even them out."""
        from accelerate.utils import tqdm
        from torch.utils.data import DataLoader

        model = trl_precompute_model(self)
        chosen: list[float] = []
        rejected: list[float] = []
        with evened_batches(self.accelerator):
            loader = self.accelerator.prepare(DataLoader(
                dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False,
                num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory))
            for batch in tqdm(loader, desc=f"Computing reference log probs for {name} dataset",
                              disable=self.args.disable_tqdm):
                batch_chosen, batch_rejected = self.accelerator.gather_for_metrics(
                    self.compute_ref_log_probs(model, batch))
                chosen += batch_chosen.double().tolist()
                rejected += batch_rejected.double().tolist()
        return chosen, rejected

    def _with_reference(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if all(key in inputs for key in REFERENCE_KEYS):
            return inputs  # precomputed (precompute_ref_log_probs=True)
        chosen, rejected = self.compute_ref_log_probs(self.ref_model if self.ref_model is not None else self.model,
                                                      inputs)
        return {**inputs, REFERENCE_KEYS[0]: chosen, REFERENCE_KEYS[1]: rejected}

    # -- the loss and TRL's metrics -------------------------------------------------------------------------
    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """AccumTrainer's loss (the pair terms, scaled once per window); the pair metrics recorded on the side."""
        inputs = self._with_reference(with_labels(dict(inputs)))
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        stats = self.dpo_loss.last_stats
        if stats is not None:
            tokens = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
            self.metric_tallies[current_mode(self)].add(**stats, tokens=tokens)
        return result

