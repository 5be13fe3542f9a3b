"""SFT -> DPO as two recipe commands: ``objective=dpo model.adapter=<the SFT run>`` trains from the SFT run's adapter.

One short SFT run of the embedded default is shared by the module. The DPO run must start where the SFT run ended,
not from the base model: its held-out pairwise margin BEFORE training (scored by the DPO run on the model it loaded)
equals the margin of the SFT run's own saved model (base + SFT adapter,
loaded here as ``hf-accum generate`` loads it), and differs from the base model's (the control). In-process, the
adapter the recipe's model loader builds holds exactly the SFT run's saved weights (a fresh adapter does not).
The refusals are unit-tested in tests/unit/test_adapter_source.py; one runs here through the script (exit 2,
nothing written). Every run here is the script's ``main`` in the pytest process (``run_main``: the exit code and
what it printed, as a process would end): nothing kills them, so processes of their own would show nothing more.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from hf_accum.recipe import checks
from hf_accum.recipe import config as recipe_config
from hf_accum.recipe.testing import (
    fails_cleanly,
    load_adapter,
    max_abs_diff,
    read_metrics,
    recipe_arguments,
    run_main,
)

ENGINES = ("loop", "trainer")
OBJECTIVES = ("sft", "dpo")
SFT = ("training.max_steps=4",)
DPO = ("objective=dpo", "data.num_train_examples=64", "data.num_eval_examples=16", "training.max_steps=2",
       "training.per_device_train_batch_size=4", "global_batch_size=8", "training.logging_steps=1",
       "dpo.sft_weight=0")  # the DPO term alone: at the start, policy = reference, so the loss is log 2


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("from_run") / "sft"
    proc = run_main(*recipe_arguments(out, *SFT))  # SMALL: a short run of the embedded default
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def held_out_margin(model, config) -> float:
    """The held-out pairwise margin of ``model`` on the DPO run's held-out pairs, as the recipe scores it."""
    from hf_accum.recipe.data.preference import load_preference_data
    from hf_accum.recipe.reference import pairwise_accuracy

    tokenizer, data = load_preference_data(config.model, config.data)
    batch = int(config.training.per_device_eval_batch_size)
    return float(pairwise_accuracy(model, data.held_out, tokenizer.pad_token_id, batch)["mean_margin"])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_a_dpo_run_from_the_sft_run_starts_from_its_final_state(sft_run, tmp_path, engine):
    from hf_accum.recipe.generate import load_trained

    out = tmp_path / "dpo"
    proc = run_main(*recipe_arguments(out, *DPO, f"model.adapter={sft_run}", f"engine={engine}"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"adapter from {sft_run / 'adapter'}" in proc.stdout
    metrics = read_metrics(out)
    assert metrics["started_from"] == {"adapter": str(sft_run / "adapter"), "run": str(sft_run),
                                       "base_model": "hf_accum:tiny-llama", "base_seed": 0}
    assert len(metrics["updates"]) == 2
    # The reference is the starting policy (the SFT adapter on), so the first update's DPO loss is log 2; a base-model
    # reference would give another value (the SFT and base margins below differ by ~0.1 nats).
    assert abs(metrics["updates"][0]["loss"] - math.log(2)) < 1e-6, metrics["updates"][0]["loss"]
    if engine == "loop":
        assert "pairs scored by the starting model (the loaded adapter on)" in proc.stdout
    config = recipe_config.build_config(recipe_config.load_yaml(str(out / recipe_config.RESOLVED_CONFIG_NAME)))
    assert config.model.adapter == str(sft_run)

    sft_model, _, _ = load_trained(str(sft_run))  # the SFT run's final state
    with torch.no_grad():
        sft_margin = held_out_margin(sft_model, config)
        with sft_model.disable_adapter():
            base_margin = held_out_margin(sft_model, config)
    dpo_start = metrics["eval_before"]["mean_margin"]
    print(f"held-out margin: DPO run before training {dpo_start:.6f}, SFT run's final model {sft_margin:.6f}, "
          f"base model {base_margin:.6f}")
    assert abs(dpo_start - sft_margin) < 1e-6
    assert abs(dpo_start - base_margin) > 1e-3  # the control: not the base model's


def test_the_loaded_adapter_holds_the_sft_runs_saved_weights(sft_run, tmp_path):
    from peft import get_peft_model_state_dict

    from hf_accum.recipe.modeling import build_model, load_tokenizer

    saved = load_adapter(sft_run)

    def adapter_weights(*argv):
        config = checks.load_recipe_config([*DPO, f"training.output_dir={tmp_path / 'o'}", *argv], ENGINES, OBJECTIVES)
        model = build_model(config, load_tokenizer(config.model.name_or_path), seed=int(config.training.seed))
        assert any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # trainable
        return get_peft_model_state_dict(model)

    assert max_abs_diff(adapter_weights(f"model.adapter={sft_run}"), saved) == 0.0
    fresh = adapter_weights()
    assert fresh.keys() == saved.keys() and max_abs_diff(fresh, saved) > 1e-3  # the control: a fresh adapter


def test_an_adapter_for_another_random_base_fails_before_anything_loads(sft_run, tmp_path, capsys):
    err = fails_cleanly([f"model.adapter={sft_run}", "training.seed=5"], tmp_path / "out", capsys)
    line = err.strip().splitlines()[-1]
    assert "model.adapter=" in line and "training.seed=0" in line and "training.seed=5" in line, line
    assert os.listdir(sft_run)  # the source run is left as it was
