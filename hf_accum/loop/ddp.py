"""DDP's ``find_unused_parameters`` for the loop's prepared model, decided the way transformers' Trainer decides it.

A model with parameters that get no gradient -- LLaVA's CLIP ``post_layernorm`` with ``vision_feature_layer=-1``,
a vision tower in a text-only micro-batch, an MoE expert no token chose -- stops plain DDP in its reducer
("Expected to have finished reduction in the prior iteration ..."), and in the update before that error the
bucket holding such a parameter is never all-reduced. ``Trainer`` (so ``AccumTrainer``) wraps with
``find_unused_parameters=True`` unless activation checkpointing is on (``TrainingArguments.
ddp_find_unused_parameters`` None); the loop decides the same from :attr:`LoopConfig.ddp_find_unused_parameters`.

The loop receives a model ``accelerator.prepare`` already wrapped, whose reducer was built with the flag. So,
before the first forward, the reducer is rebuilt with the decided value the way DDP itself rebuilds it when
unpickled (``DistributedDataParallel.__setstate__``), the user's comm hooks registered on it again. Gradients
still meet in one all-reduce per update (``no_sync`` on all but a window's last micro-batch); DDP adds a small
all-reduce of which parameters were used, and a parameter no rank used keeps ``grad=None``, as in the big batch.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger("hf_accum.loop")


def trainer_default(module: nn.Module) -> bool:
    """``find_unused_parameters`` as ``Trainer`` sets it when ``ddp_find_unused_parameters`` is None: off for a
    transformers model with activation checkpointing (reentrant checkpointing breaks it), on otherwise."""
    from transformers import PreTrainedModel

    if isinstance(module, PreTrainedModel):
        checkpointing = getattr(module, "is_activation_checkpointing",
                                getattr(module, "is_gradient_checkpointing", False))
        return not checkpointing
    return True


def set_find_unused_parameters(model: nn.Module, setting: bool | None, is_main_process: bool) -> None:
    """Give a DDP-wrapped ``model`` ``find_unused_parameters = setting`` (None: :func:`trainer_default`), before
    its first forward; says so once when it changes the value ``accelerator.prepare`` built. Anything else
    (a single process, FSDP, DeepSpeed, DDP with a static graph) is left as it is."""
    if not isinstance(model, DistributedDataParallel) or model.static_graph:
        return
    wanted = trainer_default(model.module) if setting is None else setting
    if wanted == model.find_unused_parameters:
        return
    obstacle = _cannot_rebuild(model)
    if obstacle:
        if is_main_process:
            logger.warning("DDP find_unused_parameters stays %s (%s); a parameter without a gradient will stop DDP: "
                           "pass accelerate's DistributedDataParallelKwargs(find_unused_parameters=%s) to the "
                           "Accelerator", model.find_unused_parameters, obstacle, wanted)
        return
    _rebuild_reducer(model, wanted)
    if is_main_process:
        why = "LoopConfig.ddp_find_unused_parameters" if setting is not None else (
            "as transformers' Trainer sets it for this model: parameters that get no gradient (a vision tower's "
            "unused norm, an idle expert) are skipped instead of stopping DDP's reducer")
        logger.info("DDP find_unused_parameters=%s (%s); gradients are still all-reduced once per update%s", wanted,
                    why, "" if setting is not None else "; LoopConfig.ddp_find_unused_parameters=False keeps DDP as "
                    "accelerator.prepare built it")


# DDP's private steps of __setstate__ that _rebuild_reducer repeats (torch 2.13).
_DDP_INTERNALS = ("_remove_autograd_hooks", "_build_params_for_reducer", "_build_debug_param_to_name_mapping",
                  "_ddp_init_helper", "register_comm_hook")


def _cannot_rebuild(model: DistributedDataParallel) -> str | None:
    """Why the reducer cannot be rebuilt in place, or None."""
    missing = [name for name in _DDP_INTERNALS if not callable(getattr(model, name, None))]
    if missing:  # checked before anything is torn down: a torch without them keeps DDP as prepared
        return f"this torch's DDP lacks {', '.join(missing)} (rebuilt as in torch 2.13)"
    if getattr(model, "_use_python_reducer", False):
        return "DDP compiled with its Python reducer"
    if getattr(model, "mixed_precision", None) is not None:
        return "DDP's native mixed precision"
    if any(p.grad is not None for p in model.parameters()):
        return "the model already holds gradients"
    return None


def _rebuild_reducer(model: DistributedDataParallel, find_unused: bool) -> None:
    """DDP's own steps of ``__setstate__``: a new reducer over the same parameters and buckets' settings."""
    model._remove_autograd_hooks()  # the old reducer's hooks would fire on every backward too
    model.find_unused_parameters = find_unused
    parameters, expect_sparse_gradient = model._build_params_for_reducer()
    names = model._build_debug_param_to_name_mapping(parameters)
    model._ddp_init_helper(parameters, expect_sparse_gradient, names, model.static_graph)
    hooks, model._comm_hooks = list(model._comm_hooks), []
    for hook, state in hooks:  # e.g. accelerate's fp16/bf16 compression, a test's all-reduce counter
        model.register_comm_hook(state, hook)
