"""``model.adapter`` in the config validator (no process, no model): what it finds, what it refuses (one line naming
``model.adapter`` and both sides), and the lora section taking the adapter's own settings. The end-to-end SFT -> DPO
run is in tests/integration/test_recipe_from_run.py."""

from __future__ import annotations

import json

import pytest
import yaml

from hf_accum.errors import InputError
from hf_accum.recipe import checks
from hf_accum.recipe import config as recipe_config
from hf_accum.recipe.adapter_source import check_adapter, find_adapter, provenance
from hf_accum.recipe.command_line import parse_overrides

ENGINES = ("loop", "trainer")
OBJECTIVES = ("sft", "dpo")
TINY = "hf_accum:tiny-llama"
ADAPTER = {"base_model_name_or_path": None, "peft_type": "LORA", "r": 32, "lora_alpha": 64, "lora_dropout": 0.0,
           "target_modules": ["v_proj", "up_proj", "k_proj", "down_proj", "q_proj", "o_proj", "gate_proj"],
           "modules_to_save": ["embed_tokens", "lm_head"], "bias": "none", "use_rslora": False, "use_dora": False}


def fake_run(path, adapter=None, model=None, seed=0, with_adapter=True):
    """A finished run's directory as the recipe writes it: resolved_config.yaml and adapter/adapter_config.json."""
    path.mkdir(parents=True)
    saved = {"model": {"name_or_path": TINY, "config_overrides": {}, **(model or {})}, "training": {"seed": seed}}
    (path / "resolved_config.yaml").write_text(yaml.safe_dump(saved))
    if with_adapter:
        (path / "adapter").mkdir()
        (path / "adapter" / "adapter_config.json").write_text(json.dumps({**ADAPTER, **(adapter or {})}))
    return path


def resolved(tmp_path, *argv):
    _, overrides = parse_overrides([*argv, f"training.output_dir={tmp_path / 'out'}"])  # as the command line
    return checks.resolve(recipe_config.load_config(None, overrides), ENGINES, OBJECTIVES, world_size=1)


def refusal(tmp_path, *argv) -> str:
    with pytest.raises(InputError) as caught:
        resolved(tmp_path, *argv)
    message = str(caught.value)
    assert "\n" not in message and "model.adapter=" in message, message
    return message


def test_a_run_dir_or_its_adapter_dir_is_found_and_recorded(tmp_path):
    run = fake_run(tmp_path / "sft")
    for given in (run, run / "adapter"):
        source = find_adapter(str(given))
        assert source.adapter_dir == str(run / "adapter") and source.run_dir == str(run)
        assert source.base_model == TINY and source.run_seed == 0
    config = resolved(tmp_path, f"model.adapter={run}", "training.seed=0")
    assert provenance(config) == {"adapter": str(run / "adapter"), "run": str(run), "base_model": TINY,
                                  "base_seed": 0}
    assert "adapter: " + str(run) in config.to_yaml()  # the resolved config names where the run started
    assert provenance(resolved(tmp_path, "training.seed=0")) is None


def test_the_lora_section_takes_the_adapters_settings_and_a_note_says_so(tmp_path):
    run = fake_run(tmp_path / "sft", adapter={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    config = resolved(tmp_path, f"model.adapter={run}", "training.seed=0")  # the embedded default YAML says r=32
    assert config.lora["r"] == 8 and config.lora["lora_alpha"] == 16
    assert sorted(config.lora["target_modules"]) == ["q_proj", "v_proj"]
    assert any("lora.r=8" in note and "adapter_config.json" in note for note in config.notes), config.notes


def test_a_command_line_lora_setting_that_contradicts_the_adapter_is_refused(tmp_path):
    run = fake_run(tmp_path / "sft")
    message = refusal(tmp_path, f"model.adapter={run}", "training.seed=0", "lora.r=4")
    assert "lora.r=4" in message and "r=32" in message
    resolved(tmp_path, f"model.adapter={run}", "training.seed=0", "lora.r=32")  # the same value: accepted


@pytest.mark.parametrize("setup, message", [
    ("missing", "no such directory"),
    ("empty", "neither a recipe run's output directory nor an adapter directory"),
    ("unfinished", "no adapter/ yet"),
    ("full_model", "trained the full model"),
])
def test_a_path_without_an_adapter_is_refused(tmp_path, setup, message):
    path = tmp_path / "source"
    if setup == "empty":
        path.mkdir()
    elif setup == "unfinished":
        fake_run(path, with_adapter=False)
    elif setup == "full_model":
        fake_run(path, with_adapter=False)
        (path / "model").mkdir()
    assert message in refusal(tmp_path, f"model.adapter={path}")


def test_an_adapter_of_another_base_model_is_refused_naming_both(tmp_path):
    run = fake_run(tmp_path / "sft", model={"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    message = refusal(tmp_path, f"model.adapter={run}", "training.seed=0")
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct'" in message and f"model.name_or_path='{TINY}'" in message
    bare = tmp_path / "bare_adapter"  # an adapter directory outside a run: its own base_model_name_or_path
    bare.mkdir()
    (bare / "adapter_config.json").write_text(json.dumps({**ADAPTER, "base_model_name_or_path": "gpt2"}))
    assert "'gpt2'" in refusal(tmp_path, f"model.adapter={bare}")


def test_the_embedded_models_adapter_needs_the_same_seed_and_overrides(tmp_path):
    run = fake_run(tmp_path / "sft", seed=7)
    message = refusal(tmp_path, f"model.adapter={run}", "training.seed=0")
    assert "training.seed=7" in message and "training.seed=0" in message
    resolved(tmp_path, f"model.adapter={run}", "training.seed=7")  # the same random base: accepted
    bare = tmp_path / "bare_adapter"  # without its run, nothing tells which random base it was trained on
    bare.mkdir()
    (bare / "adapter_config.json").write_text(json.dumps(ADAPTER))
    assert "give the run directory" in refusal(tmp_path, f"model.adapter={bare}")


def test_an_adapter_with_lora_off_is_refused(tmp_path):
    run = fake_run(tmp_path / "sft")
    assert "lora is null" in refusal(tmp_path, f"model.adapter={run}", "training.seed=0", "lora=null")


def test_dpo_from_an_adapter_on_several_processes_is_accepted_in_both_engines(tmp_path, monkeypatch):
    """The trainer engine's reference (the starting adapter) is precomputed on every process now (AccumDPOTrainer
    keeps it in memory; it was refused while TRL's cache-file hand-off failed on rank 1). The check itself runs here
    under WORLD_SIZE=2 (resolving all of the config would start a process group); the 2-process run is in
    tests/distributed/test_recipe_dpo_ddp.py."""
    run = fake_run(tmp_path / "sft")
    argv = (f"model.adapter={run}", "training.seed=0", "objective=dpo")
    trainer, loop = resolved(tmp_path, *argv, "engine=trainer"), resolved(tmp_path, *argv, "engine=loop")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for config in (trainer, loop):
        assert check_adapter(config) is not None
