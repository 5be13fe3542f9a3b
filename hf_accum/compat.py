"""Every place hf_accum relies on a private or version-specific detail of a library it builds on.

One home, so that an upgrade of transformers / accelerate / TRL / bitsandbytes is checked here and
nowhere else. Each entry names the version it was checked against and what breaks without it.
"""

from __future__ import annotations

import torch

# --------------------------------------------------------------------------------------------------
# bitsandbytes (checked: 0.50.2)
# --------------------------------------------------------------------------------------------------


def keep_4bit_training_layout(model: torch.nn.Module) -> int:
    """Keep every bitsandbytes ``Linear4bit`` weight in the layout it was quantized in, on every CPU.

    bitsandbytes 0.50 ``Linear4bit.forward`` repacks a 4-bit weight into a CPU *inference* layout
    (``_convert_weight_packed_for_cpu``) whenever it runs on a CPU with ``avx512_bf16``, in eval mode,
    on an input without grad -- a held-out evaluation before or during training. The repacked weight
    is then a different tensor from the one training, DeepSpeed ZeRO-3 partitioning and
    ``state_dict`` expect: under ZeRO-3 saving dies in ``_convert_weight_packed_for_cpu_inverse``
    ("packed_weight should be [N, K/2]"), so the same run passes or fails depending on the CPU.

    A fine-tune alternates training and evaluation, so the inference layout buys nothing here. This
    turns the repacking off for every ``Linear4bit`` (the module's own ``support_avx512bf16_for_cpu``
    switch) and unpacks any weight that was already repacked. Idempotent and cheap: call it after
    loading and again before training. Returns the number of 4-bit layers it holds in place.
    """
    layers = [module for module in model.modules() if _is_linear4bit(module)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False  # bitsandbytes reads this on every forward
        weight = layer.weight
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
            layer.quant_state = weight.quant_state
    return len(layers)


def _is_linear4bit(module: torch.nn.Module) -> bool:
    # By name, so that hf_accum imports without bitsandbytes installed (QLoRA is an optional extra).
    return any(cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")
               for cls in type(module).__mro__)
