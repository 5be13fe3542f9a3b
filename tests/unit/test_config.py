"""Recipe config: typing, precedence (defaults < YAML < command line), validation, saved copy,
and loading every YAML under recipes/ (configs and Accelerate launcher configs)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

import pytest
import torch
import yaml

from hf_accum.checkpointing.checkpoint import write_text_atomically
from hf_accum.errors import InputError
from hf_accum.recipe import checks
from hf_accum.recipe import config as recipe_config
from hf_accum.recipe import outputs as run_outputs

ENGINES = ("loop", "trainer")  # the recipe's engine table (recipes/finetune_llama.py ENGINES)
OBJECTIVES = ("sft", "dpo", "grpo")  # its objective table (recipes/finetune_llama.py OBJECTIVES)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "recipes", "configs", "*.yaml")))
LAUNCHERS = sorted(glob.glob(os.path.join(ROOT, "recipes", "accelerate", "*.yaml")))


def write_yaml(tmp_path, data, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def resolved(argv, world_size=1, tmp_path=None):
    path, overrides = recipe_config.parse_overrides(argv)
    config = recipe_config.load_config(path, overrides)
    if tmp_path is not None:
        config.training.setdefault("output_dir", str(tmp_path / "out"))
    return checks.resolve(config, ENGINES, OBJECTIVES, world_size=world_size)


# -- overrides and precedence ------------------------------------------------------------------


def test_parse_overrides_accepts_all_documented_forms():
    path, overrides = recipe_config.parse_overrides(
        ["--config", "x.yaml", "--training.learning_rate", "1e-4", "--lora.r=16", "training.max_steps=5", "--lora", "null",
         "lora.target_modules=[q_proj, v_proj]"]
    )
    assert path == "x.yaml"
    assert overrides == {
        "training.learning_rate": "1e-4",  # YAML 1.1 keeps 1e-4 a string; coerce() makes it a float
        "lora.r": 16,
        "training.max_steps": 5,
        "lora": None,
        "lora.target_modules": ["q_proj", "v_proj"],
    }


def test_override_without_value_is_an_error():
    with pytest.raises(recipe_config.ConfigError, match="has no value"):
        recipe_config.parse_overrides(["--training.learning_rate"])
    with pytest.raises(recipe_config.ConfigError, match="cannot read argument"):
        recipe_config.parse_overrides(["learning_rate"])


def test_precedence_defaults_then_yaml_then_command_line(tmp_path):
    path = write_yaml(tmp_path, {"training": {"learning_rate": 3.0e-4, "num_train_epochs": 2.0}, "lora": {"r": 4}})
    config = recipe_config.load_config(path, {"training.learning_rate": "1e-4", "lora.lora_alpha": 8})
    assert config.training["learning_rate"] == pytest.approx(1e-4)  # command line beats YAML
    assert isinstance(config.training["learning_rate"], float)
    assert config.training["num_train_epochs"] == 2.0  # YAML beats defaults
    assert config.training["report_to"] == "none"  # built-in default kept
    # The YAML's lora section layers over the built-in LoRA defaults, key by key.
    assert config.lora == {**recipe_config.BUILTIN_DEFAULTS["lora"], "r": 4, "lora_alpha": 8}
    assert config.model.name_or_path == "hf_accum:tiny-llama"  # dataclass default
    assert config.source("training.learning_rate") == recipe_config.COMMAND_LINE
    assert config.source("training.num_train_epochs") == path
    assert config.source("training.report_to") == recipe_config.BUILTIN


def test_a_new_dataset_starts_the_data_section_afresh():
    """The embedded default's held-out split, sizes and columns describe *its* dataset: a user file
    given on the command line does not inherit them (they would fail or leak)."""
    config = recipe_config.load_config(None, {"data.dataset": "my.jsonl", "data.max_length": 64})
    assert config.data.dataset == "my.jsonl" and config.data.max_length == 64
    assert config.data.eval_split is None and config.data.num_train_examples == recipe_config.DataSection().num_train_examples
    same = recipe_config.load_config(None, {"data.dataset": "hf_accum:synthetic-tasks"})
    assert same.data.eval_split == "test"  # the same dataset keeps its settings


def test_command_line_accumulation_replaces_the_yaml_global_batch(tmp_path):
    config = resolved(["training.gradient_accumulation_steps=2"], tmp_path=tmp_path)
    assert config.training["gradient_accumulation_steps"] == 2 and config.global_batch_size is None
    assert any("replaces global_batch_size=32" in note and "command line" in note for note in config.notes)


def test_a_yaml_starts_from_the_built_in_defaults_not_the_cpu_job(tmp_path):
    path = write_yaml(tmp_path, {"data": {"dataset": "x.jsonl"}})
    config = recipe_config.load_config(path)
    assert config.global_batch_size is None and "use_cpu" not in config.training
    assert config.lora == recipe_config.BUILTIN_DEFAULTS["lora"]


def test_no_config_gives_the_embedded_default():
    config = recipe_config.load_config(None, {})
    assert config.lora["modules_to_save"] == ["embed_tokens", "lm_head"]
    assert config.data.eval_split == "test"
    assert config.global_batch_size == 32


def test_the_embedded_default_named_as_the_source_is_the_objectives_own():
    """Without --config, objective=dpo loads cpu_dpo.yaml: messages and notes name that file, and the default
    output dir is outputs/cpu_dpo (not the SFT default's)."""
    sft = recipe_config.load_config(None, {})
    assert sft.source("training.lr_scheduler_type") == "embedded default (recipes/configs/cpu_default.yaml)"
    dpo = recipe_config.load_config(None, {"objective": "dpo"})
    assert dpo.source("dpo.sft_weight") == "embedded default (recipes/configs/cpu_dpo.yaml)"
    resolved_dpo = checks.load_recipe_config(["objective=dpo"], engines=ENGINES, objectives=OBJECTIVES)
    assert resolved_dpo.training["output_dir"] == os.path.join("outputs", "cpu_dpo")


def test_cpu_default_yaml_is_the_embedded_default():
    from_yaml = recipe_config.load_config(os.path.join(ROOT, "recipes", "configs", "cpu_default.yaml"))
    embedded = recipe_config.load_config(None)
    assert from_yaml.to_dict() == embedded.to_dict()


def test_lora_null_means_full_fine_tuning():
    config = recipe_config.load_config(None, {"lora": None})
    assert config.lora is None and config.lora_config() is None


# -- unknown keys and wrong types --------------------------------------------------------------


@pytest.mark.parametrize(
    "override, closest",
    [
        ({"egine": "loop"}, "engine"),
        ({"training.learnig_rate": 1e-4}, "learning_rate"),
        ({"lora.lora_alfa": 8}, "lora_alpha"),
        ({"data.datset": "x.jsonl"}, "dataset"),
        ({"model.name_or_pth": "x"}, "name_or_path"),
        ({"quantization.load_in_4bits": True}, "load_in_4bit"),
        ({"trainig.seed": 1}, "training"),
    ],
)
def test_unknown_key_names_the_closest_keys_not_every_valid_one(override, closest):
    """At most 3 suggestions; every valid name only when they are few (sections, top-level keys), else how many
    there are and the command that lists them (a training typo once printed ~1,900 characters of field names)."""
    with pytest.raises(recipe_config.ConfigError) as info:
        recipe_config.load_config(None, override)
    message = str(info.value)
    assert f"Did you mean {closest!r}" in message
    assert message.split("Did you mean ")[1].split("?")[0].count("'") <= 6  # 3 names at most
    assert repr(next(iter(override))) in message or next(iter(override)).split(".")[0] in message
    assert len(message) < 400, message  # one readable line
    section = next(iter(override)).split(".")[0]
    many = section in recipe_config.SECTIONS and len(recipe_config.valid_keys(section)) > recipe_config.schema.LIST_ALL_UP_TO
    assert many == (section in ("training", "lora", "data"))
    if many:  # counted, and how to list them
        assert "Valid keys" not in message and f"--keys {section})" in message
        assert f"({len(recipe_config.valid_keys(section))} valid keys;" in message
    else:
        assert "Valid keys:" in message or "Valid sections:" in message


@pytest.mark.parametrize("key", ["training.overwrite_output_dir", "training.global_batch_size", "data.engine"])
def test_top_level_key_inside_a_section_says_where_it_belongs(key):
    with pytest.raises(recipe_config.ConfigError) as info:
        recipe_config.load_config(None, {key: "1"})
    top = key.split(".")[1]
    assert f"{top} is a top-level key" in str(info.value) and f"{top}=..." in str(info.value)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ({"training.learning_rate": "fast"}, "training.learning_rate: expected float"),
        ({"training.per_device_train_batch_size": 2.5}, "training.per_device_train_batch_size: expected int"),
        ({"training.activation_checkpointing": "sometimes"}, "training.activation_checkpointing"),
        ({"lora.r": "big"}, "lora.r: expected int"),
        ({"lora.bias": "some"}, "lora.bias"),
        ({"data.max_length": [1, 2]}, "data.max_length: expected int"),
        ({"global_batch_size": "many"}, "global_batch_size"),
        ({"model.trust_remote_code": 1}, "model.trust_remote_code: expected bool"),
    ],
)
def test_wrong_types_are_refused_with_the_key(override, fragment):
    with pytest.raises(recipe_config.ConfigError, match=fragment.replace(".", r"\.")):
        recipe_config.load_config(None, override)


