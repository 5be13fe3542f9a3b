"""Gemma 4 trains, exactly, in both front-ends, and its model FLOPs come from each layer's own config.

Gemma 4's config is heterogeneous (transformers' ``per_layer_config``): its full-attention layers have another
head dim (``global_head_dim``), and reading ``config.head_dim`` from the global config raises
``AmbiguousGlobalPerLayerAttributeError``. The throughput meter once did exactly that and killed every Gemma 4 run
before its first step (issue 36). Here: the per-layer FLOP count (by hand and against
``torch.utils.flop_counter``), other per-layer layouts read from configs alone (linear attention, MLA, windows),
and float64 exactness (< 1e-10 against the big-batch reference of :class:`hf_accum.verify.BigBatchAuditor`) of
``Gemma4ForCausalLM`` and of the multimodal ``Gemma4ForConditionalGeneration`` on text batches, with the naive
loop as the negative control.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.measure.utilization import AttentionLayer, CannotCountAttention, ModelFlops, attention_layers
from hf_accum.testing import PAD, VOCAB, Scenario, random_rows, run_exact, run_naive, run_trainer
from hf_accum.testing.float64 import float64_arithmetic
from hf_accum.testing.models import TEST_SHAPE

EXACT = 1e-10
NAIVE_IS_WRONG = 1e-3
HEADS = TEST_SHAPE["num_attention_heads"]  # 4 query heads, 2 key-value heads, hidden 32, 2 layers
SLIDING_HEAD_DIM, FULL_HEAD_DIM, WINDOW = 8, 16, 8


def _text_config(**overrides) -> Gemma4TextConfig:
    values = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, head_dim=SLIDING_HEAD_DIM,
                  global_head_dim=FULL_HEAD_DIM, sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=VOCAB,
                  hidden_size_per_layer_input=8, **TEST_SHAPE)
    values.update(overrides)
    return Gemma4TextConfig(**values)


def gemma4(**overrides) -> Gemma4ForCausalLM:
    torch.manual_seed(0)
    return Gemma4ForCausalLM(_text_config(**overrides)).double()


def gemma4_multimodal() -> torch.nn.Module:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    torch.manual_seed(0)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
    special = dict(image_token_id=VOCAB - 1, boi_token_id=VOCAB - 2, eoi_token_id=VOCAB - 3, video_token_id=VOCAB - 4,
                   audio_token_id=VOCAB - 5, boa_token_id=VOCAB - 6, eoa_token_index=VOCAB - 7)
    config = Gemma4Config(text_config=_text_config(), vision_config=vision, audio_config=None, **special)
    return Gemma4ForConditionalGeneration(config).double()


def test_the_global_config_has_no_head_dim_to_read():
    """Why the count reads each layer's config: the global one refuses (what crashed the meter)."""
    config = _text_config()
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        _ = config.head_dim
    assert [layer.head_dim for layer in config.per_layer_config] == [SLIDING_HEAD_DIM, FULL_HEAD_DIM]


def test_attention_flops_come_from_each_layer_by_hand():
    flops = ModelFlops.of(gemma4())
    assert flops.attention == (AttentionLayer(HEADS * 8, HEADS * 8, window=WINDOW), AttentionLayer(HEADS * 16, HEADS * 16))
    # Two sequences shorter than the window (5 and 7 tokens): both layers count the full squares, 12 L^2 d each.
    tokens, squares = 12, 5**2 + 7**2
    by_hand = 12 * squares * HEADS * (8 + 16)
    assert sum(layer.flops(tokens, squares) for layer in flops.attention) == by_hand
    # One sequence of 20 tokens: the sliding layer sees at most 8 keys per query (20 x 8 pairs), the full one 20^2.
    assert sum(layer.flops(20, 400) for layer in flops.attention) == 12 * HEADS * (8 * 20 * 8 + 16 * 400)
    # The whole update: the linear layers (per token) and the head (per target) on top.
    linears = 6 * (flops.body * tokens + flops.head * 9)
    assert flops.update_flops(tokens, 9, squares) == linears + by_hand


def test_gemma4_count_matches_the_flop_counter():
    """Sequences within the window: what ran (eager attention, one forward + backward) is what the formula says."""
    model = gemma4(sliding_window=16, attn_implementation="eager")
    ids = torch.randint(3, 60, (3, 10), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.sum().backward()
    assert counter.get_total_flops() == ModelFlops.of(model).update_flops(30, 30, 3 * 10**2)


def test_other_per_layer_layouts_read_from_the_config():
    from transformers import DeepseekV3Config, MistralConfig, Qwen3NextConfig

    hybrid = Qwen3NextConfig(num_hidden_layers=4, num_attention_heads=4, head_dim=8,
                             layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    assert attention_layers(hybrid) == (AttentionLayer(32, 32),)  # linear attention: no L^2 term
    mla = DeepseekV3Config(num_hidden_layers=2, num_attention_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=12)
    assert attention_layers(mla) == (AttentionLayer(4 * 24, 4 * 12),) * 2
    windowed = MistralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, sliding_window=64)
    assert attention_layers(windowed) == (AttentionLayer(32, 32, window=64),) * 2


def test_attention_of_unknown_cost_is_not_guessed():
    """Sparse attention (DeepSeek-V3.2's indexed_attention) does not compute the square: no count, not a wrong one."""
    from transformers import AutoConfig

    sparse = AutoConfig.for_model("deepseek_v32", num_hidden_layers=2)
    with pytest.raises(CannotCountAttention, match="'indexed_attention'"):
        attention_layers(sparse)
    unplaced = AutoConfig.for_model("mistral", num_hidden_layers=2, layer_types=None)
    unplaced.mamba_d_state = 16  # a hybrid state-space config without layer_types: which layer attends is unknown
    with pytest.raises(CannotCountAttention, match="state-space"):
        attention_layers(unplaced)


def _scenario(factory) -> Scenario:
    return Scenario("gemma4", factory, random_rows(22, seed=41, prompt_masking=True), PaddingCollator(PAD))


@pytest.mark.parametrize("factory", [gemma4, pytest.param(gemma4_multimodal, marks=pytest.mark.slow)])
def test_loop_is_exact_on_gemma4(factory):
    with float64_arithmetic():
        result, auditor = run_exact(_scenario(factory))
    assert len(auditor.records) == len(result.updates) == 3
    assert auditor.max_relative_error < EXACT, [r.relative_error for r in auditor.records]
    assert all(update.flops and update.flops > 0 for update in result.updates)  # the meter counted every update
    assert result.utilization["mfu"] is not None


@pytest.mark.slow
@pytest.mark.parametrize("factory", [gemma4, gemma4_multimodal])
def test_accum_trainer_is_exact_on_gemma4(factory, tmp_path):
    with float64_arithmetic():
        run = run_trainer(_scenario(factory), str(tmp_path), AccumTrainer)
    assert len(run.errors) == 3 and run.max_error < EXACT, run.errors
    assert run.trainer.utilization["mfu"] is not None


@pytest.mark.slow
def test_naive_loop_is_wrong_on_gemma4():
    """Negative control: the same audit fails the classic loop."""
    with float64_arithmetic():
        assert run_naive(_scenario(gemma4)).max_relative_error > NAIVE_IS_WRONG
