"""``objective: dpo`` in the recipe: the ``dpo`` section's check, the objective table entry, and DPO training in
both engines.

The recipe (``recipes/finetune_llama.py``) reads what differs between objectives from one :class:`Objective`:
its data (:func:`hf_accum.recipe.data.preference.load_preference_data`: pairs, not conversations), collator
(:func:`hf_accum.losses.preference.collate_pairs`), held-out metric
(:func:`hf_accum.recipe.reference.pairwise_accuracy`) and engines:

* ``loop``: the recipe's own loop engine with ``loss_sum_fn=DPOPairLoss(...)`` (one ``(sum, count)`` per term:
  pairs, and chosen tokens for ``dpo.sft_weight``); the reference log-probs are computed once before training,
  with the LoRA adapter disabled, and cached beside the run (:func:`hf_accum.recipe.reference.reference_logps`);
* ``trainer``: :class:`hf_accum.AccumDPOTrainer` with TRL's ``DPOConfig`` built from the training section and
  the ``dpo`` section (the reference: the adapter disabled, or the loaded adapter with ``model.adapter``; its
  log-probs precomputed once before training, on any number of processes: :func:`dpo_config`).

Refused with ``objective: dpo`` (exit 2, before any model loads): what has not been built or tested for pairs
(packing, sequence normalization, token-budget windows, batch ramp-up, noise scale, DeepSpeed, FSDP).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable

from hf_accum.recipe.config.schema import RecipeConfig
from hf_accum.recipe.config.sections import DPOSection
from hf_accum.recipe.data.preference import load_preference_data
from hf_accum.recipe.preference_section import PreferenceConfigError, check_dpo_section  # noqa: F401 -- one import path

METRIC = "pairwise accuracy"


@dataclass(frozen=True)
class Objective:
    """What the recipe's steps do for one objective (``config.objective`` picks it)."""

    metric: str
    """The held-out metric's name in the printed lines (``held-out <metric>: before X -> after Y``)."""
    load_data: Callable
    """``(model section, data section) -> (tokenizer, data)``, before any model loads."""
    collator: Callable
    """``(config, tokenizer) -> collate_fn`` of the training micro-batches."""
    evaluate: Callable
    """``(model, tokenizer, data, config, args, when) -> result | None`` (None: not scored on this process;
    ``when``: ``"before training"`` / ``"after training"``, for its progress bar)."""
    score: Callable
    """``result -> "53.0%"`` (``"n/a"`` for None)."""
    engines: dict
    """Engine name -> ``(train function, the TrainingArguments fields it honours; None: all)``."""


# ----------------------------------------------------------------------------------------------
# The dpo section as TRL's and the loss's settings
# ----------------------------------------------------------------------------------------------


def loss_settings(dpo: DPOSection) -> dict[str, Any]:
    """``DPOPairLoss`` keyword arguments of the ``dpo`` section."""
    return {"beta": dpo.beta, "loss_type": dpo.loss_type, "label_smoothing": dpo.label_smoothing,
            "sft_weight": dpo.sft_weight}


def trl_settings(dpo: DPOSection) -> dict[str, Any]:
    """TRL ``DPOConfig`` fields of the ``dpo`` section (the SFT term as TRL's ``"sft"`` loss type with its weight)."""
    types, weights = [dpo.loss_type], [1.0]
    if dpo.sft_weight:
        types, weights = [*types, "sft"], [*weights, dpo.sft_weight]
    return {"beta": dpo.beta, "loss_type": types, "loss_weights": weights, "label_smoothing": dpo.label_smoothing}


def training_values(args: Any) -> dict[str, Any]:
    """Every ``TrainingArguments`` value the recipe resolved, to build a TRL config from (so that the TRL config's
    own defaults, e.g. learning_rate 1e-6, never apply)."""
    from transformers import TrainingArguments

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}


def drop_reference_adapter(trainer: Any) -> None:
    """Delete the ``"ref"`` adapter TRL copies from an already-wrapped PEFT model, once the trainer no longer needs
    it: PEFT cannot save a model whose second adapter lacks the modules_to_save copies (KeyError
    'modules_to_save.ref.weight')."""
    if "ref" in getattr(trainer.model, "peft_config", {}):
        trainer.model.delete_adapter("ref")


def dpo_config(config: RecipeConfig, args: Any) -> Any:
    """TRL's ``DPOConfig``: every ``TrainingArguments`` value the recipe resolved (``args``: DPOConfig's own
    defaults, e.g. bf16 and learning_rate 1e-6, never apply), the ``dpo`` section and ``data.max_length``.

    The reference log-probs (the adapter disabled; with ``model.adapter``, TRL's frozen copy of the loaded adapter)
    are precomputed once, in the trainer's constructor, on every process: AccumDPOTrainer keeps them in memory on
    each rank (TRL 1.16's own precompute hands them between ranks through a dataset cache file that the recipe's
    in-memory dataset lacks: FileNotFoundError on rank 1), so no reference forward runs with the micro-batches."""
    from trl import DPOConfig

    return DPOConfig(**training_values(args), **trl_settings(config.dpo), max_length=config.data.max_length,
                     precompute_ref_log_probs=True,
                     precompute_ref_batch_size=args.per_device_eval_batch_size)


