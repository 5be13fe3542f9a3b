"""The recipe script itself under FSDP2 (``training.fsdp=full_shard``), 2 CPU processes (torchrun, gloo), both
engines -- on CPU through the forced path (:func:`hf_accum.fsdp.fsdp_accelerator`, ``AccumTrainer``'s
``create_accelerator_and_postprocess``), where Accelerate alone would train DDP:

* the adapter equals the adapter of the same command on ONE process (the big batch itself: the same global
  batch, so the same rows in each update), fp32, 10 updates, max abs diff <= 1e-4, and every update's loss, LR
  and target count equal that run's; the start line names FSDP2;
* the held-out exact match is scored after training on the sharded model, as the one-process run scores it (the
  runs do not score the held-out loss during training: the loop's waits forever on uneven shards under FSDP2);
* a run cut after its checkpoint at update 5 (what a kill -9 right after it leaves: no metrics, no adapter, no
  later checkpoint) and resumed with ``training.resume_from_checkpoint=true`` ends with the uninterrupted run's
  updates and adapter; the loop's checkpoints hold ``torch.distributed.checkpoint`` shards, one per rank;
* FSDP on 1 process or FSDP1 stops before any model loads, saying why (fast tests).

The one-process references run in the pytest process (``run_main``, conftest.py), shared with the DeepSpeed
recipe tests: a launch of their own would cost a start-up for numbers that do not depend on it.

Library-level exactness under FSDP2 (SGD weight deltas against the big batch): tests/distributed/test_fsdp.py (loop) and
tests/distributed/test_trainer_fsdp.py (AccumTrainer)."""

from __future__ import annotations

import os

import pytest

from hf_accum.recipe.launch import LaunchError, check_launch
from hf_accum.recipe.testing import (
    TORCHRUN_2,
    cut_after_checkpoint,
    held_out_losses,
    load_adapter,
    max_abs_diff,
    read_metrics,
    run_script,
)
from hf_accum.testing.cases.recipe_runs_case import engine_run, held_out_rows

FSDP = "training.fsdp=full_shard"
# The one-process reference's command (conftest.py) with FSDP: the loop's also scores 7 held-out rows (uneven
# shards: 2 batches on rank 0, 1 on rank 1) at updates 5 and 10.
FSDP_RUN = {engine: [*engine_run(engine), FSDP] for engine in ("loop", "trainer")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_recipe_run):
    """engine -> {"reference": dir, "fsdp": dir, "fsdp_stdout": str}, made on first use (each FSDP run ~30 s; the
    one-process reference is shared with the DeepSpeed recipe tests, see conftest.py)."""
    made: dict[str, dict] = {}

    def get(engine: str) -> dict:
        if engine not in made:
            root = tmp_path_factory.mktemp(engine)
            made[engine] = {"reference": reference_recipe_run(engine), "fsdp": root / "fsdp"}
            proc = run_script(TORCHRUN_2, made[engine]["fsdp"], *FSDP_RUN[engine], timeout=600)
            made[engine]["fsdp_stdout"] = proc.stdout + proc.stderr
        return made[engine]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_fsdp_recipe_saves_the_adapter_of_the_one_process_run(runs, engine):
    one_process, fsdp = runs(engine)["reference"], runs(engine)["fsdp"]
    assert "x 2 processes, FSDP2 full_shard" in runs(engine)["fsdp_stdout"]
    reference = load_adapter(one_process)
    assert max_abs_diff(load_adapter(fsdp), reference) <= 1e-4  # measured 1.1e-6 (loop), 3.5e-7 (trainer)
    # The comparison can fail: training moved the adapter 10x beyond the tolerance (LoRA B starts at 0).
    assert max(float(reference[key].abs().max()) for key in reference if "lora_B" in key) > 1e-3
    ours, theirs = read_metrics(fsdp), read_metrics(one_process)
    assert (ours["world_size"], theirs["world_size"]) == (2, 1)
    assert [u["step"] for u in ours["updates"]] == list(range(1, 11))
    for mine, other in zip(ours["updates"], theirs["updates"]):
        assert mine["loss"] == pytest.approx(other["loss"], rel=1e-5)
        assert mine["learning_rate"] == pytest.approx(other["learning_rate"], rel=1e-12, abs=1e-15)
        assert mine["targets"] == other["targets"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_fsdp_recipe_scores_the_held_out_set_after_training(runs, engine):
    metrics = read_metrics(runs(engine)["fsdp"])
    assert metrics["eval_after"] is not None and metrics["eval_after"]["examples"] == held_out_rows(engine)
    reference = read_metrics(runs(engine)["reference"])
    assert metrics["eval_after"] == reference["eval_after"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_fsdp_recipe_resumes_exactly_after_a_kill(runs, engine, tmp_path):
    finished = runs(engine)["fsdp"]
    checkpoint = os.path.join(finished, "checkpoint-5")
    if engine == "loop":  # torch.distributed.checkpoint: one shard file per rank, and how it was sharded
        assert sorted(os.listdir(os.path.join(checkpoint, "fsdp"))) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "sharding.json"]
    cut = tmp_path / "cut"
    cut_after_checkpoint(finished, cut, 5)
    proc = run_script(TORCHRUN_2, cut, *FSDP_RUN[engine], "training.resume_from_checkpoint=true", timeout=600)
    assert "checkpoint-5" in proc.stdout + proc.stderr
    resumed, uninterrupted = read_metrics(cut)["updates"], read_metrics(finished)["updates"]
    assert [u["step"] for u in resumed] == list(range(1, 11))  # the updates before the checkpoint included
    for mine, other in zip(resumed, uninterrupted):
        assert mine["loss"] == pytest.approx(other["loss"], rel=1e-9, abs=0)
        assert mine["learning_rate"] == other["learning_rate"]
    assert max_abs_diff(load_adapter(cut), load_adapter(finished)) <= 1e-6


def test_fsdp_on_one_process_is_refused_not_run_as_plain_training():
    with pytest.raises(LaunchError, match="only 1 process was started"):
        check_launch({"fsdp": "full_shard"}, environ={"WORLD_SIZE": "1"})


def test_fsdp1_is_refused_naming_the_key():
    with pytest.raises(LaunchError, match="allowed: 2 .training.fsdp_config.version=2"):
        check_launch({"fsdp": "full_shard", "fsdp_config": {"version": 1}}, environ={"WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match="FSDP version 1"):
        check_launch({}, environ={"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})


def test_fsdp_on_two_cpu_processes_is_accepted():
    launch = check_launch({"fsdp": "full_shard", "use_cpu": True}, environ={"WORLD_SIZE": "2"})
    assert (launch.backend, launch.world_size) == ("fsdp", 2)


@pytest.mark.slow
def test_loop_held_out_loss_under_fsdp2_with_uneven_shards(runs):
    """Held-out loss during training under FSDP2 (updates 5 and 10): 7 rows in batches of 3, two batches on rank
    0 and one on rank 1. Each forward gathers the sharded parameters from both ranks, so rank 1 runs a forward more
    that counts nothing (before 2026-11-28 it did so under ZeRO-3 only, and this run waited forever); the losses
    equal the one-process run's (an extra forward counted, or a mean of the ranks' means, would differ)."""
    measured, expected = (held_out_losses(runs("loop")[run]) for run in ("fsdp", "reference"))
    assert sorted(measured) == sorted(expected) == [5, 10]
    assert [measured[step] for step in (5, 10)] == pytest.approx([expected[step] for step in (5, 10)], rel=1e-5)