def test_strings_from_the_command_line_are_coerced():
    config = recipe_config.load_config(None, {"training.max_steps": "7", "training.activation_checkpointing": "false"})
    assert config.training["max_steps"] == 7
    assert config.training["activation_checkpointing"] is False


def test_hf_constructors_validate_values_too(tmp_path):
    with pytest.raises(recipe_config.ConfigError, match="training"):
        resolved(["training.lr_scheduler_type=cosinus"], tmp_path=tmp_path).training_arguments()


# -- batch arithmetic --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, expected", [(1, 4), (2, 2), (4, 1)])
def test_accumulation_is_derived_from_the_global_batch(world_size, expected, tmp_path):
    config = resolved([], world_size=world_size, tmp_path=tmp_path)
    assert config.training["gradient_accumulation_steps"] == expected
    assert config.training["per_device_train_batch_size"] * expected * world_size == 32


def test_global_batch_that_does_not_divide_names_nearest_values(tmp_path):
    with pytest.raises(recipe_config.ConfigError, match="nearest valid global_batch_size: 24 or 32"):
        resolved(["global_batch_size=30"], tmp_path=tmp_path)


def test_global_batch_contradicting_accumulation_in_one_layer_is_refused_naming_it(tmp_path):
    path = write_yaml(tmp_path, {"global_batch_size": 32, "training": {"per_device_train_batch_size": 8,
                                                                       "gradient_accumulation_steps": 3}})
    with pytest.raises(recipe_config.ConfigError, match=f"needs gradient_accumulation_steps=4.*both set in {path}"):
        checks.resolve(recipe_config.load_config(path, {"training.output_dir": str(tmp_path / "o")}), ENGINES, OBJECTIVES,
                       world_size=1)


def test_accumulation_below_one_is_refused(tmp_path):
    with pytest.raises(recipe_config.ConfigError, match=r"gradient_accumulation_steps=0 \(command line\) must be >= 1"):
        resolved(["global_batch_size=null", "training.gradient_accumulation_steps=0"], tmp_path=tmp_path)
    with pytest.raises(recipe_config.ConfigError, match="per_device_train_batch_size=0"):
        resolved(["global_batch_size=null", "training.per_device_train_batch_size=0"], tmp_path=tmp_path)


