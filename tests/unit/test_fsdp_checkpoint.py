"""hf_accum.checkpointing.fsdp_checkpoint: a loop checkpoint of an FSDP2 model resumes only with the same sharding (FSDP or
not, processes, device mesh, placements); the refusal names the difference. The sharded save and the exact
resume themselves run in tests/distributed/test_fsdp_recipe.py (2 processes)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from hf_accum.checkpointing.checkpoint import ResumeMismatchError
from hf_accum.checkpointing.fsdp_checkpoint import FSDP_DIR, SHARDING_FILE, check_fsdp_resume, sharding_of


def sharded_model(processes: int) -> torch.nn.Module:
    """A module whose parameter carries what a DTensor shard says about its sharding."""
    model = torch.nn.Linear(2, 2, bias=False)
    model.weight.device_mesh = SimpleNamespace(shape=(processes,))
    model.weight.placements = ("Shard(dim=0)",)
    return model


def write_sharding(checkpoint, processes: int) -> str:
    os.makedirs(os.path.join(checkpoint, FSDP_DIR))
    with open(os.path.join(checkpoint, FSDP_DIR, SHARDING_FILE), "w") as handle:
        json.dump(sharding_of(sharded_model(processes), processes), handle)
    return str(checkpoint)


def test_the_same_sharding_resumes(tmp_path):
    check_fsdp_resume(write_sharding(tmp_path / "c", 2), sharded_model(2), world_size=2)


def test_another_world_size_is_refused_naming_it(tmp_path):
    with pytest.raises(ResumeMismatchError, match=r"world_size 2 -> 4; mesh \[\[2\]\] -> \[\[4\]\]"):
        check_fsdp_resume(write_sharding(tmp_path / "c", 2), sharded_model(4), world_size=4)


def test_fsdp_shards_without_fsdp_are_refused(tmp_path):
    with pytest.raises(ResumeMismatchError, match="without FSDP: its weights and optimizer state are FSDP2 shards"):
        check_fsdp_resume(write_sharding(tmp_path / "c", 2), None, world_size=2)


def test_a_checkpoint_without_fsdp_is_refused_under_fsdp(tmp_path):
    os.makedirs(tmp_path / "c")
    with pytest.raises(ResumeMismatchError, match="under FSDP: it was written without FSDP"):
        check_fsdp_resume(str(tmp_path / "c"), sharded_model(2), world_size=2)
    check_fsdp_resume(str(tmp_path / "c"), None, world_size=2)  # neither: nothing to check
