"""The model families hf_accum is measured on, as one table (:data:`FAMILIES`): each a tiny model built from its
transformers config class (random init, fixed seed, float64), the data it trains on (uneven target counts) and
the loss path it is expected to take. ``tests/unit/test_model_families.py`` runs every row through both
front-ends against the independent big-batch reference; docs/models.md reports the measured errors.

Adding a family is one :class:`Family` line: a builder (``config class name``, ``model class name``, config
values) and, where the model is not a plain causal LM, its data (``"classification"``, ``"token"``, ``"vlm"``,
``"seq2seq"``). Builders import transformers' classes by name, so a family a transformers version lacks fails its
own row only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers
from torch import nn

from hf_accum.batching import PaddingCollator
from hf_accum.testing.data import ClassificationCollator, random_rows
from hf_accum.testing.models import PAD, VOCAB, keep_norm_dtype, tiny_moe_causal_lm
from hf_accum.testing.scenarios import Scenario
from hf_accum.testing.seq2seq import seq2seq_rows, seq2seq_scenario, tiny_seq2seq

IMAGE_TOKEN = VOCAB - 1
"""LLaVA's image placeholder id: text rows draw their tokens below it."""
IMAGE_SIZE, PATCH = 8, 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # CLIP patches, its CLS token dropped ("default" feature strategy)

_IDS: dict[str, Any] = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
DECODER: dict[str, Any] = dict(_IDS, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
"""The shared tiny decoder shape (each family as small as transformers allows)."""


def from_config(config_name: str, model_name: str, **values: Any) -> Callable[[], nn.Module]:
    """A builder: ``transformers.<model_name>(transformers.<config_name>(**values))``, seed 0, float64, RMSNorms
    computing in the model's dtype."""

    def build() -> nn.Module:
        config = without_dropout(getattr(transformers, config_name)(**values))
        torch.manual_seed(0)
        return _no_dropout_modules(keep_norm_dtype(getattr(transformers, model_name)(config).to(torch.float64)))

    return build


def without_dropout(config: Any) -> Any:
    """``config`` (and its sub-configs) with every ``*dropout*`` / ``*pdrop`` rate at 0: a dropout mask would make
    the trained forward and the reference's differ (GPT-2, OPT, Phi ship with 0.1)."""
    for key, value in list(vars(config).items()):
        if isinstance(value, transformers.PretrainedConfig):
            without_dropout(value)
        elif ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def _no_dropout_modules(model: nn.Module) -> nn.Module:
    """Every ``nn.Dropout`` at 0 too: some heads take a default rate no config field holds (token classification's
    ``classifier_dropout`` falls back to 0.1)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def tiny_llava(vision_feature_layer: int = -1) -> nn.Module:
    """A tiny LLaVA: CLIP vision tower (8x8 images, 4 patches) + tiny Llama. With ``vision_feature_layer=-1`` the
    features come from CLIP's last layer output before ``post_layernorm``, which then gets no gradient."""
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH,
                                           projection_dim=16)
    text = transformers.LlamaConfig(**DECODER)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                      vision_feature_layer=vision_feature_layer,
                                      vision_feature_select_strategy="default")
    without_dropout(config)
    torch.manual_seed(0)
    model: nn.Module = transformers.LlavaForConditionalGeneration(config)
    return _no_dropout_modules(keep_norm_dtype(model.to(torch.float64)))


def vlm_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows ``<image tokens> text`` with the image and the prompt masked (uneven target counts), each with its
    own random ``pixel_values`` (3 x 8 x 8)."""
    generator = torch.Generator().manual_seed(seed + 1)
    rows = random_rows(n, seed=seed, max_len=24, prompt_masking=True, vocab_size=IMAGE_TOKEN)
    return [
        {"input_ids": [IMAGE_TOKEN] * IMAGE_TOKENS + list(row["input_ids"]),
         "prompt_length": IMAGE_TOKENS + int(row["prompt_length"]),
         "pixel_values": torch.randn(3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)}
        for row in rows
    ]


class VisionCollator(PaddingCollator):
    """:class:`~hf_accum.batching.PaddingCollator` plus the rows' images stacked as ``pixel_values``."""

    def __call__(self, examples: Any) -> dict[str, torch.Tensor]:
        batch = super().__call__(examples)
        batch["pixel_values"] = torch.stack([example["pixel_values"] for example in examples])
        return batch


