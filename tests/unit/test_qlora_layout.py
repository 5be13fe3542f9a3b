"""4-bit weights keep one layout on every CPU (hf_accum.compat.keep_4bit_training_layout).

bitsandbytes repacks a Linear4bit weight into a CPU inference layout on CPUs with avx512_bf16 when it
runs a no-grad forward in eval mode; saved under ZeRO-3, the repacked weight crashed. These tests
simulate such a CPU (the module's own switch forced on, the repacking done by bitsandbytes' own
function), so they check the same thing whatever CPU runs them.
"""

import pytest
import torch

from hf_accum.compat import keep_4bit_training_layout
from hf_accum.recipe import modeling

bnb = pytest.importorskip("bitsandbytes")


def quantized_tiny_llama():
    from transformers import BitsAndBytesConfig

    tokenizer = modeling.load_tokenizer(modeling.TINY_MODEL)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
    return modeling.load_model(modeling.TINY_MODEL, tokenizer, quantization=quantization, seed=0), tokenizer


def linear4bit_layers(model):
    return [module for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]


def test_a_loaded_4bit_model_never_repacks_in_a_no_grad_evaluation():
    model, tokenizer = quantized_tiny_llama()
    layers = linear4bit_layers(model)
    assert layers and all(layer.support_avx512bf16_for_cpu is False for layer in layers)
    before = {id(layer): layer.weight.data.clone() for layer in layers}
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 7, 9]]))
    for layer in layers:
        assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
        assert torch.equal(layer.weight.data, before[id(layer)])
    assert model.state_dict()  # saving walks every 4-bit layer's _save_to_state_dict


def test_an_already_repacked_weight_is_unpacked_and_the_switch_turned_off():
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    model, _ = quantized_tiny_llama()
    layer = linear4bit_layers(model)[0]
    original = layer.weight.data.clone()
    # What an avx512_bf16 CPU does in an eval forward without grad (bitsandbytes 0.50 Linear4bit.forward).
    layer.support_avx512bf16_for_cpu = True
    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(layer.weight.data,
                                                                                 layer.weight.quant_state)
    assert layer.weight.quant_state.packing_format_for_cpu and not torch.equal(layer.weight.data, original)

    assert keep_4bit_training_layout(model) == len(linear4bit_layers(model))
    assert layer.support_avx512bf16_for_cpu is False
    assert not layer.weight.quant_state.packing_format_for_cpu
    assert torch.equal(layer.weight.data, original)
    assert keep_4bit_training_layout(model) == len(linear4bit_layers(model))  # idempotent


def test_models_without_4bit_layers_are_left_alone():
    assert keep_4bit_training_layout(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 0
