"""``hf-accum check --model DIR`` beyond causal LMs (issue 36 item 3): saved tiny encoder-decoders (T5, BART),
image-text-to-text models (LLaVA, Qwen2-VL: a synthetic image batch of the model's own shapes) and Gemma 4 (its
per-layer embedding sized by the layer count) PASS at 1e-10 on the default 2-layer cut of their 3 layers, the naive
loop's error beside; the cut keeps the checkpoint's own weights (Gemma 4's per-layer slice included)."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hf_accum import cli
from hf_accum.errors import EXIT_OK
from hf_accum.testing.check import _checked_model, check_model
from hf_accum.testing.check_kinds import IMAGE_TEXT, SEQ2SEQ, ImageTextCollator, check_data, synthetic_image

EXACT = 1e-10
DECODER = dict(vocab_size=61, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=16, intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, image_size=8,
            patch_size=4, projection_dim=16)
QWEN2_VL_VISION = dict(depth=3, embed_dim=16, hidden_size=16, num_heads=2, patch_size=2, temporal_patch_size=2,
                       spatial_merge_size=2, in_channels=3, mlp_ratio=2)
QWEN2_VL_TEXT = dict(DECODER, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 0],
                                               "rope_theta": 10000.0})


def _models() -> dict[str, torch.nn.Module]:
    """Each family at 3 layers per stack (the default cut keeps 2), random init."""
    t = transformers
    return {
        "t5": t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=61, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_decoder_layers=3, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0)),
        "bart": t.BartForConditionalGeneration(t.BartConfig(
            vocab_size=61, d_model=16, encoder_layers=3, decoder_layers=3, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)),
        "llava": t.LlavaForConditionalGeneration(t.LlavaConfig(
            vision_config=t.CLIPVisionConfig(**CLIP), text_config=t.LlamaConfig(**DECODER), image_token_id=60)),
        "qwen2_vl": t.Qwen2VLForConditionalGeneration(t.Qwen2VLConfig(
            text_config=QWEN2_VL_TEXT, vision_config=QWEN2_VL_VISION, image_token_id=59, video_token_id=58,
            vision_start_token_id=57, vision_end_token_id=56)),
        "gemma4": t.Gemma4ForCausalLM(t.Gemma4TextConfig(
            **DECODER, head_dim=8, global_head_dim=8, sliding_window=8, vocab_size_per_layer_input=61,
            hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    }


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    torch.manual_seed(0)
    dirs = {}
    for name, model in _models().items():
        model.save_pretrained(root / name)  # float32 on disk, as users have them
        dirs[name] = str(root / name)
    return dirs


KEPT = {
    "t5": "encoder 2 of 3, decoder 2 of 3 layers",
    "bart": "encoder 2 of 3, decoder 2 of 3 layers",
    "llava": "text 2 of 3, vision 2 of 3 layers",
    "qwen2_vl": "text 2 of 3, vision 2 of 3 layers",
    "gemma4": "2 of 3 layers",
}


@pytest.mark.parametrize("family", list(KEPT))
def test_check_passes_on_saved_seq2seq_vlm_and_gemma4(model_dirs, family):
    lines: list[str] = []
    report = check_model(model_dirs[family], micro_batch=2, accumulation=3, n_examples=10, tolerance=EXACT,
                         announce=lines.append)
    assert len(report.exact_errors) == 2 and report.passed, report.table()
    assert max(report.naive_errors) > 1e-2, report.table()  # the naive loop's loss / K, caught on the same model
    assert f"({KEPT[family]}" in report.model and KEPT[family] in lines[0]


def test_the_command_line_passes_on_a_vlm(model_dirs, capsys):
    args = ["check", "--model", model_dirs["qwen2_vl"], "--micro-batch-size", "2", "--accumulation-steps", "3",
            "--examples", "8", "--tolerance", str(EXACT)]
    assert cli.main(args) == EXIT_OK
    out = capsys.readouterr().out
    assert "PASS" in out and "vs naive" in out and "text 2 of 3, vision 2 of 3 layers" in out


def test_the_cut_keeps_the_checkpoints_weights_per_layer_slices_included(model_dirs):
    """Gemma 4's per-layer input embedding is num_layers x 8 wide: the 2-layer cut holds the checkpoint's first
    16 columns (not a random re-initialisation), every other kept weight exactly the checkpoint's."""
    checked = _checked_model(model_dirs["gemma4"], layers=2)
    cut = checked.factory()
    stored = load_file(f"{model_dirs['gemma4']}/model.safetensors")
    weights = cut.state_dict()
    assert weights["model.embed_tokens_per_layer.weight"].shape == (61, 16)
    for name, value in weights.items():
        if name in stored:
            expected = stored[name][tuple(slice(0, size) for size in value.shape)].double()
            assert torch.equal(value, expected), name
    assert torch.equal(weights["model.per_layer_model_projection.weight"],
                       stored["model.per_layer_model_projection.weight"][:16].double())


def test_vlm_rows_carry_the_models_own_image_shapes(model_dirs):
    """LLaVA: 8x8 images of 4 patches (CLS dropped) -> 4 image tokens; Qwen2-VL: a 4x4 grid of 2x2x2 patches of 3
    channels merged 2x2 -> 16 patch rows of 24 values and 4 tokens, its image_grid_thw and mm_token_type_ids.
    Text tokens never hit an image or vision id."""
    llava = _checked_model(model_dirs["llava"], layers=2)
    assert synthetic_image(llava.config, "llava").shape == (3, 8, 8)
    assert synthetic_image(llava.config, "llava").tokens == 4
    qwen = _checked_model(model_dirs["qwen2_vl"], layers=2)
    data = check_data(IMAGE_TEXT, qwen.config, qwen.model_class, 6, 0, 32, qwen.vocab_size, qwen.pad_token_id)
    assert isinstance(data.collator, ImageTextCollator)
    batch = data.collator(data.examples[:2])
    assert batch["pixel_values"].shape == (2 * 16, 24) and batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 2
    assert batch["mm_token_type_ids"].sum(dim=1).tolist() == [4, 4]
    text = torch.cat([torch.tensor(row["input_ids"][4:]) for row in data.examples])
    assert not torch.isin(text, torch.tensor([56, 57, 58, 59])).any()


def test_seq2seq_rows_avoid_the_special_ids(model_dirs):
    t5 = _checked_model(model_dirs["t5"], layers=2)
    assert t5.kind == SEQ2SEQ
    data = check_data(SEQ2SEQ, t5.config, t5.model_class, 20, 0, 32, t5.vocab_size, t5.pad_token_id)
    words = torch.cat([torch.tensor(row["input_ids"] + row["labels"]) for row in data.examples])
    assert not torch.isin(words, torch.tensor([0, 1])).any() and data.loss_kind is None  # inferred: seq2seq
