"""``hf-accum check --model DIR`` on model directories made with ``save_pretrained`` from tiny configs of
12 families: PASS at 1e-10 (float64 without the models' float32 islands, MoE with eager experts and the
router loss in the reference), and distinct exit codes for PASS 0, FAIL 1, bad input 2, cannot run 4."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_accum import cli
from hf_accum.errors import EXIT_BAD_INPUT, EXIT_CANNOT_RUN, EXIT_FAILED, EXIT_OK
from hf_accum.testing.check import check_model
from hf_accum.testing.models import tiny_moe_causal_lm

EXACT = 1e-10
COMMON = {"vocab_size": 61, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DECODER = dict(COMMON, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
# family -> (config class, causal LM class, config values); each as small as transformers allows.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", DECODER),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", DECODER),
    "mistral": ("MistralConfig", "MistralForCausalLM", DECODER),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(DECODER, head_dim=8)),  # soft-capped logits/attention
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(DECODER, logit_scale=0.25)),  # LayerNorm, logit scale
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(COMMON, n_embd=16, n_layer=2, n_head=4, n_positions=64)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        COMMON, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(  # word_embed_proj_dim < hidden: project_in / project_out
        COMMON, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=8,
        max_position_embeddings=64)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(  # lm_head with a bias, partial rotary
        COMMON, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        DECODER, logits_scaling=2.0, residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.3)),
}
MOE = ("mixtral", "qwen2_moe")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Every family saved once (float32 on disk, as users have them)."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for family, (config_name, model_name, values) in FAMILIES.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**values))
        model.save_pretrained(root / family)
        dirs[family] = str(root / family)
    for family in MOE:  # output_router_logits=True, router_aux_loss_coef=0.02
        tiny_moe_causal_lm(family, dtype=torch.float32).save_pretrained(root / family)
        dirs[family] = str(root / family)
    # As MoE checkpoints ship (router logits off): the check turns the router loss on, as fine-tuning does.
    tiny_moe_causal_lm("mixtral", dtype=torch.float32, output_router_logits=False).save_pretrained(root / "shipped")
    dirs["mixtral_as_shipped"] = str(root / "shipped")
    return dirs


@pytest.mark.parametrize("family", [*FAMILIES, *MOE, "mixtral_as_shipped"])
def test_check_passes_every_family(model_dirs, family):
    report = check_model(model_dirs[family], micro_batch=2, accumulation=3, n_examples=10, tolerance=EXACT)
    assert len(report.exact_errors) == 2 and report.passed, report.table()
    assert max(report.naive_errors) > 1e-4  # the naive loop's loss / K is caught on the same model
    assert report.router_loss == (family not in FAMILIES)


def test_exit_codes(model_dirs, tmp_path, capsys):
    args = ["--micro-batch-size", "2", "--accumulation-steps", "3", "--examples", "10"]
    assert cli.main(["check", "--model", model_dirs["gemma2"], *args]) == EXIT_OK
    assert "PASS" in capsys.readouterr().out
    # FAIL: a tolerance nothing meets (the same model, run the same way).
    assert cli.main(["check", "--model", model_dirs["gemma2"], *args, "--tolerance", "0"]) == EXIT_FAILED
    assert "FAIL" in capsys.readouterr().out
    # Bad input: not a directory; a directory without a model.
    assert cli.main(["check", "--model", str(tmp_path / "missing"), *args]) == EXIT_BAD_INPUT
    (tmp_path / "empty").mkdir()
    assert cli.main(["check", "--model", str(tmp_path / "empty"), *args]) == EXIT_BAD_INPUT
    assert "not a loadable local model directory" in capsys.readouterr().err
    # Cannot run: a readable directory holding a model that is no causal LM, seq2seq or image-text-to-text model.
    transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                           image_size=8, patch_size=4).save_pretrained(tmp_path / "vit")
    assert cli.main(["check", "--model", str(tmp_path / "vit"), *args]) == EXIT_CANNOT_RUN
    error = capsys.readouterr().err
    assert "cannot run" in error and "ViTConfig" in error and "not a model the check can train" in error
