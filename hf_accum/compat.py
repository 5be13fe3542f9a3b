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


# --------------------------------------------------------------------------------------------------
# accelerate (checked: 1.15.0)
# --------------------------------------------------------------------------------------------------


def force_fsdp_distributed_type(accelerator, plugin) -> None:
    """Make an ``Accelerator`` built with an FSDP plugin on CPU processes really run FSDP.

    Accelerate 1.15 (``AcceleratorState.__init__``) sets ``DistributedType.FSDP`` only for GPU-like
    distributed types; on ``MULTI_CPU`` it keeps DDP and drops the plugin, saying nothing. FSDP2 itself
    runs on CPU (a ``cpu`` device mesh over gloo), and Accelerate's FSDP2 ``prepare`` path works once the
    state says FSDP: set exactly the fields that branch would have set, before any ``prepare``.
    """
    from accelerate.utils import DistributedType

    state = accelerator.state
    if not hasattr(state, "distributed_type") or not hasattr(type(accelerator), "is_fsdp2"):
        raise RuntimeError("accelerate's AcceleratorState changed: hf_accum cannot set FSDP on CPU with this "
                           "accelerate version (checked: 1.15)")
    from accelerate.state import PartialState

    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # Every later AcceleratorState() (prepare creates some) copies PartialState's shared fields over its own:
    # the GPU branch records FSDP there too (AcceleratorState.__init__'s last line), so must we.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