def token_rows(n: int, seed: int = 0, num_labels: int = 3) -> list[dict[str, Any]]:
    """Rows with a class per token (``id % num_labels``) and a masked prompt (uneven target counts)."""
    rows = random_rows(n, seed=seed, prompt_masking=True)
    return [dict(row, labels=[int(t) % num_labels for t in row["input_ids"]]) for row in rows]


# data name -> (rows(n, seed), collator, loss kind)
DATA: dict[str, tuple[Callable[[int, int], list[dict[str, Any]]], Any, str]] = {
    "text": (lambda n, seed: random_rows(n, seed=seed, prompt_masking=True), PaddingCollator(PAD), "causal_lm"),
    "classification": (lambda n, seed: random_rows(n, seed=seed, num_labels=3), ClassificationCollator(),
                       "sequence"),
    "token": (token_rows, PaddingCollator(PAD), "token"),
    "vlm": (vlm_rows, VisionCollator(PAD), "causal_lm"),
}


@dataclass(frozen=True)
class Family:
    """One row of the table: how to build the family tiny, what it trains on, and the loss path it takes."""

    name: str
    build: Callable[[], nn.Module]
    fused: bool = True
    """Expected path: the fused loss (no ``tokens x vocab`` logits) or the logits path."""
    why: str = "plain `nn.Linear` head"
    data: str = "text"
    router_loss: str = "none"
    """MoE: the reference adds the router loss by the documented per-micro-batch rule."""


_MOE: dict[str, Any] = dict(router_loss="per_micro_batch", why="plain head; router loss added by the documented rule")
_QWEN3_MOE: dict[str, Any] = dict(DECODER, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  output_router_logits=True, router_aux_loss_coef=0.02, experts_implementation="eager")
_CLASSES: dict[str, Any] = dict(DECODER, num_labels=3)
_SEQ2SEQ = ("encoder-decoder: labels aligned with the decoder's logits (the `token` layout), which the fused loss "
            "does not cover (it fuses the causal-LM layout only); labels-only batches, decoder inputs built as the "
            "model does")

