"""Random rows of strongly uneven length: the data that breaks naive accumulation; and the per-target
mean loss over such rows, computed independently (one row at a time) as the reference for eval losses."""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from hf_accum.testing.models import PAD, VOCAB

Row = TypeVar("Row")


def map_style(rows: Sequence[Row]) -> Dataset[Row]:
    """``rows`` as the map-style dataset ``DataLoader`` takes: a sequence already is one (``__getitem__`` and
    ``__len__``, what DataLoader documents), but torch types the argument as ``Dataset``: the cast says so."""
    return cast("Dataset[Row]", rows)


def random_rows(
    n: int,
    seed: int = 0,
    min_len: int = 3,
    max_len: int = 40,
    prompt_masking: bool = False,
    long_rows: Callable[[int], bool] | None = None,
    num_labels: int | None = None,
    vocab_size: int = VOCAB,
    pad_token_id: int = PAD,
    lowest_id: int = 3,
) -> list[dict]:
    """``n`` examples ``{"input_ids", ["prompt_length"], ["label"]}`` of uniformly random length.

    Token ids are drawn from ``[lowest_id, vocab_size)`` minus ``pad_token_id`` (a pad id inside the
    range is skipped). ``prompt_masking`` adds a random ``prompt_length`` (those tokens get no target);
    ``long_rows(i) -> bool`` forces long/short rows (gives DDP ranks very different token counts);
    ``num_labels`` adds a class ``label`` per row (sequence classification).
    """
    skip_pad = lowest_id <= pad_token_id < vocab_size
    high = vocab_size - 1 if skip_pad else vocab_size
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        if long_rows is None:
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        else:
            length = max_len if long_rows(i) else min_len + int(torch.randint(0, 3, (1,), generator=generator))
        ids = torch.randint(lowest_id, high, (length,), generator=generator)
        if skip_pad:
            ids = torch.where(ids >= pad_token_id, ids + 1, ids)
        example: dict[str, Any] = {"input_ids": ids.tolist()}
        if prompt_masking:
            example["prompt_length"] = int(torch.randint(0, length, (1,), generator=generator))
        if num_labels is not None:
            example["label"] = int(torch.randint(0, num_labels, (1,), generator=generator))
        examples.append(example)
    return examples


class ClassificationCollator:
    """Right-padded rows with one label per row (sequence classification). ``label_kind``:
    ``class`` (an int), ``regression`` (a float derived from the row), ``multi_label`` (3 floats)."""

    def __init__(self, label_kind: str = "class", pad_token_id: int = PAD) -> None:
        self.label_kind = label_kind
        self.pad_token_id = pad_token_id

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        length = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(examples):
            ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
            mask[i, : len(e["input_ids"])] = 1
        classes = torch.tensor([e["label"] for e in examples], dtype=torch.long)
        if self.label_kind == "regression":
            labels = classes.to(torch.float64) * 0.7 - 0.4
        elif self.label_kind == "multi_label":
            labels = torch.stack([(classes + shift) % 2 for shift in range(3)], dim=1).to(torch.float64)
        else:
            labels = classes
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def independent_mean_loss(model: nn.Module, examples: Sequence[dict[str, Any]]) -> float:
    """Every target's cross-entropy over ``examples`` (rows of :func:`random_rows`), summed and divided
    once, one example at a time: no batching, padding or sharding to get wrong."""
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            ids = torch.tensor([example["input_ids"]])
            labels = ids.clone()
            labels[0, : example["prompt_length"]] = -100
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
            total += float(F.cross_entropy(logits, labels[0, 1:], ignore_index=-100, reduction="sum"))
            count += int(labels[0, 1:].ne(-100).sum())
    return total / count
