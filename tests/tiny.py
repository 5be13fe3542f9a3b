"""Tiny models (built from config, random init, fixed seed) and uneven data for the tests.

Exactness tests run in float64, where "equal" means ~1e-12. Two stock fp32 islands would hide
the accumulation math under fp32 rounding (DESIGN.md section 4): ``LlamaRMSNorm`` computes in
float32 even in a float64 model, so :func:`keep_norm_dtype` patches the *instances* of the
test model with a dtype-keeping norm (same formula; hf_accum.checking.keep_norm_dtype, which
``hf-accum check`` applies the same way). The training code itself is never patched.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from hf_accum.checking import keep_norm_dtype  # noqa: F401  (re-exported for tests)

VOCAB = 61
PAD = 0


def tiny_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_causal_lm(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**overrides)).to(dtype)
    return keep_norm_dtype(model)


def tiny_sequence_classifier(seed: int = 0, num_labels: int = 3, dtype=torch.float64):
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(tiny_config(num_labels=num_labels)).to(dtype)
    return keep_norm_dtype(model)


def uneven_examples(
    n: int,
    seed: int = 0,
    min_len: int = 3,
    max_len: int = 40,
    prompt_masking: bool = False,
    long_rows=None,
    num_labels: int | None = None,
) -> list[dict]:
    """Examples with strongly varying lengths. ``long_rows(i) -> bool`` forces long/short rows
    (used to give DDP ranks very different token counts). Token ids avoid PAD."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        if long_rows is None:
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        else:
            length = max_len if long_rows(i) else min_len + int(torch.randint(0, 3, (1,), generator=generator))
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        example = {"input_ids": ids}
        if prompt_masking:
            example["prompt_length"] = int(torch.randint(0, length, (1,), generator=generator))
        if num_labels is not None:
            example["label"] = int(torch.randint(0, num_labels, (1,), generator=generator))
        examples.append(example)
    return examples


class ClassificationCollator:
    """Right-padded rows with one label per row (sequence classification). ``label_kind``:
    ``class`` (an int), ``regression`` (a float derived from the row), ``multi_label`` (3 floats)."""

    def __init__(self, label_kind: str = "class"):
        self.label_kind = label_kind

    def __call__(self, examples):
        length = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), length), PAD, dtype=torch.long)
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