FAMILIES: tuple[Family, ...] = (
    Family("llama", from_config("LlamaConfig", "LlamaForCausalLM", **DECODER)),
    Family("qwen2", from_config("Qwen2Config", "Qwen2ForCausalLM", **DECODER)),
    Family("qwen3", from_config("Qwen3Config", "Qwen3ForCausalLM", **DECODER, head_dim=8),
           why="plain head (q/k norms in attention)"),
    Family("qwen3_moe", from_config("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_QWEN3_MOE), **_MOE),
    Family("mistral", from_config("MistralConfig", "MistralForCausalLM", **DECODER)),
    Family("mixtral", lambda: tiny_moe_causal_lm("mixtral"), **_MOE),
    Family("qwen2_moe", lambda: tiny_moe_causal_lm("qwen2_moe"), **_MOE),
    Family("gemma2", from_config("Gemma2Config", "Gemma2ForCausalLM", **DECODER, head_dim=8),
           why="`final_logit_softcapping` folded into the chunks"),
    Family("gemma3", from_config("Gemma3TextConfig", "Gemma3ForCausalLM", **DECODER, head_dim=8,
                                 final_logit_softcapping=3.0, sliding_window=8),
           why="soft-cap folded into the chunks; sliding-window layers"),
    Family("cohere", from_config("CohereConfig", "CohereForCausalLM", **DECODER, logit_scale=0.0625),
           why="`logit_scale` folded into the chunks"),
    Family("gpt2", from_config("GPT2Config", "GPT2LMHeadModel", **_IDS, n_embd=16, n_layer=2, n_head=4,
                               n_positions=64), why="plain (tied) head"),
    Family("gpt_neox", from_config("GPTNeoXConfig", "GPTNeoXForCausalLM", **_IDS, hidden_size=16,
                                   intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   max_position_embeddings=64)),
    Family("opt", from_config("OPTConfig", "OPTForCausalLM", **_IDS, hidden_size=16, ffn_dim=32,
                              num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=8,
                              max_position_embeddings=64), why="the head sees `project_out`'s output"),
    Family("phi", from_config("PhiConfig", "PhiForCausalLM", **_IDS, hidden_size=16, intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64),
           why="head with a bias (fused too)"),
    Family("phi3", from_config("Phi3Config", "Phi3ForCausalLM", **DECODER)),
    Family("granite", from_config("GraniteConfig", "GraniteForCausalLM", **DECODER, logits_scaling=4.0,
                                  residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.3),
           why="`logits_scaling` folded into the chunks"),
    Family("olmo2", from_config("Olmo2Config", "Olmo2ForCausalLM", **DECODER)),
    Family("smollm3", from_config("SmolLM3Config", "SmolLM3ForCausalLM", **DECODER),
           why="plain head (layers without RoPE)"),
    Family("gemma4", from_config("Gemma4TextConfig", "Gemma4ForCausalLM", **DECODER, head_dim=8,
                                 global_head_dim=8, sliding_window=8, vocab_size_per_layer_input=VOCAB,
                                 hidden_size_per_layer_input=8,
                                 layer_types=["sliding_attention", "full_attention"]),
           why="soft-cap folded into the chunks; per-layer attention shapes"),
    Family("llama_sequence_classification", from_config("LlamaConfig", "LlamaForSequenceClassification",
                                                        **_CLASSES),
           fused=False, why="a classification head: no vocabulary to save", data="classification"),
    Family("llama_token_classification", from_config("LlamaConfig", "LlamaForTokenClassification", **_CLASSES),
           fused=False, why="a classification head: no vocabulary to save", data="token"),
    Family("llava", tiny_llava, why="plain head of the language model (CLIP + Llama)", data="vlm"),
    Family("t5", lambda: tiny_seq2seq("t5"), fused=False, why=_SEQ2SEQ, data="seq2seq"),
    Family("bart", lambda: tiny_seq2seq("bart"), fused=False, why=_SEQ2SEQ, data="seq2seq"),
)
FAMILY_NAMES = tuple(family.name for family in FAMILIES)


def family(name: str) -> Family:
    """The row called ``name`` (one of :data:`FAMILY_NAMES`)."""
    for row in FAMILIES:
        if row.name == name:
            return row
    raise ValueError(f"family={name!r}; allowed: {', '.join(FAMILY_NAMES)}")


def family_scenario(row: Family, rows: int = 6, seed: int = 7) -> Scenario:
    """``row`` trained for one update of K=3 micro-batches of 2 rows (uneven target counts), AdamW, constant LR,
    label smoothing 0.1 (folded into the fused chunks too): the audited
    :class:`~hf_accum.testing.scenarios.Scenario` both front-ends run. Encoder-decoders train labels-only batches
    against the model's own loss (no smoothing there)."""
    if row.data == "seq2seq":  # labels only (no decoder_input_ids): the front-ends build them as the model does
        return seq2seq_scenario(row.name, seq2seq_rows(rows, seed), decoder_inputs=False)
    make_rows, collator, kind = DATA[row.data]
    return Scenario(row.name, row.build, make_rows(rows, seed), collator, micro_batch=2, accumulation=3,
                    loss_kind=kind, router_loss=row.router_loss, label_smoothing=0.1)
