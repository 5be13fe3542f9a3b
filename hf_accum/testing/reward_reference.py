"""An independent big-batch reference for reward-model updates (TRL's ``RewardTrainer`` loss), and the runs that
audit a trainer against it.

The recorder is :class:`hf_accum.testing.dpo_reference.PairAudit` (every micro-batch the collator builds, the
update's micro-batches of every rank, the applied gradient and the weights it was computed at, just before every
``optimizer.step``). :func:`reference_gradient` recomputes one update from scratch, sharing no code with the
library: each sequence is scored alone (no padding), and the loss is the mean over ALL pairs of the update of TRL
1.16's per-pair formula, written out here again, ``-log sigmoid(c - r - margin) + a * (c + r)^2``; its gradient by
autograd. ``distinct=True`` leaves out a pair an earlier update already trained: the pair Accelerate repeats to
even out the ranks (``even_batches=True``) is not one of the data's pairs.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset
from transformers import LlamaForSequenceClassification, TrainerCallback

from hf_accum.testing.dpo_reference import PairAudit, relative_error
from hf_accum.testing.models import _in_dtype, keep_norm_dtype, tiny_config
from hf_accum.testing.sft import WORDS


def reward_rows(n: int, seed: int = 0, margins: bool = False) -> Dataset:
    """``n`` rows of TRL's preference format with an explicit prompt (plain text), answers of uneven lengths;
    ``margins``: a ``margin`` column (multiples of 1/8, exact in TRL's float32 collator too)."""
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    rows = []
    for _ in range(n):
        row: dict[str, Any] = {"prompt": words(1, 8), "chosen": " " + words(1, 6), "rejected": " " + words(1, 6)}
        if margins:
            row["margin"] = rng.randint(-8, 8) / 8
        rows.append(row)
    return Dataset.from_list(rows)


def reward_model(tokenizer: Any, seed: int = 0) -> LlamaForSequenceClassification:
    """A float64 tiny Llama reward model (``num_labels=1``, dtype-keeping norms) over ``tokenizer``'s vocabulary."""
    torch.manual_seed(seed)
    config = tiny_config(num_labels=1, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return keep_norm_dtype(_in_dtype(LlamaForSequenceClassification(config), torch.float64))


def _pairs(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Each pair of a recorded micro-batch: (chosen ids, rejected ids) unpadded, and its margin (0 without)."""
    mask = batch["attention_mask"].bool()
    rows = [batch["input_ids"][r][mask[r]] for r in range(batch["input_ids"].shape[0])]
    count = len(rows) // 2
    margins = batch.get("margin")
    return [(rows[i], rows[count + i], float(margins[i]) if margins is not None else 0.0) for i in range(count)]


def update_pairs(windows: list[list[dict]], distinct: bool = False) -> list[list[tuple]]:
    """Every update's pairs; ``distinct``: without those an earlier update (or the same one) already had."""
    seen: set[tuple] = set()
    updates = []
    for window in windows:
        pairs = []
        for batch in window:
            for chosen, rejected, margin in _pairs(batch):
                key = (tuple(chosen.tolist()), tuple(rejected.tolist()), margin)
                if distinct and key in seen:
                    continue
                seen.add(key)
                pairs.append((chosen, rejected, margin))
        updates.append(pairs)
    return updates


def sequence_reward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One sequence alone: its float64 reward."""
    return model(input_ids=ids.unsqueeze(0)).logits.reshape(-1)[0].to(torch.float64)


def reference_loss(model: torch.nn.Module, pairs: list[tuple], center: float | None) -> torch.Tensor:
    """TRL 1.16's reward-model loss, the mean over ``pairs`` (module docstring), at ``model``'s weights."""
    terms = []
    for chosen_ids, rejected_ids, margin in pairs:
        chosen, rejected = sequence_reward(model, chosen_ids), sequence_reward(model, rejected_ids)
        term = -F.logsigmoid(chosen - rejected - margin)
        if center is not None:
            term = term + center * (chosen + rejected) ** 2
        terms.append(term)
    return torch.stack(terms).sum() / len(terms)


def reference_gradient(model: torch.nn.Module, pairs: list[tuple], center: float | None) -> tuple[dict, float]:
    """The big batch's gradient of one update at ``model``'s weights, and its loss."""
    loss = reference_loss(model, pairs, center)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    gradient = {name: (g if g is not None else torch.zeros_like(p)) for (name, p), g in zip(named, grads)}
    return gradient, float(loss.detach())


@torch.no_grad()
def reference_metrics(model: torch.nn.Module, pairs: list[tuple]) -> dict[str, float]:
    """TRL's reward metrics over ALL ``pairs`` of one update, at ``model``'s weights (each sequence alone)."""
    chosen = torch.stack([sequence_reward(model, c) for c, _, _ in pairs])
    rejected = torch.stack([sequence_reward(model, r) for _, r, _ in pairs])
    rewards = torch.cat([chosen, rejected])
    return {"accuracy": float((chosen > rejected).double().mean()), "margin": float((chosen - rejected).mean()),
            "mean_reward": float(rewards.mean()), "min_reward": float(rewards.min()),
            "max_reward": float(rewards.max())}


def lora_config() -> Any:
    """A LoRA adapter on the attention's q/v projections, the reward head trained in full (TRL's advice)."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["score"],
                      task_type="SEQ_CLS")


class _AttachAudit(TrainerCallback):
    """Attaches a :class:`PairAudit` to the model and optimizer Trainer built (a PEFT run's)."""

    def __init__(self, audit: PairAudit) -> None:
        self.audit = audit

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.audit.attach(model, getattr(optimizer, "optimizer", optimizer))


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in weights.items():
            params[name].copy_(value)


@dataclass(frozen=True)
class RewardTrainerRun:
    """The options of :func:`run_reward_trainer` (its keyword arguments). ``distinct``: each update's reference
    counts a pair once however many ranks trained it (:func:`update_pairs`); ``lora``: TRL adds a LoRA adapter
    (``peft_config``, the reward head trained in full: ``modules_to_save=["score"]``)."""

    micro_batch: int = 2
    accumulation: int = 3
    center_rewards_coefficient: float | None = None
    even_batches: bool = True
    distinct: bool = False
    logging_steps: int = 1
    lora: bool = False


def run_reward_trainer(trainer_cls: Any, rows: Any, tokenizer: Any, out_dir: str, **options: Any) -> dict:
    """Train ``rows`` once with ``trainer_cls`` (``AccumRewardTrainer`` or TRL's ``RewardTrainer``) under a
    :class:`PairAudit`; return every update's error against the reference (rank 0 audits every rank's windows),
    the reference losses and metrics, the logs, the pairs per update. ``options``: the fields of
    :class:`RewardTrainerRun` (an unknown one is a ``TypeError``)."""
    from trl import RewardConfig

    run = RewardTrainerRun(**options)
    model = reward_model(tokenizer)
    holder = copy.deepcopy(model)
    if run.lora:
        from peft import get_peft_model

        holder = get_peft_model(holder, lora_config())  # the trained weights are copied in from the audit
    args = RewardConfig(
        output_dir=out_dir, per_device_train_batch_size=run.micro_batch, gradient_accumulation_steps=run.accumulation,
        learning_rate=0.05, lr_scheduler_type="constant", max_grad_norm=0.0, bf16=False, report_to="none",
        logging_steps=run.logging_steps, save_strategy="no", num_train_epochs=1, disable_tqdm=True,
        center_rewards_coefficient=run.center_rewards_coefficient, gradient_checkpointing=False,
        accelerator_config={"even_batches": run.even_batches}, ddp_find_unused_parameters=False, use_cpu=True,
    )
    audit = PairAudit()
    if run.lora:  # TRL wraps the model: its optimizer is built at train(), audited from there
        args.optim = "sgd"
        trainer = trainer_cls(model, args=args, train_dataset=rows, processing_class=tokenizer,
                              peft_config=lora_config(), callbacks=[_AttachAudit(audit)])
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        trainer = trainer_cls(model, args=args, train_dataset=rows, processing_class=tokenizer,
                              optimizers=(optimizer, None))
        audit.attach(trainer.model, optimizer)
    trainer.data_collator = audit.wrap(trainer.data_collator)
    trainer.train()
    if dist.is_initialized() and dist.get_rank() != 0:  # every rank's windows are on rank 0: it audits
        return {"errors": [], "logs": [], "metrics": [], "pairs": [], "losses": [], "trainer": trainer}
    errors, losses, metrics = [], [], []
    updates = update_pairs(audit.windows, run.distinct)
    for pairs, gradients, weights in zip(updates, audit.gradients, audit.weights):
        _load(holder, weights)
        reference, loss = reference_gradient(holder, pairs, run.center_rewards_coefficient)
        errors.append(relative_error(gradients, reference))
        losses.append(loss)
        metrics.append(reference_metrics(holder, pairs))
    logs = [log for log in trainer.state.log_history if "loss" in log and "train_loss" not in log]
    trained = [sum(batch["input_ids"].shape[0] // 2 for batch in window) for window in audit.windows]
    return {"errors": errors, "logs": logs, "metrics": metrics, "pairs": trained, "losses": losses,
            "distinct_pairs": [len(pairs) for pairs in updates], "trainer": trainer}


def reward_features(n: int, seed: int = 0, vocab: int = 46, eos: int = 5, margins: bool = False) -> list[dict]:
    """``n`` pre-tokenized pairs (TRL's ``chosen_ids`` / ``rejected_ids``, each ending in ``eos``; ids from 6 up,
    never the pad id 0), of uneven lengths; ``margins``: a ``margin`` per pair."""
    rng = random.Random(seed)
    features = []
    for _ in range(n):
        prompt = [rng.randrange(6, vocab) for _ in range(rng.randint(1, 6))]
        row: dict[str, Any] = {f"{side}_ids": prompt + [rng.randrange(6, vocab) for _ in range(rng.randint(1, 5))]
                               + [eos] for side in ("chosen", "rejected")}
        if margins:
            row["margin"] = rng.uniform(-1.0, 1.0)
        features.append(row)
    return features


def run_reward_loop(features: list[dict], tokenizer: Any, *, center_rewards_coefficient: float | None = None,
                    micro_batch: int = 2, accumulation: int = 3, even_batches: bool = True) -> dict:
    """``hf_accum.train(loss_sum_fn=RewardPairLoss(...))`` on TRL's reward collator (wrapped by
    :class:`hf_accum.trainer.reward.RewardPairLabels`) under a :class:`PairAudit`: every update's error against the
    reference (rank 0 audits every rank's windows), the pairs per update, the result."""
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader
    from trl.trainer.reward_trainer import DataCollatorForPreference

    from hf_accum import LoopConfig, train
    from hf_accum.testing.data import map_style
    from hf_accum.testing.scenarios import fresh_accelerator
    from hf_accum.trainer.reward import RewardPairLabels, RewardPairLoss

    accelerator = fresh_accelerator(accumulation, dataloader_config=DataLoaderConfiguration(even_batches=even_batches))
    model = reward_model(tokenizer)
    holder = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    audit = PairAudit()
    audit.attach(model, optimizer)
    collator = RewardPairLabels(DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id))
    loader = DataLoader(map_style(features), batch_size=micro_batch, shuffle=False, collate_fn=audit.wrap(collator))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(lr_scheduler_type="constant", disable_tqdm=True, max_grad_norm=0.0)
    result = train(model, optimizer, loader, accelerator, config,
                   loss_sum_fn=RewardPairLoss(center_rewards_coefficient))
    if dist.is_initialized() and dist.get_rank() != 0:
        return {"errors": [], "pairs": [], "result": result}
    errors = []
    for pairs, gradients, weights in zip(update_pairs(audit.windows), audit.gradients, audit.weights):
        _load(holder, weights)
        errors.append(relative_error(gradients, reference_gradient(holder, pairs, center_rewards_coefficient)[0]))
    trained = [sum(batch["input_ids"].shape[0] // 2 for batch in window) for window in audit.windows]
    return {"errors": errors, "pairs": trained, "result": result}
