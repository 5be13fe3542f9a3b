"""``hf-accum check`` at bounded cost: by default the model cut to its first 2 layers, with the checkpoint's own
weights for them, the full vocabulary and the real tokenizer's pad token, embedding and head frozen; ``--layers N`` /
``--full``; the user's LoRA and quantization settings (flags or a recipe config) applied and what is audited; bad
values refused with exit 2. The cut on the real models, measured in a process of its own (its peak RSS), is in
tests/integration/test_fresh_processes.py."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from hf_accum import cli
from hf_accum.errors import EXIT_BAD_INPUT, EXIT_OK, InputError
from hf_accum.testing.check import _checked_model, check_model, vocabulary_matrices
from hf_accum.testing.check_settings import FineTuneSettings, lora_settings

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
    # Bounded full fine-tuning: the vocabulary matrices compute but are not audited; --full audits everything.
    frozen = {name for name, p in cut.named_parameters() if not p.requires_grad}
    assert frozen == {"model.embed_tokens.weight", "lm_head.weight"} - ({"lm_head.weight"} if
                                                                        cut.config.tie_word_embeddings else set())
    assert all(p.requires_grad for p in _checked_model(model_dir, layers=None).factory().parameters())


def test_the_cut_passes_and_says_what_it_checked(model_dir):
    lines = []
    report = check_model(model_dir, micro_batch=2, accumulation=3, n_examples=10, tolerance=1e-10,
                         announce=lines.append)
    assert report.passed and max(report.naive_errors) > 1e-4, report.table()
    assert f"2 of {LAYERS} layers" in report.model
    assert len(lines) == 2 and "estimated peak" in lines[0] and "--full" in lines[0]
    assert lines[1].startswith("first update done: ") and "the check ends in about" in lines[1]  # measured pace


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


def test_the_users_lora_and_quantization_are_what_is_audited(model_dir):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    settings = FineTuneSettings(lora_settings(4, None, ["q_proj", "v_proj"]), quantization)
    model = _checked_model(model_dir, layers=2, settings=settings).factory()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name and ("q_proj" in name or "v_proj" in name) for name in trainable)
    # The base linear weights hold the 4-bit values (at most 16 levels per 64-weight block), not the checkpoint's.
    base = model.get_base_model().model.layers[0].mlp.up_proj.weight
    assert base.dtype == torch.float64 and not base.requires_grad
    assert base.reshape(-1, 64).unique(dim=None).numel() <= 16 * base.numel() // 64
    original = Qwen2ForCausalLM.from_pretrained(model_dir).model.layers[0].mlp.up_proj.weight.double()
    assert not torch.equal(base, original) and torch.allclose(base, original, atol=0.1)
    lines = []
    report = check_model(model_dir, 2, 3, 10, tolerance=1e-10, settings=settings, announce=lines.append)
    assert report.passed and max(report.naive_errors) > 1e-4, report.table()
    assert "LoRA r=4" in report.model and "4-bit nf4" in report.model and "LoRA r=4" in lines[0]


def test_the_settings_from_the_command_line_and_a_recipe_config(model_dir, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    common = ["check", "--model", model_dir, "--micro-batch-size", "2", "--accumulation-steps", "3", "--examples", "8"]
    assert cli.main([*common, "--lora-r", "2", "--lora-target-modules", "q_proj", "--quantization", "8bit"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "LoRA r=2 alpha=4 on q_proj, 8-bit base" in out and "PASS" in out and "peak memory" in out
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model:\n  name_or_path: {model_dir}\nlora:\n  r: 3\n  lora_alpha: 6\n  lora_dropout: 0.1\n"
                      "  target_modules: [k_proj]\n")
    assert cli.main(["check", "--config", str(recipe), "lora.r=5", "--micro-batch-size", "2", "--examples", "8"]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=5 alpha=6 on k_proj" in out and "2 of 4 layers" in out and "PASS" in out, out


@pytest.mark.parametrize("extra,message", [
    (["--lora-alpha", "8"], "go with --lora-r"),
    (["--quantization", "4bit"], "go with --lora-r"),
    (["--lora-r", "0"], "--lora-r 0: must be >= 1"),
])
def test_bad_settings_are_refused_before_loading(model_dir, capsys, extra, message):
    assert cli.main(["check", "--model", model_dir, *extra]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert message in captured.err and "estimated" not in captured.out


def test_vocabulary_matrices_tied_and_untied():
    tied = Qwen2ForCausalLM(Qwen2Config(vocab_size=11, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    assert [tuple(p.shape) for p in vocabulary_matrices(tied)] == [(11, 8)]
    tied.config.tie_word_embeddings = False
    untied = Qwen2ForCausalLM(tied.config)
    assert len(vocabulary_matrices(untied)) == 2


def test_the_time_estimate_follows_this_machines_measured_gemm_rate(model_dir, monkeypatch):
    """The estimate's rate is a fixed share of one core's measured float64 GEMM rate (2x the rate: the compute part
    of the estimate halves); with the peak pinned (the suite's HF_ACCUM_PEAK_FLOPS) no probe runs."""
    from hf_accum.measure import peak_flops
    from hf_accum.testing import check

    checked = _checked_model(model_dir, layers=2)
    monkeypatch.delenv("HF_ACCUM_PEAK_FLOPS", raising=False)
    compute = []
    for rate in (1e10, 2e10):
        monkeypatch.setattr(peak_flops, "core_gemm_rate", lambda dtype, rate=rate: peak_flops.GemmRate(rate, "test"))
        compute.append(check.estimate_cost(checked, 2, 3, 10).seconds - check._FIXED_SECONDS)
    assert compute[0] == pytest.approx(2 * compute[1]) and compute[0] > 0
    monkeypatch.setenv("HF_ACCUM_PEAK_FLOPS", "1e12")
    monkeypatch.setattr(peak_flops, "core_gemm_rate", lambda dtype: pytest.fail("probed although pinned"))
    assert check._effective_flops() == check._FLOPS_PER_SECOND
