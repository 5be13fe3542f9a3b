"""Runtime helpers for distributed training that the library itself needs: the node layout, whether
ZeRO-3 shards a model, and gathering / saving a model whose parameters ZeRO-3 shards.

Launch *policy* (is the backend that will run the one that was asked for? DeepSpeed config files,
the loop engine's Accelerator) belongs to the recipe kit, :mod:`hf_accum.recipe.launch`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

# -- the node layout ------------------------------------------------------------------------------


def num_nodes(environ: Mapping[str, str] | None = None) -> int:
    """Machines this run spans. torchrun (and Accelerate's launchers, built on it) export
    ``GROUP_WORLD_SIZE`` (one agent per node) and ``LOCAL_WORLD_SIZE`` (processes on this node)."""
    environ = os.environ if environ is None else environ
    if environ.get("GROUP_WORLD_SIZE", "").isdigit():
        return max(1, int(environ["GROUP_WORLD_SIZE"]))
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0 and int(world) % int(local) == 0:
        return max(1, int(world) // int(local))
    return 1


def is_main_process() -> bool:
    """This process is global rank 0: the process group's rank once one exists, else the launcher's ``RANK``
    (0 when not launched). The one test of "main process" for code that holds no Accelerator (signal
    handlers, module-level notes); code with an Accelerator uses ``accelerator.is_main_process``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


# -- ZeRO-3 partitioned models ------------------------------------------------------------------


def is_partitioned(model: torch.nn.Module) -> bool:
    """True when ZeRO-3 holds the model's parameters in shards (each forward gathers them)."""
    return any(hasattr(parameter, "ds_id") for parameter in model.parameters())


# -- saving under ZeRO-3 ------------------------------------------------------------------------------


def gathered_state_dict(model: torch.nn.Module, keep: bool = True, trainable_only: bool = False) -> dict:
    """The model's state dict at full size, as CPU copies, also where ZeRO-3 or FSDP2 hold one shard per rank.

    Collective under ZeRO-3 and FSDP2: every rank must call it, with the same ``trainable_only`` (one
    all-gather per parameter, so only one parameter is whole at a time). ``keep=False`` (the
    ranks that do not write) joins the gathers and returns ``{}``. ``trainable_only`` keeps the
    parameters that train (a PEFT adapter) and skips the frozen base weights.
    """
    state = model.state_dict(keep_vars=True)
    if trainable_only:
        state = {name: tensor for name, tensor in state.items() if getattr(tensor, "requires_grad", False)}
    full = {}
    for name, tensor in state.items():
        if hasattr(tensor, "full_tensor"):  # an FSDP2 shard (DTensor): all-gathered, a collective
            tensor = tensor.full_tensor()
        with _gathered(tensor):
            if keep:
                # FSDP's activation-checkpoint wrapper renames modules; saved names are the model's own.
                full[name.replace("_checkpoint_wrapped_module.", "")] = tensor.detach().to("cpu", copy=True)
    return full


def _gathered(tensor: torch.Tensor):
    """All of a ZeRO-3 parameter on every rank for the ``with`` block (read only); a no-op otherwise."""
    if not hasattr(tensor, "ds_id"):
        import contextlib

        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)


def save_pretrained(model: torch.nn.Module, directory: str, is_main_process: bool, **kwargs: Any) -> None:
    """``model.save_pretrained(directory)`` that also works under ZeRO-3. Call it on EVERY rank.

    A PEFT model saves its adapter (only trainable tensors are gathered: the frozen base model is not
    part of an adapter); any other model saves every tensor. The main process writes.
    """
    model = getattr(model, "module", model)  # a DeepSpeed engine or DDP wrapper
    is_peft = hasattr(model, "peft_config")
    state = gathered_state_dict(model, keep=is_main_process, trainable_only=is_peft)
    if is_main_process:
        model.save_pretrained(directory, state_dict=state, safe_serialization=True, **kwargs)
