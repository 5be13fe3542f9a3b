"""Completion log-probs of preference pairs: the reference model's (computed once, cached beside the run) and
the held-out pairwise accuracy.

* :func:`reference_logps` -- every pair's summed completion log-prob under the *reference*: the base model,
  i.e. the model with its LoRA adapter disabled (with full fine-tuning: the model before its first update,
  which is when the recipe asks). One forward pass over the pairs, before training; the result is cached in
  ``<output_dir>/reference_logps.pt``, keyed by a digest of the base weights and of the encoded pairs (so a
  changed model, data, tokenizer, chat template or ``data.max_length`` recomputes it), and reused by a resumed
  or repeated run.
* :func:`pairwise_accuracy` -- the held-out metric of a DPO run: the share of held-out pairs whose chosen answer
  the model ranks above the rejected one, ``log p(chosen | prompt) > log p(rejected | prompt)`` (summed over the
  answer's tokens, end of turn included). It needs no reference, so it means the same before and after training
  (the DPO reward accuracy, margin over the reference > 0, is 0% by definition before the first update).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any, Callable, Iterator, Sequence

import torch

from hf_accum.losses.preference import REFERENCE_KEYS, collate_pairs, completion_logps
from hf_accum.recipe.data.preference import SIDES, labelled
from hf_accum.recipe.progress import phase_bar

CACHE_NAME = "reference_logps.pt"


def pair_features(pair: dict[str, Any]) -> dict[str, Any]:
    """The feature :func:`hf_accum.losses.preference.collate_pairs` reads, from an encoded pair (reference log-probs
    kept)."""
    feature = {key: pair[key] for key in REFERENCE_KEYS if key in pair}
    for side in SIDES:
        feature[f"{side}_input_ids"], feature[f"{side}_labels"] = labelled(pair, side)
    return feature


@contextlib.contextmanager
def reference_mode(model: torch.nn.Module, keep_adapter: bool = False) -> Iterator[torch.nn.Module]:
    """The reference policy: a PEFT model with its adapters (and ``modules_to_save`` copies) disabled; any other
    model as it is (called before its first update, it is its own reference). Eval mode (no dropout).
    ``keep_adapter``: the adapter was loaded from a previous run (``model.adapter``): the reference is the model as
    loaded, adapter on (TRL's choice for a pretrained adapter: its frozen copy)."""
    was_training = model.training
    model.eval()
    disable = None if keep_adapter else getattr(model, "disable_adapter", None)
    try:
        with disable() if callable(disable) else contextlib.nullcontext():
            yield model
    finally:
        model.train(was_training)


@torch.no_grad()
def completion_logps_of(model: torch.nn.Module, pairs: Sequence[dict[str, Any]], pad_token_id: int,
                        batch_size: int = 16,
                        on_rows: Callable[[int], Any] = lambda rows: None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)``: each pair's summed completion log-prob under ``model`` as it is, float64 ``[pairs]``;
    ``on_rows(n)`` as each batch of ``n`` pairs is done (a progress bar's advance)."""
    device = next(model.parameters()).device
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        features = [pair_features(pair) for pair in pairs[start : start + batch_size]]
        batch = collate_pairs(features, pad_token_id)
        logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                       use_cache=False).logits
        logps, _ = completion_logps(logits, batch["labels"])
        logps = logps.double().cpu()
        chosen.append(logps[: len(features)])
        rejected.append(logps[len(features) :])
        on_rows(len(features))
    empty = torch.zeros(0, dtype=torch.float64)
    return (torch.cat(chosen) if chosen else empty), (torch.cat(rejected) if rejected else empty)


def weights_digest(model: torch.nn.Module, with_adapter: bool = False) -> str:
    """A digest of the reference's weights (the base model's parameters and buffers; adapter weights left out unless
    ``with_adapter``, where they are part of the reference):
    names, shapes, dtypes and float64 sums. Cheap next to a forward pass over the data, and any change of the
    model (another checkpoint, dtype, seed of a random init) changes it."""
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not with_adapter and ("lora_" in name or "modules_to_save" in name):
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        with contextlib.suppress(RuntimeError, TypeError):  # packed 4-bit or empty partitioned storage
            digest.update(repr(_float64_sum(tensor)).encode())
    return digest.hexdigest()


def _float64_sum(tensor: torch.Tensor, chunk: int = 1 << 22) -> float:
    """The float64 sum of a tensor, a chunk at a time (no float64 copy of a whole embedding matrix)."""
    flat = tensor.detach().reshape(-1)
    return float(sum(part.double().sum() for part in flat.split(chunk))) if flat.numel() else 0.0


def pairs_digest(splits: dict[str, Sequence[dict[str, Any]]]) -> str:
    """A digest of the encoded pairs (token ids: the data, tokenizer, chat template and max_length)."""
    text = json.dumps({name: [[pair["prompt_ids"], *(pair[f"{s}_ids"] for s in SIDES)] for pair in pairs]
                       for name, pairs in splits.items()}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def reference_logps(model: torch.nn.Module, splits: dict[str, Sequence[dict[str, Any]]], pad_token_id: int,
                    cache_dir: str | None, batch_size: int = 16, is_main: bool = True,
                    report: Callable[[str], Any] = print,
                    keep_adapter: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Each split's pairs with ``ref_chosen_logps`` / ``ref_rejected_logps`` added: from the cache in
    ``cache_dir`` when its key matches, else computed once with :func:`reference_mode` (and cached by the main
    process). Every process computes the same values (one forward pass each), so no collective is needed.
    ``keep_adapter``: the reference is the model as loaded, its adapter on (:func:`reference_mode`)."""
    which = "the starting model (the loaded adapter on)" if keep_adapter else "the base model (adapter disabled)"
    with reference_mode(model, keep_adapter):
        key = {"weights": weights_digest(model, keep_adapter), "pairs": pairs_digest(splits)}
        path = os.path.join(cache_dir, CACHE_NAME) if cache_dir else None
        cached = _read_cache(path, key, report)
        if cached is None:
            total = sum(len(pairs) for pairs in splits.values())
            label = "starting model" if keep_adapter else "base model"
            with phase_bar(total, f"reference log-probs ({label})", unit="pair") as advance:
                cached = {name: completion_logps_of(model, pairs, pad_token_id, batch_size, advance)
                          for name, pairs in splits.items()}
            report(f"reference log-probs: {total} pairs scored by {which}"
                   + (f", cached in {path}" if path else ""))
            if path and is_main:
                _write_cache(path, key, cached)
    return {
        name: [{**pair, REFERENCE_KEYS[0]: float(chosen), REFERENCE_KEYS[1]: float(rejected)}
               for pair, chosen, rejected in zip(pairs, *cached[name])]
        for name, pairs in splits.items()
    }


def _read_cache(path: str | None, key: dict[str, str],
                report: Callable[[str], Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    if not path or not os.path.isfile(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a damaged cache is recomputed, never trusted
        report(f"reference log-probs: {path} is unreadable ({type(error).__name__}): recomputing")
        return None
    if saved.get("key") != key:
        changed = " and ".join(name for name in key if saved.get("key", {}).get(name) != key[name])
        report(f"reference log-probs: {path} was computed for other {changed or 'inputs'}: recomputing")
        return None
    report(f"reference log-probs: reused from {path}")
    return {name: (values["chosen"], values["rejected"]) for name, values in saved["splits"].items()}


def _write_cache(path: str, key: dict[str, str], values: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.tmp"
    torch.save({"key": key, "splits": {name: {"chosen": c, "rejected": r} for name, (c, r) in values.items()}},
               temporary)
    os.replace(temporary, path)  # whole or absent


@torch.no_grad()
def pairwise_accuracy(model: torch.nn.Module, split: Any, pad_token_id: int, batch_size: int = 16,
                      on_rows: Callable[[int], Any] = lambda rows: None) -> dict[str, Any]:
    """Share of ``split``'s pairs (a :class:`~hf_accum.recipe.data.preference.PreferenceSplit`) whose chosen
    answer has the higher summed log-prob under ``model``; overall and per ``task``, with the mean margin.
    ``on_rows(n)``: as each batch of ``n`` pairs is scored."""
    was_training = model.training
    model.eval()
    try:
        chosen, rejected = completion_logps_of(model, split.examples, pad_token_id, batch_size, on_rows)
    finally:
        model.train(was_training)
    wins = (chosen > rejected).tolist()
    per_task: dict[str, list[bool]] = {}
    for source, win in zip(split.sources, wins):
        per_task.setdefault(source.task, []).append(win)
    return {
        "pairwise_accuracy": sum(wins) / max(1, len(wins)),
        "per_task": {task: sum(v) / len(v) for task, v in sorted(per_task.items())},
        "mean_margin": float((chosen - rejected).mean()) if wins else 0.0,
        "examples": len(wins),
    }
