"""Collators for causal-LM fine-tuning: right padding, and padding-free packing.

Examples carry ``input_ids`` and ``labels`` with -100 wherever nothing is to be predicted (the
Hugging Face convention, what :func:`hf_accum.recipe.data.encode_examples` produces): the masking travels
with the example, so it survives ``Trainer(remove_unused_columns=True)`` and any collator. The
older ``prompt_length`` key (mask the first ``prompt_length`` labels) is still honoured.

Both collators emit ``labels`` padded with -100, so that :func:`hf_accum.losses.token_loss.count_targets`
counts exactly the tokens the loss sums over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import DataCollatorWithFlattening

from hf_accum.losses.token_loss import IGNORE_INDEX


@dataclass
class PaddingCollator:
    """Pad ``input_ids``/``labels`` (and ``attention_mask``) of a list of examples to the longest.

    Examples need ``input_ids`` and may carry ``labels`` of the same length (-100: no target;
    copied from ``input_ids`` when absent) and/or ``prompt_length`` (labels before it become -100).
    ``pad_to_multiple_of`` rounds the length up (tensor-core friendly on GPUs).
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    padding_side: str = "right"

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.padding_side not in ("right", "left"):
            raise ValueError(f"padding_side={self.padding_side!r}; allowed: 'right', 'left'")
        rows = [self._row(example) for example in examples]
        length = max(len(ids) for ids, _ in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, (ids, row_labels) in enumerate(rows):
            span = slice(0, len(ids)) if self.padding_side == "right" else slice(length - len(ids), length)
            input_ids[i, span] = torch.as_tensor(ids)
            labels[i, span] = torch.as_tensor(row_labels)
            attention_mask[i, span] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    @staticmethod
    def _row(example: dict[str, Any]) -> tuple[list[int], list[int]]:
        ids = list(example["input_ids"])
        labels = list(example["labels"]) if example.get("labels") is not None else list(ids)
        if len(labels) != len(ids):
            raise ValueError(f"an example has {len(ids)} input_ids but {len(labels)} labels; they must align")
        prompt_length = int(example.get("prompt_length") or 0)
        labels[:prompt_length] = [IGNORE_INDEX] * min(prompt_length, len(labels))
        return ids, labels


class PackingCollator:
    """Padding-free packing: one row per micro-batch, ``position_ids`` restarting per sequence.

    A thin layer over ``transformers.DataCollatorWithFlattening`` (which marks each sequence's
    first label -100, so no target crosses a sequence boundary) that keeps each example's
    ``labels`` (and ``prompt_length`` masking). Train with ``use_cache=False`` (the loop and Trainer do): with a
    cache, the packed-sequence mask is not built and sequences attend across each other.
    """

    def __init__(self) -> None:
        self._flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        features = []
        for example in examples:
            ids, labels = PaddingCollator._row(example)
            features.append({"input_ids": ids, "labels": labels})
        return self._flatten(features, return_tensors="pt")