def test_explicit_accumulation_without_global_batch_is_kept(tmp_path):
    config = resolved(["global_batch_size=null", "training.gradient_accumulation_steps=3"], tmp_path=tmp_path)
    assert config.training["gradient_accumulation_steps"] == 3


# -- environment checks ------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a bf16 GPU")
def test_bf16_without_support_is_refused(tmp_path):
    with pytest.raises(recipe_config.ConfigError, match="bf16 requested"):
        resolved(["training.use_cpu=false", "training.bf16=true"], tmp_path=tmp_path)
    with pytest.raises(recipe_config.ConfigError, match="bf16 requested"):
        resolved(["training.use_cpu=false", "model.dtype=bfloat16"], tmp_path=tmp_path)
    # Explicit CPU bf16 autocast is allowed (as TrainingArguments allows it).
    assert resolved(["training.use_cpu=true", "training.bf16=true"], tmp_path=tmp_path).training["bf16"] is True


@pytest.mark.parametrize("argv,message", [
    (["training.use_cpu=true", "training.bf16=true", "training.fp16=true"], "both true; pick one"),
    (["model.dtype=int8"], "model.dtype='int8'; allowed: float32, bfloat16, float16, auto"),
])
def test_contradicting_or_unknown_precision_is_refused(argv, message, tmp_path):
    with pytest.raises(recipe_config.ConfigError, match=re.escape(message)):
        resolved(argv, tmp_path=tmp_path)


def test_qlora_without_bitsandbytes_is_refused(monkeypatch, tmp_path):
    from hf_accum.recipe import modeling

    monkeypatch.setattr(modeling, "bnb_available", lambda: False)
    with pytest.raises(recipe_config.ConfigError, match="needs bitsandbytes"):
        resolved(["quantization={load_in_4bit: true}"], tmp_path=tmp_path)


def test_quantization_without_lora_is_refused(tmp_path):
    with pytest.raises(recipe_config.ConfigError, match="quantization needs lora"):
        resolved(["lora=null", "quantization={load_in_4bit: true}"], tmp_path=tmp_path)


