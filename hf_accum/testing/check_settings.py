"""The user's fine-tuning settings, applied to the model ``hf-accum check`` audits: LoRA and quantization.

:class:`FineTuneSettings` holds a ``peft.LoraConfig`` (None: full fine-tuning) and a
``transformers.BitsAndBytesConfig`` (None: unquantized), as the recipe's ``lora`` / ``quantization`` sections or
``hf-accum check --lora-r ...`` give them. :meth:`FineTuneSettings.apply` turns the float64 model the check built
into the model the user trains:

* **quantization**: every linear layer bitsandbytes would quantize (not the output head, tied weights or the
  config's ``llm_int8_skip_modules``) gets the values the quantizer gives it -- 4-bit (``nf4``/``fp4``, the config's
  block statistics and double quantization) or 8-bit rowwise -- held in float64 and frozen. The 4-bit and 8-bit
  kernels themselves do not run: they refuse float64, and the check measures the accumulation arithmetic, which a
  kernel's own rounding would hide. What the adapters train against is the quantized base, as in QLoRA.
* **LoRA**: ``peft.get_peft_model`` with the user's config (rank, alpha, target modules, ``modules_to_save``...),
  except ``lora_dropout``, forced to 0: a dropout mask cannot be repeated by the big-batch reference.

The check then audits exactly the parameters this leaves trainable.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator, cast

import torch


@dataclass(frozen=True)
class FineTuneSettings:
    lora: Any = None
    """A ``peft.LoraConfig``; None: full fine-tuning."""
    quantization: Any = None
    """A ``transformers.BitsAndBytesConfig`` (4-bit or 8-bit); None: unquantized."""

    @property
    def full_fine_tuning(self) -> bool:
        return self.lora is None

    def describe(self) -> str:
        """``LoRA r=8 on q_proj,v_proj, 4-bit nf4 base`` / ``full fine-tuning``: for the check's lines."""
        parts = []
        if self.lora is not None:
            targets = self.lora.target_modules
            names = ",".join(sorted(targets)) if isinstance(targets, (set, list, tuple)) else str(targets)
            parts.append(f"LoRA r={self.lora.r} alpha={self.lora.lora_alpha} on {names}")
        else:
            parts.append("full fine-tuning")
        if self.quantization is not None:
            parts.append(f"{_quantization_name(self.quantization)} base (values as quantized, in float64)")
        return ", ".join(parts)

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` as the user trains it: quantized base values, then LoRA adapters (see the module docstring)."""
        if self.quantization is not None:
            quantize_linear_weights(model, self.quantization)
        if self.lora is None:
            return model
        from peft import get_peft_model

        lora = copy.copy(self.lora)
        lora.lora_dropout = 0.0  # the reference cannot repeat a training forward's dropout mask
        return get_peft_model(model, lora)


def lora_settings(r: int, alpha: float | None, target_modules: list[str] | None) -> Any:
    """A ``peft.LoraConfig`` from the command line's ``--lora-r/--lora-alpha/--lora-target-modules``."""
    if r < 1:
        raise ValueError(f"--lora-r {r}: must be >= 1")
    from peft import LoraConfig

    targets: str | list[str] = target_modules if target_modules else "all-linear"
    # PEFT annotates lora_alpha as int but only divides by it (scaling = alpha / r): a float alpha is honoured.
    scaling_alpha = cast(int, alpha if alpha is not None else 2 * r)
    return LoraConfig(r=r, lora_alpha=scaling_alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")


def _quantization_name(config: Any) -> str:
    if getattr(config, "load_in_4bit", False):
        return f"4-bit {config.bnb_4bit_quant_type}"
    if getattr(config, "load_in_8bit", False):
        return "8-bit"
    return "unquantized"


def quantize_linear_weights(model: torch.nn.Module, config: Any) -> list[str]:
    """Replace, in place, the weight of every linear layer bitsandbytes would quantize under ``config`` by the
    values its quantizer gives (4-bit blockwise or 8-bit rowwise), frozen. Returns the layers' names."""
    from transformers.quantizers.base import get_keys_to_not_convert

    skipped = set(get_keys_to_not_convert(model)) | set(getattr(config, "llm_int8_skip_modules", None) or [])
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or any(name == s or name.endswith("." + s) for s in skipped):
            continue
        with torch.no_grad():
            module.weight.copy_(quantized_values(module.weight, config))
        module.weight.requires_grad_(False)
        names.append(name)
    return names


def quantized_values(weight: torch.Tensor, config: Any) -> torch.Tensor:
    """``weight`` as ``config``'s quantizer stores it, dequantized, in ``weight``'s dtype. Quantized from float32
    (bitsandbytes takes float16/bfloat16/float32), as a checkpoint stored in float32 would be."""
    with _plain_float32():
        return _round_trip(weight.detach(), config).to(weight.dtype).reshape(weight.shape)


@contextlib.contextmanager
def _plain_float32() -> Iterator[None]:
    """Outside :func:`hf_accum.testing.float64.float64_arithmetic` (which the model is built inside): the
    quantizer's own float32 requests and default-dtype tensors (its code tables) must stay float32."""
    previous = torch.get_default_dtype()
    with torch._C.DisableTorchFunction():
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def _round_trip(weight: torch.Tensor, config: Any) -> torch.Tensor:
    import bitsandbytes.functional as bnb

    source = weight.to(torch.float32)
    if getattr(config, "load_in_4bit", False):
        packed, state = bnb.quantize_4bit(source, blocksize=64, quant_type=config.bnb_4bit_quant_type,
                                          compress_statistics=config.bnb_4bit_use_double_quant)
        values = bnb.dequantize_4bit(packed, state)
    elif getattr(config, "load_in_8bit", False):
        rows, scales, _ = bnb.int8_vectorwise_quant(source)
        values = bnb.int8_vectorwise_dequant(rows, scales)
    else:
        raise ValueError(f"quantization {config}: neither load_in_4bit nor load_in_8bit is set")
    return values
