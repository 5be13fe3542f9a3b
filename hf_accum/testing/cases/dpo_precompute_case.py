"""Precomputed DPO reference log-probs on several processes with a dataset built in memory (issue 37 item 4): one
job of a torchrun worker (:func:`dpo_precompute`, ``job(out_dir) -> report``; the Trainer + TRL family's worker
runs it), callable from any worker.

11 pairs in micro-batches of 2 on 2 ranks with ``even_batches=False`` (one rank 6 pairs, the other 5), K = 2,
``sigmoid`` + 0.5 ``sft``, a float64 model, the rows a ``Dataset.from_list`` (no cache directory):

* ``live``: AccumDPOTrainer with its reference model (a copy of the initial weights) scored with every micro-batch;
* ``precomputed``: AccumDPOTrainer with ``precompute_ref_log_probs=True`` (no reference model): its updates against
  the independent big-batch reference (hf_accum/testing/dpo_reference.py), update by update, and its trained
  weights' change against the live run's (``versus_live``: both runs take the same plain SGD steps, so equal
  changes mean equal updates); every rank's train dataset holds the values in memory (no cache file);
* ``stock``: TRL's ``DPOTrainer`` with ``precompute_ref_log_probs=True`` (``even_batches=True``, its requirement)
  constructed on both ranks: each rank's outcome (``"ok"`` or the exception), the negative control. TRL hands the
  values from rank 0 to the others through a cache file that an in-memory dataset keeps in each process's own
  temporary directory. Construction only: a trainer that exists on one rank could not train alone.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

SIGMOID_SFT: dict[str, Any] = dict(loss_type=("sigmoid", "sft"), loss_weights=[1.0, 0.5])


def dpo_precompute(out_dir: str) -> dict[str, Any]:
    """The job (module docstring); rank 0's report is the one kept."""
    from hf_accum import AccumDPOTrainer
    from hf_accum.testing.dpo_reference import dpo_model, preference_rows, relative_error, run_dpo_trainer
    from hf_accum.testing.sft import sft_tokenizer

    tokenizer, rows = sft_tokenizer(), preference_rows(11, seed=5)
    runs = {name: run_dpo_trainer(AccumDPOTrainer, rows, tokenizer, os.path.join(out_dir, name), micro_batch=2,
                                  accumulation=2, even_batches=False, precompute=precompute, **SIGMOID_SFT)
            for name, precompute in (("live", False), ("precomputed", True))}
    live, precomputed = runs["live"], runs["precomputed"]
    report: dict[str, Any] = {"stock": stock_outcomes(rows, tokenizer, os.path.join(out_dir, "stock")),
                              "datasets": _gathered(_dataset_facts(precomputed["trainer"].train_dataset))}
    for name, run in runs.items():
        report[name] = {"errors": run["errors"], "pairs": run["pairs"]}
    initial = dict(dpo_model(tokenizer).named_parameters())  # both runs' starting weights (seed 0)
    report["precomputed"]["versus_live"] = relative_error(_trained_change(precomputed["trainer"], initial),
                                                          _trained_change(live["trainer"], initial))
    return report


def _trained_change(trainer: Any, initial: dict[str, Any]) -> dict[str, Any]:
    """What training changed in each weight (every update's step, the same plain SGD in both runs)."""
    return {name: param.detach() - initial[name].detach() for name, param in trainer.model.named_parameters()}


def stock_outcomes(rows: Any, tokenizer: Any, out_dir: str) -> list[str]:
    """Every rank's outcome of constructing TRL's ``DPOTrainer`` with precomputed reference log-probs on ``rows``."""
    from trl import DPOConfig, DPOTrainer

    from hf_accum.testing.dpo_reference import dpo_model

    args = DPOConfig(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     report_to="none", save_strategy="no", bf16=False, use_cpu=True, disable_tqdm=True,
                     precompute_ref_log_probs=True, loss_type=list(SIGMOID_SFT["loss_type"]),
                     loss_weights=SIGMOID_SFT["loss_weights"], activation_checkpointing=False,
                     accelerator_config={"even_batches": True})
    try:
        model: Any = dpo_model(tokenizer)
        DPOTrainer(model, args=args, train_dataset=rows, processing_class=tokenizer)
        outcome = "ok"
    except Exception as error:  # noqa: BLE001 -- the outcome IS the result: recorded, compared by the test
        outcome = f"{type(error).__name__}: {str(error)[:200]}"
    return _gathered(outcome)


def _dataset_facts(dataset: Any) -> dict[str, Any]:
    """What a rank's train dataset holds: its reference columns (float64 or not) and its cache files."""
    columns = [key for key in ("ref_chosen_logps", "ref_rejected_logps") if key in dataset.column_names]
    return {"reference_columns": columns, "cache_files": len(dataset.cache_files),
            "dtypes": sorted({str(dataset.features[key].dtype) for key in columns}), "rows": len(dataset)}


def _gathered(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (a one-element list on one process)."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
