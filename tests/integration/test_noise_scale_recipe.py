"""The recipe with ``accumulation.noise_scale=true``: metrics.json carries a finite positive noise scale for most
updates after the first few, in both engines, and the end-of-run line; bad values fail before any work."""

from __future__ import annotations

import json
import math

import pytest

from hf_accum.recipe.testing import SMALL, fails_cleanly, load_script, read_metrics


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_recipe_writes_the_noise_scale(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / engine
    load_script().main([*SMALL, f"training.output_dir={out}", f"engine={engine}", "training.max_steps=12",
                        "accumulation.noise_scale=true", "data.num_eval_examples=2"])
    metrics = read_metrics(out)
    later = [u["noise_scale"] for u in metrics["updates"][4:]]
    good = [s for s in later if s is not None and math.isfinite(s) and s > 0]
    assert len(later) == 8 and len(good) >= 6, later
    assert all(u["grad_sq"] is not None and u["trace_cov"] is not None for u in metrics["updates"])
    assert "the measured noise scale is ~" in metrics["noise_scale_advice"]
    json.dumps(metrics)  # plain JSON: no NaN objects


def test_noise_scale_must_be_a_bool(tmp_path, capsys):
    err = fails_cleanly(["accumulation.noise_scale=maybe"], tmp_path / "out", capsys)
    assert "accumulation.noise_scale" in err.strip().splitlines()[-1]


def test_noise_scale_is_refused_under_deepspeed(tmp_path, capsys):
    err = fails_cleanly(["accumulation.noise_scale=true", "training.deepspeed=recipes/deepspeed/zero3.json"],
                        tmp_path / "out", capsys)
    assert "accumulation.noise_scale=true is not available with training.deepspeed" in err.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_recipe_trains_with_sequence_normalization(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / engine
    load_script().main([*SMALL, f"training.output_dir={out}", f"engine={engine}", "training.max_steps=2",
                        "accumulation.normalization=sequence", "data.num_eval_examples=2"])
    updates = read_metrics(out)["updates"]
    # The count an update is normalized by is now its sequences with a target: 32 per update here.
    assert [u["targets"] for u in updates] == [32, 32]
    assert all(math.isfinite(u["loss"]) for u in updates)


def test_normalization_must_be_token_or_sequence(tmp_path, capsys):
    err = fails_cleanly(["accumulation.normalization=row"], tmp_path / "out", capsys)
    assert "accumulation.normalization='row'; allowed: 'token', 'sequence'" in err.strip().splitlines()[-1]