# ----------------------------------------------------------------------------------------------
# The engines
# ----------------------------------------------------------------------------------------------


def train_dpo_with_trainer(model: Any, tokenizer: Any, data: Any, collator: Any, args: Any, record: Any, resume: Any,
                           launch: Any) -> tuple[Any, Any]:
    """:class:`hf_accum.AccumDPOTrainer` on the kept pairs in TRL's conversational form (TRL tokenizes them with
    the chat template exactly as :mod:`hf_accum.recipe.data.preference` does: the tests compare the two)."""
    from datasets import Dataset

    from hf_accum import AccumDPOTrainer
    from hf_accum.recipe.launch import check_engine
    from hf_accum.recipe.outputs import barrier

    trainer = AccumDPOTrainer(
        model=model, args=dpo_config(record.config, args), processing_class=tokenizer,
        train_dataset=Dataset.from_list(data.train.as_conversations()),
        eval_dataset=Dataset.from_list(data.held_out.as_conversations()) if data.held_out else None,
        accumulation=record.config.accumulation,  # the recipe's section is the trainer's settings (hf_accum.settings)
    )
    # The constructor has scored the reference with TRL's "ref" adapter (precompute_ref_log_probs): a fresh adapter's
    # copy is the base model, as in the loop engine; a loaded one's (model.adapter) the starting policy.
    drop_reference_adapter(trainer)
    check_engine(trainer.accelerator, launch)
    trainer.train(resume_from_checkpoint=resume)
    record.updates = [asdict(update) for update in trainer.updates]
    record.utilization = trainer.utilization
    barrier()
    return trainer.model, trainer.batch_plan


def train_dpo_with_loop(train_with_loop: Callable[..., Any], model: Any, tokenizer: Any, data: Any, collator: Any,
                        args: Any, record: Any, resume: Any, launch: Any) -> Any:
    """The recipe's loop engine (``train_with_loop``) on pairs carrying their reference log-probs, with
    ``DPOPairLoss`` as its ``loss_sum_fn``."""
    from hf_accum.losses.preference import DPOPairLoss
    from hf_accum.recipe.outputs import is_main_process, say
    from hf_accum.recipe.reference import pair_features, reference_logps

    splits = {"train": data.train.examples, **({"held_out": data.held_out.examples} if data.held_out else {})}
    # model.adapter (a previous run's adapter): the reference is that starting policy, not the base model
    scored = reference_logps(model, splits, tokenizer.pad_token_id, args.output_dir,
                             batch_size=args.per_device_eval_batch_size, is_main=is_main_process(), report=say,
                             keep_adapter=record.config.model.adapter is not None)
    features = {name: [pair_features(pair) for pair in pairs] for name, pairs in scored.items()}
    data = dataclasses.replace(
        data, train=dataclasses.replace(data.train, examples=features["train"]),
        held_out=dataclasses.replace(data.held_out, examples=features["held_out"]) if data.held_out else None,
    )
    loss = DPOPairLoss(**loss_settings(record.config.dpo))
    return train_with_loop(model, tokenizer, data, collator, args, record, resume, launch, loss_sum_fn=loss)


# ----------------------------------------------------------------------------------------------
# The objective
# ----------------------------------------------------------------------------------------------


def pair_collator(config: RecipeConfig, tokenizer: Any) -> Callable[..., Any]:
    from hf_accum.losses.preference import collate_pairs

    return partial(collate_pairs, pad_token_id=tokenizer.pad_token_id)


def evaluate_pairs(model: Any, tokenizer: Any, data: Any, config: RecipeConfig, args: Any,
                   when: str = "") -> dict[str, Any] | None:
    """The held-out pairwise accuracy, on the main process (None elsewhere, and without held-out pairs), with a
    progress bar (``when``: ``"before training"`` / ``"after training"``)."""
    from hf_accum.recipe.progress import phase_bar
    from hf_accum.recipe.reference import pairwise_accuracy

    if not data.held_out or not data.held_out.examples or args.process_index != 0:
        return None
    with phase_bar(len(data.held_out.examples), f"held-out {METRIC} {when}".strip(), unit="pair") as advance:
        return pairwise_accuracy(model, data.held_out, tokenizer.pad_token_id, args.per_device_eval_batch_size,
                                 on_rows=advance)


def accuracy_percent(result: dict[str, Any] | None) -> str:
    return "n/a" if result is None else f"{100 * result['pairwise_accuracy']:.1f}%"


def dpo_objective(train_with_loop: Callable, loop_reads: set[str]) -> Objective:
    """The DPO entry of the recipe's objective table; ``train_with_loop``: the recipe's loop engine, which takes a
    ``loss_sum_fn``; ``loop_reads``: the TrainingArguments fields it honours."""
    engines = {"loop": (partial(train_dpo_with_loop, train_with_loop), loop_reads),
               "trainer": (train_dpo_with_trainer, None)}
    return Objective(METRIC, load_preference_data, pair_collator, evaluate_pairs, accuracy_percent, engines)
