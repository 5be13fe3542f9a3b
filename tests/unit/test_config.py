"""Recipe config: typing, precedence (defaults < YAML < command line), validation, saved copy,
and loading every YAML under recipes/ (configs and Accelerate launcher configs)."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch
import yaml

from hf_accum.recipe import config as recipe_config
from hf_accum.recipe import outputs as run_outputs

ENGINES = ("loop", "trainer")  # the recipe's engine table (recipes/finetune_llama.py ENGINES)

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
    return recipe_config.resolve(config, ENGINES, world_size=world_size)


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
def test_unknown_key_lists_valid_keys_and_closest_match(override, closest):
    with pytest.raises(recipe_config.ConfigError) as info:
        recipe_config.load_config(None, override)
    message = str(info.value)
    assert f"Did you mean {closest!r}" in message
    assert "Valid keys:" in message or "Valid sections:" in message
    assert repr(next(iter(override))) in message or next(iter(override)).split(".")[0] in message


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
        recipe_config.resolve(recipe_config.load_config(path, {"training.output_dir": str(tmp_path / "o")}), ENGINES, world_size=1)


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
    run_outputs.write_atomically(os.path.join(out, recipe_config.RESOLVED_CONFIG_NAME), config.to_yaml())


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
    assert list(recipe_config.SECTIONS) == ["model", "data", "accumulation", "lora", "quantization", "training"]
    assert recipe_config.SECTIONS["lora"].cls().__name__ == "LoraConfig" and recipe_config.SECTIONS["data"].cls() is recipe_config.DataSection
    with pytest.raises(recipe_config.ConfigError, match="Valid sections: accumulation, data, lora, model, quantization, training"):
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
    config = recipe_config.resolve(config, ENGINES, world_size=world)
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


# -- the same, as a user runs it: the recipe exits 2 with one line, before loading or writing anything


def run_recipe(tmp_path, *overrides):
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "finetune_llama.py"),
                           f"training.output_dir={out}", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc, out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_the_recipe_refuses_save_steps_0_before_loading_in_both_engines(engine, tmp_path):
    proc, out = run_recipe(tmp_path, f"engine={engine}", "training.save_steps=0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: training.save_steps=0 (command line) with training.save_strategy=steps: use a number of "
                      "updates >= 1 (or a fraction of the planned updates, between 0 and 1), or set "
                      "training.save_strategy=no"]
    assert "Traceback" not in proc.stderr and "held-out exact match" not in proc.stdout and not out.exists()


@pytest.mark.slow
def test_the_recipe_refuses_a_model_directory_without_weights_before_loading(tmp_path):
    path = make_model_dir(tmp_path / "m", weights=False)
    proc, out = run_recipe(tmp_path, f"model.name_or_path={path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: model.name_or_path={path!r}: the directory holds no weights" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.slow
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
