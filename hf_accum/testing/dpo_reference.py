"""An independent big-batch reference for DPO updates, and the recorder that audits a run against it.

:class:`PairAudit` watches a training run: it records every micro-batch the collator builds, counts the policy's
training forwards (grad enabled: reference forwards run without grad) to know which micro-batches an update
used, and just before every ``optimizer.step`` captures the applied gradient and the weights it was computed at,
with the update's micro-batches of every rank (gathered across ranks).

:func:`reference_gradient` recomputes one update from scratch, sharing no code with the library: each sequence
is forwarded alone (no padding), ``log_softmax`` in float64, summed over its completion tokens; the reference
log-probs come from the reference model the same way; the loss is the mean over ALL pairs of the update of
TRL 1.16's per-pair formula (written out here again) plus ``sft_weight`` times the mean over all chosen
completion tokens of ``-log p``; its gradient by autograd.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset

from hf_accum.testing.sft import WORDS

IGNORE = -100


def preference_rows(n: int, seed: int = 0, prompt_words: tuple[int, int] = (1, 10),
                    answer_words: tuple[int, int] = (1, 7)) -> Dataset:
    """``n`` rows of TRL's standard preference format (plain text), prompt and answers of uneven lengths."""
    rng = random.Random(seed)

    def words(bounds: tuple[int, int]) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*bounds)))

    return Dataset.from_list([
        {"prompt": words(prompt_words), "chosen": " " + words(answer_words), "rejected": " " + words(answer_words)}
        for _ in range(n)
    ])


def pair_features(n: int, seed: int = 0, vocab: int = 40, prompt: tuple[int, int] = (1, 8),
                  answer: tuple[int, int] = (1, 6)) -> list[dict]:
    """``n`` pairs as token ids for :func:`hf_accum.losses.preference.collate_pairs` (labels -100 on the prompt)."""
    rng = random.Random(seed)
    features = []
    for _ in range(n):
        prompt_ids = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))]
        row = {}
        for side in ("chosen", "rejected"):
            answer_ids = [rng.randrange(3, vocab) for _ in range(rng.randint(*answer))]
            row[f"{side}_input_ids"] = prompt_ids + answer_ids
            row[f"{side}_labels"] = [IGNORE] * len(prompt_ids) + answer_ids
        features.append(row)
    return features


class PairAudit:
    """Record a run's windows and applied gradients (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: deque = deque()
        self._forwards = 0
        self.windows: list[list[dict]] = []
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    def wrap(self, collator: Callable) -> Callable:
        def collate(examples: Any) -> Any:
            batch = collator(examples)
            self._pending.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})
            return batch

        return collate

    def attach(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        def count(mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if mod.training and torch.is_grad_enabled():
                self._forwards += 1

        module.register_forward_pre_hook(count, with_kwargs=True)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._capture(named))

    def _capture(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        window = [self._pending.popleft() for _ in range(self._forwards)]
        self._forwards = 0
        gathered: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(gathered, window)
        else:
            gathered = [window]
        self.windows.append([batch for rank_window in gathered for batch in rank_window])
        self.gradients.append({name: p.grad.detach().clone() for name, p in named if p.grad is not None})
        self.weights.append({name: p.detach().clone() for name, p in named})


def _rows(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row of a recorded micro-batch as (unpadded ids, completion mask), chosen rows first."""
    if "labels" in batch:
        completion = batch["labels"].ne(IGNORE)
    else:
        completion = batch["completion_mask"].bool()
    mask = batch["attention_mask"].bool()
    return [(batch["input_ids"][r][mask[r]], completion[r][mask[r]]) for r in range(batch["input_ids"].shape[0])]


