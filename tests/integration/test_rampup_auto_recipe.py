"""``accumulation.rampup_batch_size=auto`` in the recipe: the default job trains with it (start line, every change
with its reason in the log and in metrics.json, the plot), ``hf-accum plan`` says what the controller will do, and
what it cannot run exits 2 before anything loads."""

from __future__ import annotations

import os

import pytest

from hf_accum.cli import main as cli_main
from hf_accum.recipe import outputs as run_outputs
from hf_accum.recipe.testing import fails_cleanly, read_metrics, recipe_arguments, run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT = os.path.join(ROOT, "recipes", "configs", "cpu_default.yaml")
EAGER = "accumulation.rampup_auto={margin: 0.5, release: 0.25, min_updates: 3, lr_rule: seesaw}"


@pytest.mark.slow
def test_auto_ramp_trains_the_default_job_and_records_every_change(tmp_path):
    out = tmp_path / "auto"
    # In the pytest process: nothing kills the run, so a process of its own would show nothing more.
    proc = run_main(*recipe_arguments(out, "data.num_train_examples=480", "training.num_train_epochs=1",
                                      "accumulation.rampup_batch_size=auto", EAGER))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "auto batch ramp: 16 -> at most 32 sequences per update" in said  # the start line
    assert "LR schedule over 480 samples" in said
    updates = read_metrics(out)["updates"]
    sequences = [u["sequences"] for u in updates]
    assert sequences[0] == 16 and 32 in sequences and sum(sequences) == 480
    changes = [u for u in updates if u["batch_change"]]
    assert changes and "threshold" in changes[0]["batch_change"] and changes[0]["batch_change"] in said
    assert all(u["noise_scale"] is not None for u in updates[5:])  # tracked: the controller's measurement
    assert os.path.getsize(out / run_outputs.PLOT_NAME) > 0


def test_plan_says_what_the_controller_will_do(capsys):
    code = cli_main(["plan", "--config", DEFAULT, "accumulation.rampup_batch_size=auto",
                     "accumulation.rampup_auto={lr_rule: sqrt}", "--train-examples", "5000", "--epochs", "3"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "auto batch ramp: 16 -> at most 32 sequences per update (K 2..4 x 8 sequences per round)" in printed
    assert "LR rule sqrt" in printed
    assert "LR schedule over 15000 samples (3 epochs of 5000), between 469 and 938 updates" in printed


@pytest.mark.parametrize("argv, message", [
    (["training.max_steps=5"], "accumulation.rampup_batch_size=auto with training.max_steps=5"),
    (["training.warmup_steps=5"], "accumulation.rampup_batch_size=auto with training.warmup_steps=5"),
    (["engine=trainer"], "accumulation.rampup_batch_size='auto' needs the loop engine"),
    (["accumulation.rampup_auto={lr_rule: cosine}"], "accumulation.rampup_auto.lr_rule='cosine'; allowed: constant"),
    (["accumulation.rampup_auto={min_batch_size: 12}"], "accumulation.rampup_auto.min_batch_size=12 must be a multiple"),
])
def test_what_the_auto_ramp_cannot_run_exits_2_before_loading(tmp_path, capsys, argv, message):
    err = fails_cleanly(["accumulation.rampup_batch_size=auto", *argv], tmp_path / "out", capsys)
    assert message in err
