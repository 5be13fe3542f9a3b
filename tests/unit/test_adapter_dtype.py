"""LoRA adapters in the weights' dtype (the recipe's ``model.adapter_dtype``, PEFT's ``autocast_adapter_dtype``):
which runs get them, and that the loop stays exact with them (float64 against the big batch, 1e-10; the naive
``loss / K`` loop fails the same check)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig

from hf_accum.batching import PaddingCollator
from hf_accum.errors import InputError
from hf_accum.recipe.modeling import adapters_in_weight_dtype, apply_lora, check_precision
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_naive, tiny_causal_lm

EXACT = 1e-10
NAIVE_IS_WRONG = 1e-3


def _recipe_lora(dtype: torch.dtype, in_weight_dtype: bool, checkpointing: bool = False) -> torch.nn.Module:
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return apply_lora(tiny_causal_lm(dtype=dtype), lora, quantized=False, gradient_checkpointing=checkpointing,
                      adapter_in_weight_dtype=in_weight_dtype)


def _adapter_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for name, p in model.named_parameters() if "lora_" in name}


def test_bf16_weights_get_bf16_adapters_only_when_asked():
    assert _adapter_dtypes(_recipe_lora(torch.bfloat16, in_weight_dtype=True)) == {torch.bfloat16}
    assert _adapter_dtypes(_recipe_lora(torch.bfloat16, in_weight_dtype=False)) == {torch.float32}  # PEFT's upcast


@pytest.mark.parametrize(("setting", "weights", "on_cpu", "expected"), [
    ("auto", "bfloat16", True, True), ("auto", "bfloat16", False, False), ("auto", "float32", True, False),
    ("auto", "float16", True, False), ("float32", "bfloat16", True, False), ("weights", "bfloat16", False, True),
])
def test_auto_keeps_the_weight_dtype_for_bf16_on_cpu_only(setting, weights, on_cpu, expected):
    assert adapters_in_weight_dtype(setting, weights, on_cpu) is expected


@pytest.mark.parametrize("checkpointing", [False, True])
def test_loop_with_adapters_in_the_weight_dtype_is_exact_in_float64(checkpointing):
    scenario = Scenario(f"lora_weight_dtype_ckpt{checkpointing}",
                        lambda: _recipe_lora(torch.float64, in_weight_dtype=True, checkpointing=checkpointing),
                        random_rows(16, seed=41, prompt_masking=True), PaddingCollator(PAD))
    model = scenario.model_factory()
    assert _adapter_dtypes(model) == {torch.float64}
    result, auditor = run_exact(scenario)
    assert len(auditor.records) == len(result.updates) > 0
    assert auditor.max_relative_error < EXACT, [r.relative_error for r in auditor.records]
    assert run_naive(scenario).max_relative_error > NAIVE_IS_WRONG  # negative control


def test_bf16_adapters_accumulate_close_to_the_float64_big_batch():
    """bf16 adapters are low-precision weights to the loop: their K=16 gradients are summed in fp32 and
    rounded once, so the applied gradient is the big batch's to bf16 precision (measured 0.028: bf16 forward
    and backward through every layer), where the naive loop is off by its token-count weighting."""
    scenario = Scenario(
        "bf16_adapters", lambda: _recipe_lora(torch.bfloat16, in_weight_dtype=True), random_rows(16, seed=42),
        PaddingCollator(PAD), micro_batch=1, accumulation=16, lr=0.0, reference_dtype=torch.float64,
    )
    _, auditor = run_exact(scenario)
    assert auditor.max_relative_error < 5e-2
    assert run_naive(scenario).max_relative_error > 0.1


def test_an_unknown_adapter_dtype_is_refused_by_name():
    config = SimpleNamespace(training=SimpleNamespace(use_cpu=True, bf16=False, fp16=False),
                             model=SimpleNamespace(dtype="bfloat16", adapter_dtype="fp8"))
    with pytest.raises(InputError, match="model.adapter_dtype='fp8'; allowed: auto, float32, weights"):
        check_precision(config)  # type: ignore[arg-type]