def sequence_logp(model: torch.nn.Module, ids: torch.Tensor, completion: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One sequence alone: the summed float64 log-prob of its completion tokens, and their number."""
    logits = model(input_ids=ids.unsqueeze(0)).logits[0].to(torch.float64)
    log_probs = torch.log_softmax(logits[:-1], dim=-1)
    targets = ids[1:]
    is_target = completion[1:]
    token = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return token[is_target].sum(), int(is_target.sum())


def pair_loss(loss_type: str, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
              ref_rejected: torch.Tensor, n_chosen: Any, n_rejected: Any, beta: float,
              smoothing: float) -> torch.Tensor:
    """TRL 1.16 ``DPOTrainer._compute_loss``'s per-pair formulas (reverse KL), written out independently."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    margin = beta * (chosen_ratio - rejected_ratio)
    if loss_type == "sigmoid":
        return -F.logsigmoid(margin)
    if loss_type == "hinge":
        return torch.relu(1 - margin)
    if loss_type == "ipo":
        ipo = chosen_ratio / max(n_chosen, 1) - rejected_ratio / max(n_rejected, 1)
        return (ipo - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        return (-(1 - smoothing) * F.logsigmoid(margin) + smoothing * F.logsigmoid(-margin)) / (1 - 2 * smoothing)
    raise ValueError(loss_type)


def reference_gradient(model: torch.nn.Module, window: list[dict], ref_logp: Callable, *, beta: float,
                       loss_types: dict[str, float], sft_weight: float = 0.0,
                       label_smoothing: float = 0.0) -> dict[str, torch.Tensor]:
    """The big batch's gradient of one update (module docstring) at ``model``'s weights.

    ``ref_logp(ids, completion)``: the reference model's summed completion log-prob of one sequence."""
    pair_terms, chosen_token_logps, chosen_tokens, pairs = [], [], 0, 0
    for batch in window:
        rows = _rows(batch)
        count = len(rows) // 2
        for i in range(count):
            (c_ids, c_mask), (r_ids, r_mask) = rows[i], rows[count + i]
            chosen, n_chosen = sequence_logp(model, c_ids, c_mask)
            rejected, n_rejected = sequence_logp(model, r_ids, r_mask)
            with torch.no_grad():
                ref_c, ref_r = ref_logp(c_ids, c_mask), ref_logp(r_ids, r_mask)
            term = sum(w * pair_loss(t, chosen, rejected, ref_c, ref_r, n_chosen, n_rejected, beta, label_smoothing)
                       for t, w in loss_types.items())
            assert isinstance(term, torch.Tensor)  # loss_types is never empty
            pair_terms.append(term)
            chosen_token_logps.append(chosen)
            chosen_tokens += n_chosen
            pairs += 1
    loss = torch.stack(pair_terms).sum() / pairs
    if sft_weight:
        loss = loss - sft_weight * torch.stack(chosen_token_logps).sum() / chosen_tokens
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    LOSSES.append(float(loss))
    return {name: (g if g is not None else torch.zeros_like(p)) for (name, p), g in zip(named, grads)}


LOSSES: list[float] = []
"""Every loss :func:`reference_gradient` computed, in order (the logged loss is checked against them)."""


def relative_error(applied: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    diff = sum(float((applied.get(name, torch.zeros_like(ref)).double() - ref.double()).pow(2).sum())
               for name, ref in reference.items())
    norm = sum(float(ref.double().pow(2).sum()) for ref in reference.values())
    return (diff / norm) ** 0.5


def audit_errors(audit: PairAudit, model: torch.nn.Module, ref_logp: Callable, **loss: Any) -> list[float]:
    """Every recorded update's relative error against :func:`reference_gradient` (``model`` is a float64 copy
    of the trained architecture; its weights are overwritten by each update's)."""
    errors = []
    for window, gradients, weights in zip(audit.windows, audit.gradients, audit.weights):
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, value in weights.items():
                params[name].copy_(value)
        errors.append(relative_error(gradients, reference_gradient(model, window, ref_logp, **loss)))
    return errors


@torch.no_grad()
def reference_metrics(model: torch.nn.Module, window: list[dict], ref_logp: Callable, beta: float) -> dict:
    """TRL's pair metrics over ALL pairs of one update, at ``model``'s weights (each sequence alone)."""
    sums: dict[str, float] = {}
    pairs = 0
    for batch in window:
        rows = _rows(batch)
        count = len(rows) // 2
        for i in range(count):
            (c_ids, c_mask), (r_ids, r_mask) = rows[i], rows[count + i]
            chosen, rejected = sequence_logp(model, c_ids, c_mask)[0], sequence_logp(model, r_ids, r_mask)[0]
            chosen_reward = beta * (chosen - ref_logp(c_ids, c_mask))
            rejected_reward = beta * (rejected - ref_logp(r_ids, r_mask))
            values = {"rewards/chosen": chosen_reward, "rewards/rejected": rejected_reward,
                      "rewards/accuracies": float(chosen_reward > rejected_reward),
                      "rewards/margins": chosen_reward - rejected_reward,
                      "logps/chosen": chosen, "logps/rejected": rejected}
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            pairs += 1
    return {key: value / pairs for key, value in sums.items()}


# -- runs ---------------------------------------------------------------------------------------------------

def lora_config(existing: bool) -> Any:
    from peft import LoraConfig

    # An existing adapter starts away from the identity, so its reference (TRL: a frozen copy named "ref") differs
    # from the base model; a new one (TRL: the reference is the adapter disabled) starts at the identity.
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=not existing)


def dpo_model(tokenizer: Any, peft: str | bool = False) -> torch.nn.Module:
    """The float64 tiny Llama (dtype-keeping norms) over ``tokenizer``'s vocabulary; ``peft="existing"``: with a
    LoRA adapter already on it; ``peft="new"`` builds the bare model (TRL adds the adapter from ``peft_config``)."""
    from hf_accum.testing.sft import sft_model_factory

    model = sft_model_factory(tokenizer)()
    if peft == "existing":
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(existing=True)).to(torch.float64)
    return model


def reference_logp_fn(initial: torch.nn.Module, peft: str | bool = False) -> Callable:
    """The reference model of a run, applied to one sequence: the initial weights -- for a new adapter the base
    model (adapter disabled); for an existing one, the adapter as it was (TRL's "ref" copy)."""

    def ref_logp(ids: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
        return sequence_logp(initial, ids, completion)[0]

    return ref_logp


@dataclass(frozen=True)
class DPOTrainerRun:
    """The options of :func:`run_dpo_trainer` (its keyword arguments): the batching, the DPO loss, how the reference
    is formed (``precompute``: TRL's precomputed log-probs; ``peft``: ``"new"`` / ``"existing"`` adapter, see
    :func:`dpo_model`) and ``trainer_kwargs``, more constructor arguments (e.g. AccumDPOTrainer's
    ``fused_loss=False``)."""

    micro_batch: int = 2
    accumulation: int = 3
    loss_type: tuple[str, ...] | list[str] = ("sigmoid",)
    loss_weights: list[float] | None = None
    beta: float = 0.5
    label_smoothing: float = 0.0
    precompute: bool = False
    peft: str | bool = False
    even_batches: bool = True
    logging_steps: int = 1
    trainer_kwargs: dict | None = None


def run_dpo_trainer(trainer_cls: Any, rows: Any, tokenizer: Any, out_dir: str, **options: Any) -> dict:
    """Train ``rows`` once with ``trainer_cls`` (``AccumDPOTrainer`` or TRL's ``DPOTrainer``) under a
    :class:`PairAudit`; return the errors of every update against the reference, the logs, the trainer.
    ``options``: the fields of :class:`DPOTrainerRun` (an unknown one is a ``TypeError``)."""
    import copy

    run = DPOTrainerRun(**options)
    model = dpo_model(tokenizer, run.peft)
    initial = copy.deepcopy(model)
    audit = PairAudit()
    trainer, holder = _audited_dpo_trainer(trainer_cls, (model, initial), rows, tokenizer,
                                           _dpo_config(out_dir, run), run, audit)
    trainer.data_collator = audit.wrap(trainer.data_collator)
    trainer.train()
    if dist.is_initialized() and dist.get_rank() != 0:  # every rank's windows are on rank 0: it audits
        return {"errors": [], "logs": [], "metrics": [], "pairs": [], "trainer": trainer}
    weighted = list(zip(run.loss_type, run.loss_weights or [1.0] * len(run.loss_type)))
    types = {t: w for t, w in weighted if t != "sft"}
    sft_weight = sum(w for t, w in weighted if t == "sft")
    ref_logp = reference_logp_fn(initial, run.peft)
    LOSSES.clear()
    errors = audit_errors(audit, holder, ref_logp, beta=run.beta, loss_types=types, sft_weight=sft_weight,
                          label_smoothing=run.label_smoothing)
    metrics = []
    for window, state in zip(audit.windows, audit.weights):
        with torch.no_grad():
            params = dict(holder.named_parameters())
            for name, value in state.items():
                params[name].copy_(value)
        metrics.append(reference_metrics(holder, window, ref_logp, run.beta))
    logs = [log for log in trainer.state.log_history if "loss" in log and "train_loss" not in log]
    pairs = [sum(batch["input_ids"].shape[0] // 2 for batch in window) for window in audit.windows]
    return {"errors": errors, "logs": logs, "metrics": metrics, "pairs": pairs, "trainer": trainer,
            "losses": list(LOSSES)}


def _dpo_config(out_dir: str, run: DPOTrainerRun) -> Any:
    """TRL's ``DPOConfig`` of one audited run: plain SGD-sized steps on CPU, every update logged, nothing saved."""
    from trl import DPOConfig

    return DPOConfig(
        output_dir=out_dir, per_device_train_batch_size=run.micro_batch, gradient_accumulation_steps=run.accumulation,
        learning_rate=0.05, lr_scheduler_type="constant", max_grad_norm=0.0, bf16=False, report_to="none",
        logging_steps=run.logging_steps, save_strategy="no", num_train_epochs=1, beta=run.beta,
        loss_type=list(run.loss_type), loss_weights=run.loss_weights, label_smoothing=run.label_smoothing,
        precompute_ref_log_probs=run.precompute, activation_checkpointing=False, gradient_checkpointing=False,
        disable_tqdm=True, accelerator_config={"even_batches": run.even_batches}, ddp_find_unused_parameters=False,
        use_cpu=True,
    )


def _audited_dpo_trainer(trainer_cls: Any, models: tuple[torch.nn.Module, torch.nn.Module], rows: Any,
                         tokenizer: Any, args: Any, run: DPOTrainerRun, audit: PairAudit) -> tuple[Any, Any]:
    """``(trainer, holder)``: the trainer with ``audit`` attached to its optimizer, and a model shaped like the
    trained one (the initial weights; the audit copies each update's weights in) for the reference."""
    import copy

    model, initial = models
    extra = dict(run.trainer_kwargs or {})
    if run.peft == "new":  # TRL wraps the model: its optimizer is built at train(), audited from there
        from peft import get_peft_model
        from transformers import TrainerCallback

        class Attach(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                               **kwargs: Any) -> None:
                audit.attach(trainer.model, getattr(optimizer, "optimizer", optimizer))

        args.optim = "sgd"
        trainer = trainer_cls(model, args=args, train_dataset=rows, processing_class=tokenizer,
                              peft_config=lora_config(existing=False), callbacks=[Attach()], **extra)
        # Not a copy of trainer.model: TRL's patched forward would still run the original module.
        return trainer, get_peft_model(copy.deepcopy(initial), lora_config(existing=False))  # adapter: audited
    ref_model = None if run.precompute or run.peft else copy.deepcopy(initial)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    trainer = trainer_cls(model, ref_model=ref_model, args=args, train_dataset=rows, processing_class=tokenizer,
                          optimizers=(optimizer, None), **extra)
    audit.attach(trainer.model, optimizer)
    return trainer, copy.deepcopy(initial)


def run_dpo_loop(features: list[dict], loss: Any, *, micro_batch: int = 2, accumulation: int = 3,
                 even_batches: bool = True, pad_token_id: int = 0, vocab: int = 40) -> dict:
    """``hf_accum.train`` with ``loss_sum_fn=loss`` (a :class:`hf_accum.losses.preference.DPOPairLoss`) on
    :func:`hf_accum.losses.preference.collate_pairs` micro-batches, under a :class:`PairAudit`. The features carry
    their reference log-probs; the reference model is the initial one."""
    import copy

    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from hf_accum import LoopConfig, train
    from hf_accum.losses.preference import collate_pairs
    from hf_accum.testing.data import map_style
    from hf_accum.testing.models import tiny_causal_lm
    from hf_accum.testing.scenarios import fresh_accelerator

    accelerator = fresh_accelerator(accumulation, dataloader_config=DataLoaderConfiguration(even_batches=even_batches))
    model = tiny_causal_lm(vocab_size=vocab, pad_token_id=pad_token_id)
    initial = copy.deepcopy(model)
    features = with_reference_logps(features, initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    audit = PairAudit()
    audit.attach(model, optimizer)
    loader = DataLoader(map_style(features), batch_size=micro_batch, shuffle=False,
                        collate_fn=audit.wrap(lambda rows: collate_pairs(rows, pad_token_id)))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(lr_scheduler_type="constant", disable_tqdm=True, max_grad_norm=0.0)
    result = train(model, optimizer, loader, accelerator, config, loss_sum_fn=loss)
    if dist.is_initialized() and dist.get_rank() != 0:  # every rank's windows are on rank 0: it audits
        return {"errors": [], "result": result, "pairs": []}
    types = dict(loss.pair_weights)
    LOSSES.clear()
    errors = audit_errors(audit, copy.deepcopy(initial), reference_logp_fn(initial, False), beta=loss.beta,
                          loss_types=types, sft_weight=loss.sft_weight, label_smoothing=loss.label_smoothing)
    pairs = [sum(batch["input_ids"].shape[0] // 2 for batch in window) for window in audit.windows]
    return {"errors": errors, "result": result, "pairs": pairs, "losses": list(LOSSES)}


@torch.no_grad()
def with_reference_logps(features: list[dict], reference: torch.nn.Module) -> list[dict]:
    """The features with ``ref_chosen_logps`` / ``ref_rejected_logps`` from ``reference`` (each sequence alone)."""
    out = []
    for feature in features:
        row = dict(feature)
        for side in ("chosen", "rejected"):
            ids = torch.tensor(feature[f"{side}_input_ids"])
            completion = torch.tensor(feature[f"{side}_labels"]).ne(IGNORE)
            row[f"ref_{side}_logps"] = float(sequence_logp(reference, ids, completion)[0])
        out.append(row)
    return out
