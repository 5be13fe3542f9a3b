"""What makes bf16 pay on a CPU with bf16 GEMMs: the recipe's two changes to the model that upstream defaults make
slower in bf16 than they need to be (measured on SmolLM2-135M's dimensions, docs/measurements.md, "bf16 on a CPU
with bf16 GEMMs").

**LoRA adapters held in float32 but computed in bfloat16.** PEFT gives a model with bfloat16 weights float32
adapters (``autocast_adapter_dtype=True``) and, in every adapted layer, casts the layer's *activations* to float32
before the adapter and the result back after it; in backward the autograd engine casts the gradients the other way.
The activations are ``tokens x hidden`` per layer, so on a CPU with bf16 GEMMs these casts were the bf16 step's
largest cost after its GEMMs (20.8%). Keeping the adapters in bf16 (PEFT's ``autocast_adapter_dtype=False``)
removes the casts but leaves AdamW stepping bf16 weights: an update below ~1/256 of a weight rounds away.
:func:`compute_adapters_in_activation_dtype` does what torch's autocast does for a float32 weight: the *weights*
are cast (``rank x hidden``, a few KB per adapter) to the activations' dtype inside the forward, the activations
stay bf16, and the cast's backward returns the weight's gradient to float32. So the parameters AdamW steps, the
gradients the loop sums over a window (exactly, in float32) and the adapter that is saved all stay float32, while
the adapter's two GEMMs run in bf16 like the base layer's. Only bfloat16 activations take this path (float16 ones
are cast up as PEFT does: without a loss scaler their gradients would underflow). The gradient each micro-batch
contributes is then a bf16 GEMM's (``bf16(x)^T @ bf16(grad)``, accumulated in float32 inside the GEMM, rounded to
bf16, then cast up exactly), the same as a bf16-adapter run's, bit for bit (``tests/unit/test_adapter_dtype.py``).

**Attention's SDPA in float32.** torch's CPU flash-attention kernel is several times slower in bf16 than in
float32 at short rows (forward + backward, 4 x 9 heads x 32 positions x 64: 2.58 ms bf16, 0.70 ms fp32; 128
positions 16.0 vs 8.6 ms; 256: 33.8 vs 30.9 ms, one thread): :data:`SDPA_FLOAT32` is transformers' own SDPA
attention with query, key and value cast up to float32 and the output back (casts of ``tokens x heads x 64``,
cheap beside the attention), registered as an attention implementation so the model's config names it. It is
also the more precise of the two (the bf16 kernel rounds its output and gradients to bf16).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# The attention implementation's registered name (``model.config._attn_implementation``).
SDPA_FLOAT32 = "sdpa_float32"


class InputDtypeLinear(torch.nn.Linear):
    """A LoRA ``lora_A`` / ``lora_B`` linear whose float32 weight is cast to a bfloat16 input's dtype in the
    forward (differentiably: the gradient returns to the float32 parameter); any other input is cast to the
    weight's dtype, as PEFT casts it. Swapped in as the module's class, so parameters, state dict and saved
    adapters are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.weight.dtype == torch.float32:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        return super().forward(x.to(self.weight.dtype))


def compute_adapters_in_activation_dtype(model: Any) -> int:
    """Make every plain LoRA layer of the PEFT ``model`` compute its adapter in the activations' dtype (see the
    module docstring); returns how many layers changed. Layers with a LoRA variant (DoRA and the like, whose
    forward uses the adapter weights beyond ``lora_A``/``lora_B``) keep PEFT's float32 path."""
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer) or getattr(module, "lora_variant", None):
            continue
        linears = [m for adapters in (module.lora_A, module.lora_B) for m in adapters.values()]
        if not linears or any(type(m) not in (torch.nn.Linear, InputDtypeLinear) for m in linears):
            continue  # embeddings and convolutions keep PEFT's path
        for linear in linears:
            linear.__class__ = InputDtypeLinear
        # PEFT's own cast of the activations to the adapter's dtype (``LoraLayer._cast_input_dtype``) is off:
        # the adapter linears cast what they need themselves.
        module.cast_input_dtype_enabled = False
        changed += 1
    return changed


def sdpa_in_float32(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention (``sdpa_attention_forward``, GQA and masks as it handles them) on float32
    copies of query, key and value; the output in the query's dtype. Autocast is off inside (under CPU autocast,
    SDPA would cast the float32 copies straight back to bf16)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(query.device.type, enabled=False):
        output, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                                 attention_mask, **kwargs)
    return output.to(dtype), weights


def register_sdpa_in_float32() -> None:
    """Register :func:`sdpa_in_float32` (and SDPA's mask builder) under :data:`SDPA_FLOAT32`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SDPA_FLOAT32, sdpa_in_float32)
    AttentionMaskInterface.register(SDPA_FLOAT32, sdpa_mask)


def use_float32_sdpa_for_bf16(model: Any, requested: str | None) -> bool:
    """Switch ``model``'s attention to :data:`SDPA_FLOAT32` when it runs torch's SDPA on bfloat16 weights by
    transformers' default (``requested``, the config's ``model.attn_implementation``, unset). Returns
    whether it switched. Called on a CPU only (a GPU's bf16 flash attention is the fast one)."""
    weights_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    current = getattr(model.config, "_attn_implementation", None)
    if weights_dtype != torch.bfloat16 or requested is not None or current != "sdpa":
        return False
    register_sdpa_in_float32()
    model.set_attn_implementation(SDPA_FLOAT32)  # the run's start-up line says so (recipe.outputs.describe_trainable)
    return True
