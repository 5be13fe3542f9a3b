"""The LoRA adapters' dtype (the recipe's ``model.adapter_dtype``): bf16 adapters (PEFT's
``autocast_adapter_dtype=False``), float32 adapters computed in bf16 (the default, hf_accum.recipe.cpu_bf16) and
PEFT's float32 compute; which runs get which, that the default's gradients are a bf16 adapter's bit for bit while
its weights stay float32, and that the loop stays exact with each (float64 against the big batch, 1e-10; the naive
``loss / K`` loop fails the same check). Also the float32 SDPA the recipe gives bf16 weights on a CPU."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig

from hf_accum.batching import PaddingCollator
from hf_accum.errors import InputError
from hf_accum.recipe.cpu_bf16 import (
    SDPA_FLOAT32,
    InputDtypeLinear,
    register_sdpa_in_float32,
    sdpa_in_float32,
    use_float32_sdpa_for_bf16,
)
from hf_accum.recipe.modeling import adapters_in_weight_dtype, apply_lora, check_precision
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_naive, tiny_causal_lm

EXACT = 1e-10
NAIVE_IS_WRONG = 1e-3


def _recipe_lora(dtype: torch.dtype, in_weight_dtype: bool, checkpointing: bool = False,
                 float32_compute: bool = False, base: torch.nn.Module | None = None) -> torch.nn.Module:
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    model = tiny_causal_lm(dtype=dtype) if base is None else copy.deepcopy(base)
    return apply_lora(model, lora, quantized=False, gradient_checkpointing=checkpointing,
                      adapter_in_weight_dtype=in_weight_dtype, float32_compute=float32_compute)


def _adapter_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith((".lora_A.default", ".lora_B.default"))]


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _adapter_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for name, p in model.named_parameters() if "lora_" in name}


def test_bf16_weights_get_bf16_adapters_only_when_asked():
    assert _adapter_dtypes(_recipe_lora(torch.bfloat16, in_weight_dtype=True)) == {torch.bfloat16}
    assert _adapter_dtypes(_recipe_lora(torch.bfloat16, in_weight_dtype=False)) == {torch.float32}  # PEFT's upcast


@pytest.mark.parametrize(("setting", "weights", "on_cpu", "expected"), [
    ("auto", "bfloat16", True, True), ("auto", "bfloat16", False, False), ("auto", "float32", True, False),
    ("auto", "float16", True, False), ("float32", "bfloat16", True, False), ("weights", "bfloat16", False, True),
    ("float32-compute", "bfloat16", True, False),
])
def test_auto_keeps_the_weight_dtype_for_bf16_on_cpu_only(setting, weights, on_cpu, expected):
    assert adapters_in_weight_dtype(setting, weights, on_cpu) is expected


@pytest.mark.parametrize(("checkpointing", "in_weight_dtype"), [(False, True), (True, True), (False, False)],
                         ids=["weights", "weights_checkpointed", "float32_default"])
def test_loop_with_each_adapter_dtype_is_exact_in_float64(checkpointing, in_weight_dtype):
    scenario = Scenario(f"lora_weight_dtype{in_weight_dtype}_ckpt{checkpointing}",
                        lambda: _recipe_lora(torch.float64, in_weight_dtype=in_weight_dtype,
                                             checkpointing=checkpointing),
                        random_rows(16, seed=41, prompt_masking=True), PaddingCollator(PAD))
    model = scenario.model_factory()
    assert _adapter_dtypes(model) == {torch.float64}
    result, auditor = run_exact(scenario)
    assert all(type(m) is InputDtypeLinear for m in _adapter_linears(model)) is not in_weight_dtype
    assert len(auditor.records) == len(result.updates) > 0
    assert auditor.max_relative_error < EXACT, [r.relative_error for r in auditor.records]
    assert run_naive(scenario).max_relative_error > NAIVE_IS_WRONG  # negative control


@pytest.mark.parametrize("in_weight_dtype", [True, False], ids=["bf16_adapters", "float32_adapters_in_bf16"])
def test_adapters_on_bf16_weights_accumulate_close_to_the_float64_big_batch(in_weight_dtype):
    """bf16 adapters are low-precision weights to the loop: their K=16 gradients are summed in fp32 and
    rounded once; float32 adapters computed in bf16 sum theirs in float32. Either way the applied gradient is the
    big batch's to bf16 precision (measured 0.028: bf16 forward and backward through every layer), where the
    naive loop is off by its token-count weighting."""
    scenario = Scenario(
        f"adapters_in_weight_dtype{in_weight_dtype}", lambda: _recipe_lora(torch.bfloat16, in_weight_dtype),
        random_rows(16, seed=42),
        PaddingCollator(PAD), micro_batch=1, accumulation=16, lr=0.0, reference_dtype=torch.float64,
    )
    _, auditor = run_exact(scenario)
    assert auditor.max_relative_error < 5e-2
    assert run_naive(scenario).max_relative_error > 0.1


def test_an_unknown_adapter_dtype_is_refused_by_name():
    config = SimpleNamespace(training=SimpleNamespace(use_cpu=True, bf16=False, fp16=False),
                             model=SimpleNamespace(dtype="bfloat16", adapter_dtype="fp8"))
    with pytest.raises(InputError, match="model.adapter_dtype='fp8'; allowed: auto, float32, float32-compute, weights"):
        check_precision(config)  # type: ignore[arg-type]


def test_float32_adapters_compute_in_bf16_with_a_bf16_adapters_gradients_bit_for_bit():
    """The default on bf16 weights: the adapters' parameters (what AdamW steps, what is saved) are float32, their
    GEMMs run in bf16 (no activation cast), and each gradient equals that of bf16 adapters holding the same values
    rounded to bf16, exactly; PEFT's float32 compute (the control) differs by bf16's rounding."""
    base = tiny_causal_lm(dtype=torch.bfloat16)
    ids = torch.randint(3, base.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    default = _recipe_lora(torch.bfloat16, in_weight_dtype=False, base=base)
    bf16 = _recipe_lora(torch.bfloat16, in_weight_dtype=True, base=base)
    float32_compute = _recipe_lora(torch.bfloat16, in_weight_dtype=False, float32_compute=True, base=base)
    values = {n: p.detach() for n, p in default.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for model in (bf16, float32_compute):
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.copy_(values[name])
    assert _adapter_dtypes(default) == _adapter_dtypes(float32_compute) == {torch.float32}
    assert default.state_dict().keys() == float32_compute.state_dict().keys()  # saved adapters unchanged
    assert all(type(m) is InputDtypeLinear for m in _adapter_linears(default))
    assert all(type(m) is torch.nn.Linear for m in _adapter_linears(float32_compute))
    seen: list[torch.dtype] = []
    _adapter_linears(default)[0].register_forward_hook(lambda m, i, out: seen.append(i[0].dtype))

    loss, grads = _loss_and_grads(default, ids)
    loss_bf16, grads_bf16 = _loss_and_grads(bf16, ids)
    loss_f32, grads_f32 = _loss_and_grads(float32_compute, ids)
    assert seen == [torch.bfloat16]  # the activations reach the adapter uncast
    assert {g.dtype for g in grads.values()} == {torch.float32}
    assert loss == loss_bf16
    assert max((grads[n] - grads_bf16[n].float()).abs().max().item() for n in grads) == 0.0
    assert max(((grads[n] - grads_f32[n]).norm() / grads_f32[n].norm()).item() for n in grads) > 1e-3


def test_a_small_update_moves_float32_adapters_where_bf16_ones_round_away():
    default = _recipe_lora(torch.bfloat16, in_weight_dtype=False)
    bf16 = _recipe_lora(torch.bfloat16, in_weight_dtype=True)
    moved = []
    for model in (default, bf16):
        adapter = next(p for n, p in model.named_parameters() if "lora_A" in n)
        before = adapter.detach().clone()
        adapter.grad = torch.ones_like(adapter)
        torch.optim.SGD([adapter], lr=1e-6).step()  # 1e-6 of a weight of size ~0.1-1: below bf16's resolution
        moved.append(bool((adapter.detach() != before).any()))
    assert moved == [True, False]


def _attention_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 4, 7, 16, generator=generator).to(dtype)
    key, value = (torch.randn(2, 2, 7, 16, generator=generator).to(dtype) for _ in range(2))  # GQA: 2 KV heads
    mask = torch.zeros(2, 1, 7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    mask[1, :, :, :2] = float("-inf")  # left padding in row 1
    return query, key, value, mask.to(dtype)


def test_sdpa_in_float32_is_transformers_sdpa_on_float32_copies_also_under_autocast():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    query, key, value, mask = _attention_inputs(torch.bfloat16)
    reference, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask.float())
    plain, _ = sdpa_attention_forward(module, query, key, value, mask)  # the bf16 kernel: the control
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            output, _ = sdpa_in_float32(module, query, key, value, mask)  # type: ignore[arg-type]
        assert output.dtype == torch.bfloat16
        assert torch.equal(output, reference.to(torch.bfloat16))
    assert not torch.equal(plain, reference.to(torch.bfloat16))


def test_bf16_weights_get_float32_sdpa_only_by_default_and_it_trains_and_generates():
    register_sdpa_in_float32()
    model = tiny_causal_lm(dtype=torch.float32)
    twin = copy.deepcopy(model)
    assert not use_float32_sdpa_for_bf16(model, requested=None)  # float32 weights: no change
    twin.set_attn_implementation(SDPA_FLOAT32)  # on float32 weights the casts are no-ops: same numbers as sdpa
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    losses = [m(input_ids=ids, attention_mask=mask, labels=ids).loss for m in (model, twin)]
    assert losses[0].item() == losses[1].item()
    generated = [m.generate(ids[:1, :5], max_new_tokens=4, do_sample=False) for m in (model, twin)]
    assert torch.equal(generated[0], generated[1])  # the cached decode path too

    bf16 = tiny_causal_lm(dtype=torch.bfloat16)
    assert not use_float32_sdpa_for_bf16(bf16, requested="sdpa")  # asked for by name: kept
    assert bf16.config._attn_implementation == "sdpa"
    assert use_float32_sdpa_for_bf16(bf16, requested=None)
    assert bf16.config._attn_implementation == SDPA_FLOAT32
