"""The recipe's resume policy (hf_accum.recipe.resume): which checkpoint a run continues from, and whether it may."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from hf_accum.checkpointing.checkpoint import PLAN_FILE, STAGING_PREFIX, ResumeMismatchError, save_batch_plan
from hf_accum.checkpointing.manifest import write_manifest
from hf_accum.planning.schedule import BatchPlan
from hf_accum.recipe.config import ConfigError
from hf_accum.recipe.resume import check_resume_fits, resume_checkpoint

PLAN = BatchPlan(2, 4, 1)


def checkpoint(out, update, damaged=False):
    """A complete checkpoint-<update> of ``out`` with a manifest (``damaged``: a byte changed afterwards)."""
    folder = out / f"checkpoint-{update}"
    folder.mkdir(parents=True)
    (folder / "optimizer.pt").write_bytes(bytes(range(100)))
    save_batch_plan(str(folder), PLAN)
    write_manifest(str(folder))
    if damaged:
        (folder / "optimizer.pt").write_bytes(bytes(range(1, 101)))
    return str(folder)


def test_true_resumes_the_newest_checkpoint_that_verifies_naming_the_damaged_ones(tmp_path, capsys):
    out = tmp_path / "run"
    checkpoint(out, 2)
    good = checkpoint(out, 4)
    bad = checkpoint(out, 6, damaged=True)
    assert resume_checkpoint(True, str(out), "resume") == good
    assert f"warning: skipping {bad}: optimizer.pt differs" in capsys.readouterr().out


def test_true_with_no_checkpoint_yet_starts_afresh_and_removes_unfinished_writes(tmp_path, capsys):
    out = tmp_path / "run"
    (out / f"{STAGING_PREFIX}checkpoint-2" / "checkpoint-2").mkdir(parents=True)
    assert resume_checkpoint(True, str(out), "resume") is None
    assert os.listdir(out) == []
    assert capsys.readouterr().out.strip() == ("note: training.resume_from_checkpoint=true but no checkpoint exists "
                                               "yet (removed 1 unfinished checkpoint write(s)): starting from scratch")


def test_true_on_a_fresh_directory_is_a_fresh_start(tmp_path):
    assert resume_checkpoint(True, str(tmp_path / "new"), "fresh") is None


def test_true_where_every_checkpoint_is_damaged_is_refused(tmp_path):
    out = tmp_path / "run"
    checkpoint(out, 2, damaged=True)
    with pytest.raises(ConfigError, match=r"training.resume_from_checkpoint: .*no checkpoint in .* verifies"):
        resume_checkpoint(True, str(out), "resume")


def test_a_named_checkpoint_is_used_or_refused(tmp_path):
    out = tmp_path / "run"
    good = checkpoint(out, 2)
    bad = checkpoint(out, 4, damaged=True)
    assert resume_checkpoint(good, str(out), "resume") == good
    with pytest.raises(ConfigError, match=rf"resume_from_checkpoint: checkpoint {bad} is damaged: .*from {good} instead"):
        resume_checkpoint(bad, str(out), "resume")
    os.remove(os.path.join(good, PLAN_FILE))
    with pytest.raises(ConfigError, match=r"training.resume_from_checkpoint: .* is incomplete"):
        resume_checkpoint(good, str(out), "resume")


def test_unset_is_a_fresh_start_whatever_the_directory_holds(tmp_path):
    out = tmp_path / "run"
    checkpoint(out, 2)
    assert resume_checkpoint(None, str(out), "fresh") is None
    assert resume_checkpoint(False, str(out), "fresh") is None


def arguments(micro_batch=2, accumulation=4, world_size=1, auto=False):
    return SimpleNamespace(per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
                           world_size=world_size, auto_find_batch_size=auto)


def test_a_checkpoint_must_fit_the_runs_batch_arithmetic_and_engine(tmp_path, capsys):
    good = checkpoint(tmp_path / "run", 2)
    check_resume_fits(good, arguments(), deepspeed=False)
    assert capsys.readouterr().out.strip() == f"resuming from {good}"
    with pytest.raises(ResumeMismatchError, match="gradient_accumulation_steps 4 -> 8"):
        check_resume_fits(good, arguments(accumulation=8), deepspeed=False)
    check_resume_fits(good, arguments(micro_batch=4, accumulation=2, auto=True), deepspeed=False)  # same global batch
    with pytest.raises(ResumeMismatchError, match="under DeepSpeed"):
        check_resume_fits(good, arguments(), deepspeed=True)
    check_resume_fits(None, arguments(accumulation=8), deepspeed=True)  # a fresh start: nothing to fit
