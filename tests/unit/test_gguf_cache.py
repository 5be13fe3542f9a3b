"""No silent costs (issue 40 item 5): converting a GGUF model says where it writes, how large, and how to move or
clear the cache *before* writing anything; ``hf-accum cache`` lists and clears the converted copies under
``$HF_ACCUM_CACHE``. The GGUF reader is stood in for by a tiny model (the conversion around it is the real code)."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_accum import cli, gguf


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A file named .gguf whose 'loading' gives a tiny Llama and a word-level tokenizer."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(32)}, unk_token="t0")))
    monkeypatch.setattr(gguf, "load_gguf_model", lambda source, dtype=torch.float32: model)
    monkeypatch.setattr(gguf, "load_gguf_tokenizer", lambda source: tokenizer)
    path = tmp_path / "Tiny.Q4_0.gguf"
    path.write_bytes(b"GGUF fake content")
    monkeypatch.setenv(gguf.CACHE_ENV, str(tmp_path / "cache"))
    return gguf.GgufSource(str(tmp_path), path.name), model


def test_the_conversion_says_where_how_large_and_how_to_clear_before_writing(fake_gguf, tmp_path, capsys):
    source, model = fake_gguf
    root = tmp_path / "cache" / "gguf"
    seen: list[tuple[str, bool]] = []
    target = gguf.converted_dir(source, announce=lambda line: seen.append((line, root.exists() and any(root.iterdir()))))
    assert len(seen) == 1 and seen[0][1] is False, seen  # announced while nothing was written yet
    line = seen[0][0]
    size = sum(p.numel() * 4 for p in model.parameters())
    assert target.startswith(str(root)) and target in line and "Tiny.Q4_0.gguf" in line
    assert f"{size / 2**20:.0f} MiB" in line and gguf.CACHE_ENV in line and "hf-accum cache clear" in line
    assert os.path.isfile(os.path.join(target, "config.json"))
    # The written copy is about as large as announced (weights + config + tokenizer).
    assert size <= gguf.cached_conversions()[0].size < size + 2**20
    # Reused: no second conversion, nothing said. The default announcement goes to stderr.
    assert gguf.converted_dir(source, announce=lambda line: seen.append((line, True))) == target and len(seen) == 1
    gguf.clear_cache()
    gguf.converted_dir(source)
    assert "converting Tiny.Q4_0.gguf once" in capsys.readouterr().err


def test_hf_accum_cache_lists_and_clears(fake_gguf, tmp_path, capsys):
    source, _ = fake_gguf
    assert cli.main(["cache"]) == 0
    assert "0 converted GGUF model(s)" in capsys.readouterr().out
    target = gguf.converted_dir(source, announce=lambda line: None)
    (tmp_path / "cache" / "gguf" / ".converting-left-over").mkdir()  # an interrupted conversion
    assert cli.main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert target in out and source.path in out and "an interrupted conversion" in out
    assert "2 converted GGUF model(s)" in out and str(tmp_path / "cache" / "gguf") in out
    assert cli.main(["cache", "clear"]) == 0
    assert "deleted" in capsys.readouterr().out
    assert not os.path.exists(target) and gguf.cached_conversions() == []
    with pytest.raises(SystemExit) as refused:
        cli.main(["cache", "purge"])
    assert refused.value.code == 2
    assert "invalid choice: 'purge'" in capsys.readouterr().err