def test_missing_and_empty_data_files_are_refused(tmp_path):
    with pytest.raises(recipe_config.ConfigError, match="data file not found"):
        resolved([f"data.dataset={tmp_path / 'nope.jsonl'}", "data.eval_split=null"], tmp_path=tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(recipe_config.ConfigError, match="data file is empty"):
        resolved([f"data.dataset={empty}", "data.eval_split=null"], tmp_path=tmp_path)


def test_local_file_cannot_serve_as_its_own_test_split(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "b"}\n')
    with pytest.raises(recipe_config.ConfigError, match="single local file"):
        resolved([f"data.dataset={data}", "data.eval_split=test"], tmp_path=tmp_path)
    ok = resolved([f"data.dataset={data}", "data.eval_split=train[50%:]"], tmp_path=tmp_path)
    assert ok.data.eval_split == "train[50%:]"


def test_unknown_engine_is_refused(tmp_path):
    with pytest.raises(recipe_config.ConfigError, match="Did you mean 'trainer'"):
        resolved(["engine=trainr"], tmp_path=tmp_path)


# -- the saved copy and the output directory ---------------------------------------------------


def save_config(config, out):
    os.makedirs(out, exist_ok=True)
    write_text_atomically(os.path.join(out, recipe_config.RESOLVED_CONFIG_NAME), config.to_yaml())


def test_output_dir_with_a_different_run_is_refused(tmp_path):
    config = resolved([], tmp_path=tmp_path)
    out = config.training["output_dir"]
    save_config(config, out)
    assert run_outputs.check_output_dir(config, resume=False) == "fresh"  # the same run again, nothing to resume: allowed
    other = resolved(["training.learning_rate=1e-4"], tmp_path=tmp_path)
    with pytest.raises(recipe_config.ConfigError, match="holds a different run .*learning_rate"):
        run_outputs.check_output_dir(other, resume=False)
    forced = resolved(["training.learning_rate=1e-4", "overwrite_output_dir=true"], tmp_path=tmp_path)
    run_outputs.check_output_dir(forced, resume=False)


def test_a_run_saved_before_a_key_existed_is_the_same_run_at_that_keys_default(tmp_path):
    """A run saved by an older version lacks the keys added since (data.eval_before, model.adapter): it trained
    with their defaults, so it resumes; set away from the default, the key makes it a different run."""
    import yaml

    config = resolved([], tmp_path=tmp_path)
    out = config.training["output_dir"]
    os.makedirs(out, exist_ok=True)
    older = config.to_dict()
    del older["data"]["eval_before"], older["model"]["adapter"]
    with open(os.path.join(out, recipe_config.RESOLVED_CONFIG_NAME), "w") as handle:
        yaml.safe_dump(older, handle)
    assert run_outputs.check_output_dir(config, resume=False) == "fresh"
    other = resolved(["data.eval_before=false"], tmp_path=tmp_path)
    with pytest.raises(recipe_config.ConfigError, match="holds a different run .*eval_before: True -> False"):
        run_outputs.check_output_dir(other, resume=False)


def test_a_rank_that_finds_the_output_dir_removed_under_it_starts_fresh(tmp_path, monkeypatch):
    """Under torchrun only the main rank probes writability, creating and removing the directory; another rank
    reading it at that moment saw ``isdir`` true and then ``listdir`` fail (FileNotFoundError, seen in CI)."""
    config = resolved([], tmp_path=tmp_path)
    out = config.training["output_dir"]
    os.makedirs(out)
    real_listdir = os.listdir

    def removed_first(path):  # the probe's rmdir lands between the check and the read
        if os.path.abspath(path) == os.path.abspath(out) and os.path.isdir(out):
            os.rmdir(out)
        return real_listdir(path)

    monkeypatch.setattr(run_outputs, "is_main_process", lambda: False)  # the rank that does not probe
    monkeypatch.setattr(run_outputs.os, "listdir", removed_first)
    assert run_outputs.check_output_dir(config, resume=False) == "fresh"


def test_output_dir_of_an_unfinished_run_is_resumed_only_when_asked(tmp_path):
    config = resolved([], tmp_path=tmp_path)
    out = config.training["output_dir"]
    save_config(config, out)
    os.makedirs(os.path.join(out, "checkpoint-2"))
    with pytest.raises(recipe_config.ConfigError, match="resume_from_checkpoint=true to continue"):
        run_outputs.check_output_dir(config, resume=False)
    resuming = resolved(["training.resume_from_checkpoint=true"], tmp_path=tmp_path)
    assert resuming.training["resume_from_checkpoint"] is True
    assert run_outputs.check_output_dir(resuming, resume=True) == "resume"  # resume_from_checkpoint is not part of the run
    open(os.path.join(out, run_outputs.METRICS_NAME), "w").close()
    with pytest.raises(recipe_config.ConfigError, match="holds a finished run"):
        run_outputs.check_output_dir(resuming, resume=True)


def test_output_dir_with_foreign_files_is_refused(tmp_path):
    config = resolved([], tmp_path=tmp_path)
    os.makedirs(config.training["output_dir"])
    open(os.path.join(config.training["output_dir"], "notes.txt"), "w").close()
    with pytest.raises(recipe_config.ConfigError, match="not a recipe run"):
        run_outputs.check_output_dir(config, resume=False)


@pytest.mark.parametrize("make_blocker", ["file", "under_a_file"])
def test_output_dir_that_cannot_be_written_is_refused_and_nothing_stays(make_blocker, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if make_blocker == "file" else blocker / "run"
    config = resolved([f"training.output_dir={out}"], tmp_path=tmp_path)
    with pytest.raises(recipe_config.ConfigError, match="output_dir"):
        run_outputs.check_output_dir(config, resume=False)
    assert sorted(os.listdir(tmp_path)) == ["blocker"]


def test_probing_a_new_output_dir_leaves_nothing(tmp_path):
    out = tmp_path / "a" / "b" / "run"
    run_outputs.probe_writable(str(out))
    assert os.listdir(tmp_path) == []


def test_saved_config_round_trips(tmp_path):
    config = resolved(["training.learning_rate=1e-4", "lora.r=8"], tmp_path=tmp_path)
    save_config(config, str(tmp_path))
    again = recipe_config.build_config(recipe_config.load_yaml(os.path.join(tmp_path, recipe_config.RESOLVED_CONFIG_NAME)))
    assert again.to_dict() == config.to_dict()


def test_sections_are_one_registry():
    """Adding a section is adding one RecipeConfig field carrying a Section: keys, types, building."""
    assert list(recipe_config.SECTIONS) == ["model", "data", "accumulation", "dpo", "grpo", "lora", "quantization",
                                           "training"]
    assert recipe_config.SECTIONS["lora"].cls().__name__ == "LoraConfig" and recipe_config.SECTIONS["data"].cls() is recipe_config.DataSection
    with pytest.raises(recipe_config.ConfigError, match="Valid sections: accumulation, data, dpo, grpo, lora, model, quantization, training"):
        recipe_config.load_config(None, {"trainig.seed": 1})


# -- every YAML under recipes/ -----------------------------------------------------------------


def test_recipes_ship_the_expected_files():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"cpu_default.yaml", "llama3_8b_lora.yaml", "llama3_8b_qlora.yaml", "llama3_8b_full.yaml"} <= names
    launchers = {os.path.basename(p) for p in LAUNCHERS}
    assert {"single_process.yaml", "ddp.yaml", "fsdp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3_offload.yaml",
            "multi_node.yaml"} <= launchers
    assert os.path.isfile(os.path.join(ROOT, "recipes", "accelerate", "slurm_multi_node.sh"))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_recipe_config_loads_and_validates(path, tmp_path, monkeypatch):
    from hf_accum.recipe import modeling

    # The 8B configs name a Hub model; nothing can be fetched here, so its source check is skipped.
    monkeypatch.setattr(modeling, "check_model_source", lambda name: None)
    text = open(path).read()
    header = text.split("\n\n")[0] if not text.startswith("#") else "".join(
        line for line in text.splitlines(True) if line.startswith("#")
    )
    assert text.startswith("#"), "each config opens with a comment"
    # ...giving the exact command that runs it, and the batch arithmetic.
    assert f"recipes/finetune_llama.py --config recipes/configs/{os.path.basename(path)}" in " ".join(re.sub(r"\\\n#", " ", header).split())
    assert "global batch" in header.lower() and "accumulation" in header.lower()
    config = recipe_config.load_config(path)
    # This machine may have no bf16 GPU: validate the rest with explicit CPU bf16 autocast.
    no_bf16_gpu = not (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    config.training["use_cpu"] = config.training.get("use_cpu") or no_bf16_gpu
    config.training["output_dir"] = str(tmp_path / "out")
    world = 8 if "8b" in os.path.basename(path) else 1
    config = checks.resolve(config, ENGINES, OBJECTIVES, world_size=world)
    t = config.training
    assert t["per_device_train_batch_size"] * t["gradient_accumulation_steps"] * world == config.global_batch_size
    args = config.training_arguments()
    assert args.learning_rate == t["learning_rate"]
    if config.lora is not None:
        assert config.lora_config().r == config.lora["r"]
    if config.quantization is not None:
        bnb = config.bnb_config()
        assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4"


def test_llama3_configs_differ_where_they_should():
    lora = recipe_config.load_config(os.path.join(ROOT, "recipes", "configs", "llama3_8b_lora.yaml"))
    qlora = recipe_config.load_config(os.path.join(ROOT, "recipes", "configs", "llama3_8b_qlora.yaml"))
    full = recipe_config.load_config(os.path.join(ROOT, "recipes", "configs", "llama3_8b_full.yaml"))
    assert lora.training["bf16"] and lora.training["activation_checkpointing"] and lora.quantization is None
    assert qlora.quantization["bnb_4bit_quant_type"] == "nf4" and qlora.lora is not None
    assert full.lora is None
    assert {c.model.name_or_path for c in (lora, qlora, full)} == {"meta-llama/Llama-3.1-8B-Instruct"}


EXPECTED_LAUNCHERS = {
    "single_process.yaml": ("NO", 1, 1),
    "ddp.yaml": ("MULTI_GPU", 8, 1),
    "fsdp.yaml": ("FSDP", 8, 1),
    "deepspeed_zero2.yaml": ("DEEPSPEED", 8, 1),
    "deepspeed_zero3.yaml": ("DEEPSPEED", 8, 1),
    "deepspeed_zero3_offload.yaml": ("DEEPSPEED", 8, 1),
    "multi_node.yaml": ("MULTI_GPU", 16, 2),
}


@pytest.mark.parametrize("path", LAUNCHERS, ids=os.path.basename)
def test_every_accelerate_launcher_config_loads(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(path)  # raises on unknown keys
    name = os.path.basename(path)
    assert name in EXPECTED_LAUNCHERS, f"add {name} to EXPECTED_LAUNCHERS"
    kind, processes, machines = EXPECTED_LAUNCHERS[name]
    assert str(config.distributed_type).split(".")[-1] == kind
    assert (config.num_processes, config.num_machines) == (processes, machines)
    assert "accelerate launch --config_file recipes/accelerate/" + name in open(path).read()
    if kind == "DEEPSPEED":  # everything DeepSpeed needs is in the JSON (tests/distributed/test_distributed.py loads it)
        deepspeed = json.load(open(os.path.join(ROOT, config.deepspeed_config["deepspeed_config_file"])))
        assert deepspeed["zero_optimization"]["stage"] == (2 if "zero2" in name else 3)
        offload = deepspeed["zero_optimization"].get("offload_param", {}).get("device", "none")
        assert (offload == "cpu") == ("offload" in name)
    if kind == "FSDP":
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    if machines > 1:
        assert config.main_process_port and config.main_process_ip


# -- every value checked before any model loads: the HF and torch objects built up front ----------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["training.save_steps=0"], "training.save_steps=0 (command line) with training.save_strategy=steps: use a number"),
        (["training.save_steps=-5"], "training.save_steps=-5 (command line) with training.save_strategy=steps"),
        (["training.eval_strategy=steps", "training.eval_steps=0"], "training.eval_steps=0 (command line) with "
         "training.eval_strategy=steps"),
        (["training.logging_steps=0"], "training.logging_steps=0 (command line) with training.logging_strategy=steps"),
        (["training.adam_beta1=1.5"], "refuses the training section: Invalid beta parameter at index 0: 1.5 "
         "[training.adam_beta1=1.5 (command line)]"),
        (["training.adam_epsilon=-1"], "Invalid epsilon value: -1.0 [training.adam_epsilon=-1.0 (command line)]"),
        (["training.learning_rate=-0.1"], "Invalid learning rate: -0.1 [training.learning_rate=-0.1 (command line)]"),
        (["training.lr_scheduler_kwargs={bogus: 1}"], "the cosine scheduler refuses the training section: "
         "get_cosine_schedule_with_warmup() got an unexpected keyword argument 'bogus' [training.lr_scheduler_type="
         "'cosine' (embedded default (recipes/configs/cpu_default.yaml)); training.lr_scheduler_kwargs={'bogus': 1} "
         "(command line)]"),
        (["training.warmup_steps=-1"], "TrainingArguments refuses the training section: Got warmup_steps = -1.0, "
         "Expected value warmup_steps >= 0 [training.warmup_steps=-1.0 (command line)]"),
        (["training.optim=adamw_nope"], "adamw_nope is not a valid OptimizerNames"),
    ],
)
def test_values_the_training_objects_refuse_are_found_before_loading(engine, argv, message, tmp_path):
    with pytest.raises(recipe_config.ConfigError) as caught:
        resolved([f"engine={engine}", *argv], tmp_path=tmp_path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_intervals_are_free_where_their_strategy_does_not_use_them(tmp_path):
    config = resolved(["training.save_strategy=no", "training.save_steps=0", "training.eval_steps=0"], tmp_path=tmp_path)
    assert config.training["save_steps"] == 0


def make_model_dir(path, weights=True, tokenizer=True):
    from hf_accum.recipe.embedded import build_tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    model = build_tiny_llama(tok)
    model.config.save_pretrained(path)
    if weights:
        model.save_pretrained(path)
    if tokenizer:
        tok.save_pretrained(path)
    return str(path)


def test_a_model_directory_needs_weights(tmp_path):
    path = make_model_dir(tmp_path / "m", weights=False)
    with pytest.raises(recipe_config.ConfigError, match=r"model.name_or_path='.*/m': the directory holds no weights "
                                                        r"\(\*.safetensors"):
        resolved([f"model.name_or_path={path}"], tmp_path=tmp_path)


def test_a_model_directory_needs_a_tokenizer_or_a_tokenizer_source(tmp_path):
    path = make_model_dir(tmp_path / "m", tokenizer=False)
    with pytest.raises(recipe_config.ConfigError, match="holds no tokenizer files .* set model.tokenizer"):
        resolved([f"model.name_or_path={path}"], tmp_path=tmp_path)
    tokenizer_dir = make_model_dir(tmp_path / "t", weights=False)
    config = resolved([f"model.name_or_path={path}", f"model.tokenizer={tokenizer_dir}"], tmp_path=tmp_path)
    assert config.model.tokenizer == tokenizer_dir
    with pytest.raises(recipe_config.ConfigError, match="model.tokenizer='.*/nowhere': no such directory"):
        resolved([f"model.name_or_path={path}", f"model.tokenizer={tmp_path / 'nowhere'}"], tmp_path=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(recipe_config.ConfigError, match="model.tokenizer=.*holds no tokenizer files"):
        resolved([f"model.name_or_path={path}", f"model.tokenizer={empty}"], tmp_path=tmp_path)


def test_a_complete_model_directory_passes(tmp_path):
    path = make_model_dir(tmp_path / "m")
    assert resolved([f"model.name_or_path={path}"], tmp_path=tmp_path).model.name_or_path == path


# -- the same through the recipe's main (in this process): exit 2 with one line, before loading or writing anything


def run_recipe(tmp_path, *overrides):
    """The recipe's main in this process, exiting as the script would (:func:`hf_accum.recipe.testing.run_main`)."""
    from hf_accum.recipe.testing import run_main

    out = tmp_path / "out"
    return run_main(f"training.output_dir={out}", *overrides), out


@pytest.mark.parametrize("engine", ENGINES)
def test_the_recipe_refuses_save_steps_0_before_loading_in_both_engines(engine, tmp_path):
    proc, out = run_recipe(tmp_path, f"engine={engine}", "training.save_steps=0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: training.save_steps=0 (command line) with training.save_strategy=steps: use a number of "
                      "updates >= 1 (or a fraction of the planned updates, between 0 and 1), or set "
                      "training.save_strategy=no"]
    assert "Traceback" not in proc.stderr and "held-out exact match" not in proc.stdout and not out.exists()


def test_the_recipe_refuses_a_model_directory_without_weights_before_loading(tmp_path):
    path = make_model_dir(tmp_path / "m", weights=False)
    proc, out = run_recipe(tmp_path, f"model.name_or_path={path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: model.name_or_path={path!r}: the directory holds no weights" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_the_recipe_refuses_a_url_as_data_dataset_before_loading(tmp_path):
    proc, out = run_recipe(tmp_path, "data.dataset=https://example.com/train.jsonl")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data.dataset='https://example.com/train.jsonl': URLs are not read" in errors[0]
    assert "save_to_disk" in errors[0] and not out.exists()


def test_every_recipe_kit_error_is_an_input_error_and_run_cli_catches_that_class(capsys):
    from hf_accum.errors import EXIT_BAD_INPUT, InputError
    from hf_accum.recipe.data import DataError
    from hf_accum.recipe.launch import LaunchError
    from hf_accum.recipe.modeling import ModelError

    kinds = (recipe_config.ConfigError, DataError, ModelError, LaunchError, run_outputs.OutputDirError)
    assert all(issubclass(kind, InputError) for kind in kinds)
    for kind in kinds:
        def fail(argv, kind=kind):
            raise kind(f"{kind.__name__} says no")

        assert run_outputs.run_cli(fail, argv=[]) == EXIT_BAD_INPUT
        assert capsys.readouterr().err == f"error: {kind.__name__} says no\n"


# -- command-line overrides change only their key; what a new model/dataset drops is named (issue 29) ---------


def test_a_new_model_or_dataset_keeps_the_rest_of_its_section_and_names_what_it_drops(tmp_path):
    path = write_yaml(tmp_path, {"model": {"name_or_path": "org/a", "chat_template": "{{ messages }}", "tokenizer": "org/tok",
                                           "dtype": "bfloat16"},
                                 "data": {"dataset": "a.jsonl", "max_length": 128, "eval_split": "train[90%:]", "packing": True}})
    config = recipe_config.load_config(path, {"model.name_or_path": "org/b", "data.dataset": "b.jsonl"})
    assert (config.model.name_or_path, config.model.chat_template, config.model.dtype) == ("org/b", "{{ messages }}", "bfloat16")
    assert (config.data.dataset, config.data.max_length, config.data.packing) == ("b.jsonl", 128, True)
    assert config.model.tokenizer is None and config.data.eval_split is None  # they described the previous ones...
    model_note, = [n for n in config.notes if n.startswith("model.name_or_path='org/b' (command line) replaces 'org/a'")]
    assert "dropped model.tokenizer='org/tok'" in model_note and "chat_template" not in model_note
    data_note, = [n for n in config.notes if n.startswith("data.dataset='b.jsonl' (command line) replaces 'a.jsonl'")]
    assert "dropped data.eval_split='train[90%:]'," in data_note and "max_length" not in data_note  # ...and are named
    again = recipe_config.load_config(path, {"data.dataset": "b.jsonl", "data.eval_split": "train[90%:]"})
    assert again.data.eval_split == "train[90%:]" and not again.notes  # set again in the same layer: kept, no note
    assert not recipe_config.load_config(path, {"model.dtype": "float32"}).notes  # an unrelated override drops nothing


def test_a_yaml_section_without_its_identity_describes_the_default_one(tmp_path):
    path = write_yaml(tmp_path, {"data": {"max_length": 64, "eval_split": "test"}})  # the embedded dataset's split
    config = recipe_config.load_config(path, {"data.dataset": "e.jsonl"})
    assert config.data.max_length == 64 and config.data.eval_split is None
    assert config.notes == ["data.dataset='e.jsonl' (command line) replaces 'hf_accum:synthetic-tasks' (built-in "
                            "default): dropped data.eval_split='test', which described the previous one (set again to "
                            "keep); the other data keys are kept"]
    assert recipe_config.load_config(path, {"data.dataset": "hf_accum:synthetic-tasks"}).data.eval_split == "test"


def test_the_embedded_dataset_settings_dropped_for_a_user_file_are_each_named():
    config = recipe_config.load_config(None, {"data.dataset": "my.jsonl"})
    note, = config.notes
    for dropped in ("data.eval_split='test'", "data.num_train_examples=5000", "data.num_eval_examples=200"):
        assert dropped in note
    assert config.data.max_length == 128 and config.data.eval_max_new_tokens == 16  # the embedded YAML's, kept


# -- the typed training section and pydantic's coercion ---------------------------------------------------------


def test_training_reads_typed_attributes_with_trainingarguments_defaults():
    from transformers import TrainingArguments

    config = recipe_config.load_config(None, {"training.max_steps": "7"})
    assert config.training.max_steps == 7 and isinstance(config.training.learning_rate, float)
    assert config.training.adam_beta2 == TrainingArguments.__dataclass_fields__["adam_beta2"].default
    assert "adam_beta2" not in config.training and "adam_beta2" not in config.to_dict()["training"]  # only what is set
    with pytest.raises(AttributeError, match="no field 'learnig_rate'"):
        config.training.learnig_rate  # noqa: B018


@pytest.mark.parametrize("override, expected", [
    ({"training.save_strategy": False}, ("save_strategy", "no")),  # YAML 1.1's unquoted `no`
    ({"training.max_steps": "5"}, ("max_steps", 5)),
    ({"training.bf16": "false"}, ("bf16", False)),
    ({"lora.target_modules": ["q_proj", "v_proj"]}, ("target_modules", ["q_proj", "v_proj"])),
])
def test_values_of_the_right_type_pass_and_command_line_strings_are_converted(override, expected):
    config = recipe_config.load_config(None, override)
    key, value = expected
    section = config.lora if key == "target_modules" else config.training
    assert section[key] == value and type(section[key]) is type(value)


@pytest.mark.parametrize("override, fragment", [
    ({"training.max_steps": True}, "training.max_steps: expected int, got True (bool)"),
    ({"training.learning_rate": True}, "training.learning_rate: expected float, got True (bool)"),
    ({"lora.bias": "some"}, "lora.bias: expected Literal['none', 'all', 'lora_only'], got 'some' (str): Input should be"),
    ({"training.report_to": 3}, "training.report_to: expected"),
])
def test_no_lax_coercion_of_non_strings(override, fragment):
    with pytest.raises(recipe_config.ConfigError) as caught:
        recipe_config.load_config(None, override)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


# -- values PEFT / torch / transformers refuse later (or accept and train wrongly): refused before loading -----


BAD_VALUES = [
    (["lora.r=0"], "`r` should be a positive integer value but the value passed is 0 [lora.r=0 (command line)]"),
    (["lora.r=-3"], "[lora.r=-3 (command line)]"),
    (["lora.lora_dropout=1.5"], "dropout probability has to be between 0 and 1, but got 1.5 [lora.lora_dropout=1.5 "
                                "(command line)]"),
    (["lora.lora_dropout=-0.1"], "lora.lora_dropout=-0.1 (command line): allowed: >= 0 and < 1"),
    (["lora.lora_dropout=1"], "lora.lora_dropout=1.0 (command line): allowed: >= 0 and < 1"),
    (["lora.lora_alpha=0"], "lora.lora_alpha=0 (command line): allowed: > 0"),
    (["training.num_train_epochs=-1", "training.max_steps=5"], "training.num_train_epochs=-1.0 (command line) must be "
                                                                ">= 0 (training.max_steps=5 sets the length)"),
    (["training.learning_rate=-1e-4"], "Invalid learning rate: -0.0001 [training.learning_rate=-0.0001 (command line)]"),
    (["training.weight_decay=-0.1"], "training.weight_decay=-0.1 (command line)"),
    (["training.warmup_steps=-0.5"], "warmup_steps >= 0 [training.warmup_steps=-0.5 (command line)]"),
    (["training.adam_beta1=1.0"], "Invalid beta parameter at index 0: 1.0 [training.adam_beta1=1.0 (command line)]"),
    (["training.adam_beta2=-0.1"], "Invalid beta parameter at index 1: -0.1 [training.adam_beta2=-0.1 (command line)]"),
    (["training.adam_epsilon=0"], "training.adam_epsilon=0.0 (command line): allowed: > 0"),
    (["training.max_grad_norm=-1"], "training.max_grad_norm=-1.0"),
    (["training.label_smoothing_factor=1.5"], "training.label_smoothing_factor=1.5"),
    (["training.lr_scheduler_type=foo"], "foo is not a valid SchedulerType"),
    (["training.optim=foo"], "foo is not a valid OptimizerNames"),
    (["training.per_device_eval_batch_size=0"], "batch_size=0 [training.per_device_eval_batch_size=0 (command line)]"),
    (["training.dataloader_num_workers=-2"], "[training.dataloader_num_workers=-2 (command line)]"),
    (["training.seed=-1"], "Seed must be between 0 and 2**32 - 1 [training.seed=-1 (command line)]"),
    (["training.report_to=bogus"], "bogus is not supported, only"),
    (["training.fsdp=bogus"], "training.fsdp='bogus': unknown option 'bogus'; allowed: true, or full_shard"),
    # Both front-ends refuse a compiled model under a sharding engine once it is built: refused before instead.
    (["training.torch_compile=true", "training.fsdp=full_shard"], "training.torch_compile=true (command line) with "
                                                                   "training.fsdp (command line): not verified exact"),
    (["training.torch_compile=true", "training.deepspeed=recipes/deepspeed/zero3.json"],
     "training.torch_compile=true (command line) with training.deepspeed (command line): not verified exact"),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("argv, message", BAD_VALUES, ids=[" ".join(argv) for argv, _ in BAD_VALUES])
def test_values_refused_later_by_peft_torch_or_transformers_are_refused_now(engine, argv, message, tmp_path):
    with pytest.raises(InputError) as caught:
        resolved([f"engine={engine}", *argv], tmp_path=tmp_path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("argv, message", [
    # The loop steps its scheduler once per update, without a metric: a plateau scheduler would fail mid-run.
    (["training.lr_scheduler_type=reduce_lr_on_plateau", "training.eval_strategy=steps", "training.eval_steps=5"],
     "ReduceLROnPlateau.step() missing 1 required positional argument: 'metrics' [training.lr_scheduler_type="
     "'reduce_lr_on_plateau' (command line)]"),
    # No message names the key: the one whose removal lets the scheduler build is named.
    (["training.lr_scheduler_type=warmup_stable_decay"], "missing 1 required positional argument: 'num_decay_steps' "
                                                         "[training.lr_scheduler_type='warmup_stable_decay' (command line)]"),
])
def test_schedulers_the_loop_engine_cannot_step_are_refused(argv, message, tmp_path):
    with pytest.raises(recipe_config.ConfigError) as caught:
        resolved(["engine=loop", *argv], tmp_path=tmp_path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_refused_lora_values_do_fail_in_peft_on_the_real_model():
    """Not the preflight's opinion: PEFT on the recipe's tiny Llama refuses r=0 and a dropout of 1.5 (LoraConfig
    itself accepts both), and lora_alpha=0 builds an adapter whose output is zero whatever its weights."""
    import peft

    from hf_accum.recipe.embedded import build_tiny_llama, tiny_tokenizer

    model = build_tiny_llama(tiny_tokenizer())
    for bad in ({"r": 0}, {"lora_dropout": 1.5}):
        lora = peft.LoraConfig(target_modules=["q_proj"], **bad)  # accepted by the config class...
        with pytest.raises(ValueError):  # ...refused when the layer is built
            peft.get_peft_model(build_tiny_llama(tiny_tokenizer()), lora)
    zero = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj"], lora_alpha=0, init_lora_weights=False))
    layer = zero.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == 0


def test_a_zero_epsilon_turns_a_zero_gradient_into_nan_in_adamw():
    """Why training.adam_epsilon=0 is refused although torch accepts it: LoRA's A matrices get a zero gradient at
    the first update (B starts at zero), and AdamW then divides 0 by 0."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], eps=0.0)
    parameter.grad = torch.zeros(1)
    optimizer.step()
    assert torch.isnan(parameter).all()


def test_good_values_of_the_same_keys_pass(tmp_path):
    config = resolved(["lora.r=4", "lora.lora_dropout=0.1", "lora.lora_alpha=8", "training.max_steps=5",
                       "training.num_train_epochs=0", "training.adam_epsilon=1e-6", "training.max_grad_norm=0",
                       "training.lr_scheduler_type=cosine_with_restarts", "training.optim=sgd", "engine=trainer",
                       "training.report_to=none", "training.seed=0"], tmp_path=tmp_path)
    assert config.lora["r"] == 4 and config.training.max_grad_norm == 0


@pytest.mark.parametrize("fsdp", ["full_shard", "shard_grad_op offload", True])
def test_fsdp_is_asked_without_the_deprecated_string_form(fsdp, tmp_path):
    import logging

    from transformers import TrainingArguments
    from transformers.utils import logging as hf_logging

    from hf_accum.recipe.launch import fsdp_request

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    hf_logging.get_logger("transformers.training_args").addHandler(handler)
    try:
        resolved([f"training.fsdp={fsdp}"], tmp_path=tmp_path)
        assert not [r for r in records if "deprecated" in r]
        request = fsdp_request({"fsdp": fsdp})
        assert request["fsdp"] is True and request["fsdp_config"]["version"] == 2
        assert request["fsdp_config"].get("reshard_after_forward", True) is (fsdp != "shard_grad_op offload")
        if isinstance(fsdp, str):  # the string form itself does warn: this test would see it
            TrainingArguments(output_dir=str(tmp_path / "x"), fsdp=fsdp, use_cpu=True, report_to="none")
            assert [r for r in records if "Passing `fsdp` as a string is deprecated" in r]
    finally:
        hf_logging.get_logger("transformers.training_args").removeHandler(handler)


def test_the_recipe_refuses_lora_r_0_before_loading(tmp_path):
    proc, out = run_recipe(tmp_path, "lora.r=0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: PEFT refuses the lora section: `r` should be a positive integer value but the value passed is 0 "
        "[lora.r=0 (command line)]"]
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("name", ["smollm2_135m_cpu.yaml", "gemma3_270m_cpu.yaml"])
def test_the_real_model_configs_say_how_to_shorten_or_skip_the_held_out_scoring(name):
    """Scoring is generation, minutes on a CPU: the header names the keys that cap or skip it, and they are keys."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "configs", name)
    with open(path) as handle:
        header = "".join(line for line in handle if line.startswith("#"))
    assert "data.max_eval_examples" in header and "data.eval_before=false" in header
    config = recipe_config.load_config(path, {"data.max_eval_examples": 8, "data.eval_before": "false"})
    assert (config.data.max_eval_examples, config.data.eval_before) == (8, False)


def test_a_section_that_refuses_a_value_when_built_is_a_config_error():
    """A section dataclass may check its own values (``__post_init__``): its InputError reaches the user as the
    one-line ConfigError of every other bad key (exit 2), raised while the config is read, before anything loads."""

    @dataclasses.dataclass
    class Budget:
        tokens: int = 1

        def __post_init__(self):
            if self.tokens < 1:
                raise InputError(f"budget.tokens={self.tokens} must be >= 1")

    section = recipe_config.Section(Budget)
    assert section.check("budget", {"tokens": "3"}) == Budget(3)  # coerced, then built
    with pytest.raises(recipe_config.ConfigError, match=r"^budget.tokens=0 must be >= 1$"):
        section.check("budget", {"tokens": 0})
