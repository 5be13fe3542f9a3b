"""The recipe's ``accumulation:`` section: ramp-up and token budgets train the default job in the loop engine;
the trainer engine, a budget next to a global batch of the same layer, and an off-grid ramp exit 2."""

from __future__ import annotations

import math

import pytest

from hf_accum.recipe.testing import fails_cleanly, read_metrics, recipe_arguments, run_main, write
from hf_accum.testing import big_batch_learning_rates


def succeeded(proc):
    """A run in the pytest process (nothing kills it: a process of its own would show nothing more) that ended 0."""
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    return proc


def megatron_global_batch(consumed: int, start: int, increment: int, samples: int, global_batch: int) -> int:
    """Independent transcription of Megatron-LM's RampupBatchsizeNumMicroBatches.update."""
    if consumed > samples:
        return global_batch
    return start + int(consumed / (samples / ((global_batch - start) // increment))) * increment


# [start, increment, samples]: 8 -> 16 -> 24 -> 32 sequences every 320 / 3 samples, reached in the second of the
# default's 3 epochs of the suite's 240 rows (720 samples: every stage, and a short last window in each epoch).
RAMP = (8, 8, 320)


def _expected_ramp(examples: int, epochs: int) -> list[int]:
    sizes, consumed = [], 0
    for _ in range(epochs):
        left = examples
        while left:
            size = min(megatron_global_batch(consumed, *RAMP, 32), left)
            sizes.append(size)
            left -= size
            consumed += size
    return sizes


@pytest.mark.slow
def test_rampup_trains_the_default_job_8_16_24_then_32(tmp_path):
    out = tmp_path / "ramp"
    proc = succeeded(run_main(*recipe_arguments(out, "data.num_train_examples=240",
                                                f"accumulation.rampup_batch_size=[{','.join(map(str, RAMP))}]")))
    updates = read_metrics(out)["updates"]
    sequences = [u["sequences"] for u in updates]
    assert sequences == _expected_ramp(240, 3)
    assert [s for i, s in enumerate(sequences) if i == 0 or s != sequences[i - 1]][:4] == [8, 16, 24, 32]
    assert "batch ramp-up [8, 8, 320]: 8 seqs x 14 updates -> 16 seqs x 8 updates -> 24 seqs x" in proc.stderr
    # The LR ends where the schedule ends: cosine over exactly the ramped run's updates.
    lrs = [u["learning_rate"] for u in updates]
    total = len(updates)
    expected = big_batch_learning_rates(2e-3, total, warmup=math.ceil(0.05 * total), name="cosine")
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-15)


@pytest.mark.slow
def test_token_budget_trains_the_default_job(tmp_path):
    out = tmp_path / "tokens"
    # Answers only are targets (at most 11 per row, ~4 on average): 1200 rows hold twice the 4 budgets of 512 (each
    # ~17 micro-batches of 8 rows: 4x the default's 32-row update, every window's size decided by the budget).
    proc = succeeded(run_main(*recipe_arguments(out, "data.num_train_examples=1200", "training.max_steps=4",
                                                "accumulation.tokens_per_update=512")))
    updates = read_metrics(out)["updates"]
    assert len(updates) == 4
    assert all(512 <= u["targets"] < 512 + 8 * 11 for u in updates)  # < the budget plus one micro-batch
    assert all(u["applied"] for u in updates)
    assert "accumulation.tokens_per_update=512 replaces global_batch_size" in proc.stdout + proc.stderr
    assert "token budget 512 targets/update" in proc.stderr


def test_trainer_engine_refuses_and_names_the_loop_engine(tmp_path, capsys):
    err = fails_cleanly(["engine=trainer", "accumulation.tokens_per_update=2048"], tmp_path / "out", capsys)
    assert "needs the loop engine (engine=loop" in err.strip().splitlines()[-1]
    err = fails_cleanly(["engine=trainer", "accumulation.rampup_batch_size=[8,8,800]"], tmp_path / "out", capsys)
    assert "accumulation.rampup_batch_size" in err and "engine=loop" in err


def test_budget_and_global_batch_in_one_layer_conflict(tmp_path, capsys):
    path = write(tmp_path / "c.yaml", "global_batch_size: 32\naccumulation: {tokens_per_update: 2048}\n")
    err = fails_cleanly(["--config", path], tmp_path / "out", capsys)
    assert "both size the update; set only one of them" in err and path in err


def test_off_grid_ramp_names_the_nearest_values(tmp_path, capsys):
    err = fails_cleanly(["accumulation.rampup_batch_size=[4,8,800]"], tmp_path / "out", capsys)
    assert "nearest valid start: 8" in err


def test_plan_prints_the_ramp_of_a_recipe_config(tmp_path, capsys):
    from hf_accum.cli import main

    path = write(tmp_path / "ramp.yaml", "global_batch_size: 32\naccumulation: {rampup_batch_size: [8, 8, 800]}\n")
    assert main(["plan", "--config", path]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "batch ramp-up [8, 8, 800]: 8 seqs x 34 updates -> 16 seqs x 17 updates -> 24 seqs x 11 updates -> "
        "32 seqs x 1 update")
