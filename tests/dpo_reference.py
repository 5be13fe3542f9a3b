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
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset

from hf_accum.testing.sft import WORDS

IGNORE = -100


def preference_rows(n: int, seed: int = 0, prompt_words=(1, 10), answer_words=(1, 7)) -> Dataset:
    """``n`` rows of TRL's standard preference format (plain text), prompt and answers of uneven lengths."""
    rng = random.Random(seed)

    def words(bounds):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*bounds)))

    return Dataset.from_list([
        {"prompt": words(prompt_words), "chosen": " " + words(answer_words), "rejected": " " + words(answer_words)}
        for _ in range(n)
    ])


def pair_features(n: int, seed: int = 0, vocab: int = 40, prompt=(1, 8), answer=(1, 6)) -> list[dict]:
    """``n`` pairs as token ids for :func:`hf_accum.preference.collate_pairs` (labels -100 on the prompt)."""
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
        def collate(examples):
            batch = collator(examples)
            self._pending.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})
            return batch

        return collate

    def attach(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        def count(mod, args, kwargs):
            if mod.training and torch.is_grad_enabled():
                self._forwards += 1

        module.register_forward_pre_hook(count, with_kwargs=True)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._capture(named))

    def _capture(self, named) -> None:
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


def pair_loss(loss_type: str, chosen, rejected, ref_chosen, ref_rejected, n_chosen, n_rejected, beta, smoothing):
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
            pair_terms.append(sum(w * pair_loss(t, chosen, rejected, ref_c, ref_r, n_chosen, n_rejected, beta,
                                                label_smoothing) for t, w in loss_types.items()))
            chosen_token_logps.append(chosen)
            chosen_tokens += n_chosen
            pairs += 1
    loss = torch.stack(pair_terms).sum() / pairs
    if sft_weight:
        loss = loss - sft_weight * torch.stack(chosen_token_logps).sum() / chosen_tokens
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {name: (g if g is not None else torch.zeros_like(p)) for (name, p), g in zip(named, grads)}


def relative_error(applied: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    diff = sum(float((applied.get(name, torch.zeros_like(ref)).double() - ref.double()).pow(2).sum())
               for name, ref in reference.items())
    norm = sum(float(ref.double().pow(2).sum()) for ref in reference.values())
    return (diff / norm) ** 0.5


def audit_errors(audit: PairAudit, model: torch.nn.Module, ref_logp: Callable, **loss) -> list[float]:
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
