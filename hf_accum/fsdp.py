"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under the loop engine, through Accelerate, on GPUs and on CPU.

Why the loop needs nothing FSDP-specific for exactness: under FSDP2 every rank holds a shard of each
gradient (a ``DTensor``), reduce-scattered (summed over ranks, divided by ``W``) on the window's last
micro-batch only -- Accelerate's ``accumulate()`` turns gradient sync off on the others. The loop's one
rescale by ``K * W / N`` (:func:`hf_accum.accumulation.exact_mean_factor`) multiplies each shard in
place, which is the same as multiplying the whole gradient; ``clip_grad_norm_`` over DTensors takes the
norm of the *whole* gradient (the shards' squared norms summed over ranks), not one per shard.

What this module adds is the set-up: :func:`fsdp2_plugin` (Accelerate's plugin for FSDP2, with the
transformer layer classes to shard by, optional bf16 parameters with fp32 gradient reduction) and
:func:`fsdp_accelerator`, which returns an ``Accelerator`` that really runs FSDP2 -- also on CPU, where
Accelerate 1.15 keeps ``MULTI_CPU`` and silently trains DDP when handed an FSDP plugin
(:func:`hf_accum.compat.force_fsdp_distributed_type` sets the distributed type itself, the documented
path PyTorch's own FSDP tests use on CPU: a ``cpu`` device mesh over gloo). Anything that would not run
FSDP2 after all raises :class:`FsdpUnavailableError` instead of falling back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from hf_accum.errors import InputError

if TYPE_CHECKING:  # imported where used at run time: importing hf_accum does not import accelerate's FSDP parts
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments


class FsdpUnavailableError(InputError):
    """FSDP2 was asked for but would not run (one process, FSDP1, an Accelerate that changed)."""


def fsdp2_plugin(
    transformer_layer_cls: Sequence[str] | None = None,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
) -> FullyShardedDataParallelPlugin:
    """Accelerate's ``FullyShardedDataParallelPlugin`` for FSDP2.

    ``transformer_layer_cls``: class names to shard one by one (e.g. ``["LlamaDecoderLayer"]``; default:
    the model's ``_no_split_modules``, Accelerate's rule). ``param_dtype=torch.bfloat16``: compute in bf16
    while the sharded master weights stay fp32 and gradients are reduced (and accumulated across
    micro-batches) in fp32 -- the precision exact accumulation needs.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin

    policy = None
    if param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=reshard_after_forward,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(transformer_layer_cls) if transformer_layer_cls else None,
        mixed_precision_policy=policy,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
        cpu_ram_efficient_loading=False,
        state_dict_type="SHARDED_STATE_DICT",
    )


def fsdp_accelerator(plugin: FullyShardedDataParallelPlugin, gradient_accumulation_steps: int, cpu: bool | None = None,
                     **kwargs: Any) -> Accelerator:
    """An ``Accelerator`` that runs ``plugin`` (FSDP2) on every process; refuses rather than falls back."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from hf_accum.compat import force_fsdp_distributed_type

    if getattr(plugin, "fsdp_version", 1) != 2:
        raise FsdpUnavailableError("hf_accum runs FSDP2 only (fsdp_version=2): FSDP1 segfaults gathering a "
                                   "full state dict with CPU offload and is being retired by PyTorch")
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=gradient_accumulation_steps,
                              fsdp_plugin=plugin, **kwargs)
    if accelerator.distributed_type != DistributedType.FSDP:
        if not (cpu and accelerator.distributed_type == DistributedType.MULTI_CPU):
            raise FsdpUnavailableError(
                f"FSDP2 requested but Accelerate set up {accelerator.distributed_type.value} with "
                f"{accelerator.num_processes} process(es); launch 2 or more processes (torchrun --nproc_per_node N)"
            )
        force_fsdp_distributed_type(accelerator, plugin)
    if not accelerator.is_fsdp2:
        raise FsdpUnavailableError(f"Accelerate set up {accelerator.distributed_type.value}, not FSDP2")
    return accelerator


def refuse_fsdp1(plugin_args: dict[str, Any] | None) -> None:
    """``TrainingArguments.fsdp_plugin_args`` asking for FSDP1: refused, naming the key."""
    if plugin_args is not None and int(plugin_args.get("fsdp_version", 1)) != 2:
        raise FsdpUnavailableError("fsdp_config.version=1 (FSDP1) is refused: hf_accum runs FSDP2 only (FSDP1 "
                                   "segfaults gathering a full state dict on CPU); set fsdp_config.version=2")


def force_trainer_fsdp2(accelerator: Accelerator, args: TrainingArguments) -> None:
    """``Trainer`` built its Accelerator with ``args.fsdp_plugin_args`` but Accelerate dropped the plugin (CPU
    processes): rebuild the same plugin and run it, or refuse -- never train DDP in its place."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from hf_accum.compat import force_fsdp_distributed_type

    plugin_args = dict(args.fsdp_plugin_args)
    refuse_fsdp1(plugin_args)
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        raise FsdpUnavailableError(
            f"fsdp was requested but Accelerate set up {accelerator.distributed_type.value} with "
            f"{accelerator.num_processes} process(es); launch 2 or more processes (torchrun --nproc_per_node N)")
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if plugin.activation_checkpointing and args.activation_checkpointing:  # Trainer's own check, skipped on CPU
        raise FsdpUnavailableError("fsdp_config.activation_checkpointing and activation_checkpointing are both set: "
                                   "keep FSDP's (fsdp_config) only")
    force_fsdp_distributed_type(accelerator, plugin)
    if not accelerator.is_fsdp2:
        raise FsdpUnavailableError(f"Accelerate set up {accelerator.distributed_type.value}, not FSDP2")


def is_fsdp(accelerator: Accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP
