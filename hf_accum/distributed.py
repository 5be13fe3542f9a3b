"""Runtime helpers for distributed training that the library itself needs: the node layout, whether
ZeRO-3 shards a model, and gathering / saving a model whose parameters ZeRO-3 shards.

Launch *policy* (is the backend that will run the one that was asked for? DeepSpeed config files,
the loop engine's Accelerator) belongs to the recipe kit, :mod:`hf_accum.recipe.launch`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping

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


def leave_process_group() -> None:
    """The last step of a multi-process run: all ranks in step, then the process group torn down while
    the interpreter is still whole.

    Why it is needed (torch 2.13, gloo): a collective's work object can still be alive on the backend's
    worker thread when the main thread returns from the last ``barrier``; if the interpreter is finalizing
    when that thread drops it, releasing its tensors needs the GIL, ``take_gil`` exits the thread, and the
    unwind through a ``noexcept`` destructor aborts the process ("terminate called without an active
    exception", SIGABRT). A bare ``init / all_reduce / barrier`` script exits that way in 15 of 40 runs
    here; ``destroy_process_group`` joins the worker threads first (0 of 40). A no-op without a group.

    Call it on the path where every rank finished: its barrier waits for all of them (a launcher such as
    torchrun or ``accelerate launch`` stops the other ranks when one fails; a failed run should tear the
    group down without the barrier, as the recipe does)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# -- ZeRO-3 partitioned models ------------------------------------------------------------------


# DeepSpeed's name for its CPU shared-memory all-reduce op (deepspeed/ops/op_builder/cpu/comm.py).
DEEPSPEED_SHM_OP = "deepspeed_shm_comm"


def skip_deepspeed_inference_comm_build() -> None:
    """Keep DeepSpeed's communication layer from JIT-compiling its shared-memory all-reduce op. Call it before
    DeepSpeed's comm starts (``deepspeed.init_distributed``; Accelerate's state under a DeepSpeed plugin).

    On the CPU accelerator, ``TorchBackend.__init__`` builds the C++ op ``deepspeed_shm_comm`` whenever DeepSpeed
    deems it compatible (two compiler processes, ~1 minute of both cores of a 2-core machine, on the first run
    of each machine) and uses it only in ``inference_all_reduce`` -- DeepSpeed inference's tensor parallelism.
    Training reduces through ``torch.distributed`` either way, so marking the op incompatible (the dict
    DeepSpeed consults, ``deepspeed.ops.__compatible_ops__``, kept in its module) changes nothing a training run
    computes. A no-op when DeepSpeed is not installed."""
    try:
        import deepspeed.ops
    except ImportError:
        return
    deepspeed.ops.__compatible_ops__[DEEPSPEED_SHM_OP] = False


def is_partitioned(model: torch.nn.Module) -> bool:
    """True when ZeRO-3 holds the model's parameters in shards (each forward gathers them)."""
    return any(hasattr(parameter, "ds_id") for parameter in model.parameters())


def is_fsdp_sharded(model: torch.nn.Module) -> bool:
    """True when FSDP2 holds the model's parameters as shards (DTensors gathered in every forward)."""
    return any(type(parameter).__name__ == "DTensor" for parameter in model.parameters())


@contextlib.contextmanager
def fsdp_unsharded_root(model: torch.nn.Module) -> Iterator[None]:
    """Gather FSDP2's root-level parameters (embeddings, final norm, head) for the block: ``generate`` (and a
    PEFT model's) calls the inner model's ``forward``, bypassing the root's pre-forward hook that would
    gather them. The sharded layers still gather in their own hooks. Collective: every rank, in step."""
    from torch.distributed.fsdp import FSDPModule

    roots = [module for module in model.modules() if isinstance(module, FSDPModule)][:1]
    for root in roots:
        root.unshard()
    try:
        yield
    finally:
        for root in roots:
            root.reshard()


# -- saving under ZeRO-3 ------------------------------------------------------------------------------


CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."


def gathered_state_dict(model: torch.nn.Module, keep: bool = True, trainable_only: bool = False,
                        strip_wrappers: bool = True) -> dict:
    """The model's state dict at full size, as CPU copies, also where ZeRO-3 or FSDP2 hold one shard per rank.

    Collective under ZeRO-3 and FSDP2: every rank must call it, with the same ``trainable_only`` (one
    all-gather per parameter, so only one parameter is whole at a time). ``keep=False`` (the
    ranks that do not write) joins the gathers and returns ``{}``. ``trainable_only`` keeps the
    parameters that train (a PEFT adapter) and skips the frozen base weights.
    """
    state = model.state_dict(keep_vars=True)
    if trainable_only:
        state = {name: tensor for name, tensor in state.items() if getattr(tensor, "requires_grad", False)}
    # FSDP's activation-checkpoint wrapper renames modules; its state-dict hook gives the model's own names.
    # strip_wrappers=False: the module path names instead (with the wrapper), which PEFT matches by.
    module_names = {} if strip_wrappers else {
        (id(p), n.replace(CHECKPOINT_WRAPPER, "")): n for n, p in model.named_parameters(remove_duplicate=False)}
    full = {}
    for name, tensor in state.items():
        key = module_names.get((id(tensor), name), name)  # by tensor and name: tied weights keep both names
        if hasattr(tensor, "full_tensor"):  # an FSDP2 shard (DTensor): all-gathered, a collective
            tensor = tensor.full_tensor()
        with _gathered(tensor):
            if keep:
                full[key.replace(CHECKPOINT_WRAPPER, "") if strip_wrappers else key] = tensor.detach().to(
                    "cpu", copy=True)
    return full


def _gathered(tensor: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """All of a ZeRO-3 parameter on every rank for the ``with`` block (read only); a no-op otherwise."""
    if not hasattr(tensor, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)


def save_pretrained(model: Any, directory: str, is_main_process: bool, **kwargs: Any) -> None:
    """``model.save_pretrained(directory)`` that also works under ZeRO-3. Call it on EVERY rank.

    A PEFT model saves its adapter (only trainable tensors are gathered: the frozen base model is not
    part of an adapter); any other model saves every tensor. The main process writes.
    """
    model = getattr(model, "module", model)  # a DeepSpeed engine or DDP wrapper
    is_peft = hasattr(model, "peft_config")
    # PEFT picks the adapter's tensors by the model's module names, which FSDP's checkpoint wrapper changes:
    # keep its names for that, and take them out of the written file (loadable without FSDP).
    state = gathered_state_dict(model, keep=is_main_process, trainable_only=is_peft, strip_wrappers=not is_peft)
    if is_main_process:
        model.save_pretrained(directory, state_dict=state, safe_serialization=True, **kwargs)
        if is_peft and any(CHECKPOINT_WRAPPER in name for name in state):
            _strip_wrapper_names(directory)


def _strip_wrapper_names(directory: str) -> None:
    """Rewrite a saved adapter without FSDP's checkpoint-wrapper module names."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "adapter_model.safetensors")
    tensors = load_file(path)
    save_file({name.replace(CHECKPOINT_WRAPPER, ""): tensor for name, tensor in tensors.items()}, path,
              metadata={"format": "pt"})
