"""The loop's checkpoints of an FSDP2 model: sharded weights and optimizer state through
``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards (``fsdp/__<rank>_0.distcp``, DCP's ``fsdp/.metadata``) into the
checkpoint's staging directory, so the checkpoint stays atomic
(:func:`hf_accum.checkpointing.checkpoint.atomic_directory` renames it once every rank has written) and its manifest
lists the shards like any other file. Nothing is gathered to one rank: a model that only fits sharded is also saved
sharded.

``fsdp/sharding.json`` records how the state was sharded (processes, FSDP version, the mesh). A resume
with another sharding is refused, naming the difference: DCP could reshard, but the loop's data position
and random states are per rank and the batch plan (checked first) would change with the world size.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from hf_accum.checkpointing.checkpoint import ResumeMismatchError

FSDP_DIR = "fsdp"
SHARDING_FILE = "sharding.json"


def sharding_of(model: torch.nn.Module, world_size: int) -> dict[str, Any]:
    """How ``model``'s parameters are sharded: what a resume must find unchanged."""
    meshes = {tuple(p.device_mesh.shape) for p in model.parameters() if hasattr(p, "device_mesh")}
    placements = {str(p.placements) for p in model.parameters() if hasattr(p, "placements")}
    return {"fsdp_version": 2, "world_size": world_size, "mesh": sorted(list(m) for m in meshes),
            "placements": sorted(placements)}


def written_with_fsdp(checkpoint: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint, FSDP_DIR, SHARDING_FILE))


def save_fsdp_state(folder: str, model: torch.nn.Module, optimizer: Any, world_size: int, is_main: bool) -> None:
    """Collective: every rank writes its shards of the weights and the optimizer state under ``folder/fsdp``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, _bare(optimizer))
    path = os.path.join(folder, FSDP_DIR)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    if is_main:
        with open(os.path.join(path, SHARDING_FILE), "w") as handle:
            json.dump(sharding_of(model, world_size), handle)


def check_fsdp_resume(checkpoint: str, model: torch.nn.Module | None, world_size: int) -> None:
    """Refuse a checkpoint whose sharding differs from this run's (FSDP vs not, processes, mesh, placements)."""
    written = written_with_fsdp(checkpoint)
    if model is None or not written:
        if written:
            raise ResumeMismatchError(f"cannot resume from {checkpoint} without FSDP: its weights and optimizer "
                                      "state are FSDP2 shards -- resume with training.fsdp and the same launcher")
        if model is not None:
            raise ResumeMismatchError(f"cannot resume from {checkpoint} under FSDP: it was written without FSDP "
                                      "-- resume it without training.fsdp")
        return
    with open(os.path.join(checkpoint, FSDP_DIR, SHARDING_FILE)) as handle:
        saved = json.load(handle)
    current = sharding_of(model, world_size)
    changed = [f"{key} {saved.get(key)} -> {value}" for key, value in current.items() if saved.get(key) != value]
    if changed:
        raise ResumeMismatchError(f"cannot resume from {checkpoint}: its FSDP sharding differs from this run's "
                                  f"({'; '.join(changed)}); resume with the launcher and world size that wrote it")


def load_fsdp_state(checkpoint: str, model: torch.nn.Module, optimizer: Any) -> None:
    """Collective: every rank reads its shards back into the sharded model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, _bare(optimizer))
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, FSDP_DIR))
    set_state_dict(model, _bare(optimizer), model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def is_fsdp_model(model: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def _bare(optimizer: Any) -> torch.optim.Optimizer:
    """Accelerate's ``AcceleratedOptimizer`` wraps the torch optimizer DCP needs."""
    return getattr(optimizer, "optimizer", optimizer)
