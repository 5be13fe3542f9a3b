"""Tiny models for exactness checks: built from config, random init, fixed seed, float64.

Exactness checks run in float64, where "equal" means ~1e-12. ``LlamaRMSNorm`` computes in float32
even inside a float64 model; that fp32 island would put a ~1e-7 rounding floor under any float64
comparison and hide what the check measures. :func:`keep_norm_dtype` therefore gives the *instances*
of a test model a dtype-keeping norm (the same formula). The training code itself is never patched.
"""

from __future__ import annotations

import types
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_accum.tiny import tiny_llama_config

ModelT = TypeVar("ModelT", bound=nn.Module)

VOCAB = 61
PAD = 0
# Smaller than the recipe's tiny Llama: a float64 big-batch reference per update stays cheap.
TEST_SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-6,
)


def tiny_config(**overrides: Any) -> LlamaConfig:
    values = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, **TEST_SHAPE)
    values.update(overrides)
    return tiny_llama_config(**values)


def tiny_causal_lm(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: Any) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return keep_norm_dtype(_in_dtype(LlamaForCausalLM(tiny_config(**overrides)), dtype))


def tiny_lora_causal_lm(seed: int = 0, lora_dropout: float = 0.1, r: int = 4) -> torch.nn.Module:
    """:func:`tiny_causal_lm` with a float64 LoRA adapter on the attention's q/v projections (only the adapter
    trains). Its dropout draws random numbers in every forward: a resumed run matches only if the random
    states were restored."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=lora_dropout, target_modules=["q_proj", "v_proj"])
    return get_peft_model(tiny_causal_lm(seed=seed), config).to(torch.float64)


def tiny_sequence_classifier(seed: int = 0, num_labels: int = 3,
                             dtype: torch.dtype = torch.float64) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    return keep_norm_dtype(_in_dtype(LlamaForSequenceClassification(tiny_config(num_labels=num_labels)), dtype))


def _in_dtype(model: ModelT, dtype: torch.dtype) -> ModelT:
    """``model.to(dtype)``, typed through ``nn.Module.to`` (transformers wraps ``PreTrainedModel.to`` with
    ``functools.wraps(nn.Module.to)``, which type checkers read as the unbound function)."""
    return model.to(dtype)


def keep_norm_dtype(model: ModelT) -> ModelT:
    """Make RMSNorm instances compute in the input dtype (same formula as transformers')."""

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:  # an RMSNorm of any model family
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(forward, module)
    return model


MOE_FAMILIES = ("mixtral", "qwen2_moe")


def tiny_moe_causal_lm(
    family: str = "mixtral", seed: int = 0, router_aux_loss_coef: float = 0.02, dtype: torch.dtype = torch.float64,
    **overrides: Any,
) -> torch.nn.Module:
    """A tiny Mixtral or Qwen2-MoE (4 experts, top-2) returning its router loss (``output_router_logits``),
    with eager experts: the grouped-mm kernel refuses float64."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    shape: dict[str, Any] = dict(  # config keywords of both families
        vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, hidden_size=16, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=router_aux_loss_coef,
        experts_implementation="eager",
    )
    shape.update(overrides)
    torch.manual_seed(seed)
    model: torch.nn.Module
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, **shape))
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32, **shape)
        model = Qwen2MoeForCausalLM(config)
    else:
        raise ValueError(f"family={family!r}; allowed: {MOE_FAMILIES}")
    return keep_norm_dtype(_in_dtype(model, dtype))


def router_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The routers' weights (``...mlp.gate.weight``): the parameters the router loss is about."""
    return {name: p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")}


class NoKwargsForCausalLM(nn.Module):
    """A causal LM whose forward takes no ``**kwargs`` (stock Trainer then averages micro-batch means)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None) -> CausalLMOutputWithPast:
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        loss = None
        if labels is not None:  # the textbook per-micro-batch mean (what stock Trainer relies on)
            logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
            loss = nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=out.logits)
