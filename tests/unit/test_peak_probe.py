"""The CPU peak is the hardware's (issue 38): best of several short one-thread probes, cached per machine, always
printed with its source; a cache that cannot be written does not stop a run (that a busy neighbour process does
not lower it: tests/integration/test_fresh_processes.py).
And the half-precision check: one start-up line when bf16/fp16 GEMMs are slower than float32 ones, none when not.

Every test points ``$HF_ACCUM_CACHE`` at its own folder and forgets the process's rates, so none reads or
writes the user's cache. The probe itself is faked where a test reads its rate.
"""

from __future__ import annotations

import datetime
import json
import logging
import os

import pytest
import torch

from hf_accum.batching import PaddingCollator
from hf_accum.measure import peak_flops, utilization
from hf_accum.measure.peak_flops import (
    CACHE_ENV,
    PEAK_FLOPS_ENV,
    GemmRate,
    cache_path,
    core_gemm_rate,
    device_peak_flops,
    half_precision_slowdown,
)
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_trainer, tiny_causal_lm

TODAY = datetime.date.today().isoformat()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    monkeypatch.setattr(peak_flops, "_rates", {})
    monkeypatch.setattr(peak_flops, "_said_cache_problem", False)
    monkeypatch.setattr(utilization, "_said", set())


class FakeProbe:
    """``cpu_gemm_peak`` returning ``rates[dtype]`` and recording each call's probes."""

    def __init__(self, monkeypatch, rates: dict[torch.dtype, float]) -> None:
        self.rates, self.calls = rates, []
        monkeypatch.setattr(peak_flops, "cpu_gemm_peak", self)

    def __call__(self, dtype=torch.float32, threads=None, budget_s=0.5, probes=peak_flops.PROBES) -> float:
        self.calls.append((dtype, threads, probes))
        return self.rates[dtype]


def _forget_process_rates(monkeypatch):
    monkeypatch.setattr(peak_flops, "_rates", {})


def test_measured_once_then_cached_per_machine(monkeypatch):
    probe = FakeProbe(monkeypatch, {torch.float32: 100e9})
    first = core_gemm_rate(torch.float32)
    assert first.flops == 100e9 and first.source == f"measured {TODAY}, best of 5 probes on 1 thread"
    assert probe.calls == [(torch.float32, 1, 5)]
    entries = json.loads(cache_path().read_text())["entries"]
    (key,) = entries
    assert peak_flops.cpu_identity() in key and "float32" in key and torch.__version__ in key
    assert core_gemm_rate(torch.float32) is first and len(probe.calls) == 1  # this process: no probe at all
    _forget_process_rates(monkeypatch)
    probe.rates[torch.float32] = 90e9  # a later start on a busier machine: one quick probe, the cache stays
    cached = core_gemm_rate(torch.float32)
    assert cached.flops == 100e9 and cached.source == f"cached in {cache_path()}: measured {TODAY}, best of 5 probes on 1 thread"
    assert probe.calls[-1] == (torch.float32, 1, 1)


def test_a_faster_probe_raises_the_cached_rate(monkeypatch):
    probe = FakeProbe(monkeypatch, {torch.float32: 30e9})  # the first measurement, on a busy machine
    core_gemm_rate(torch.float32)
    _forget_process_rates(monkeypatch)
    probe.rates[torch.float32] = 100e9
    healed = core_gemm_rate(torch.float32)
    assert healed.flops == 100e9 and "best of 6 probes" in healed.source
    assert next(iter(json.loads(cache_path().read_text())["entries"].values()))["flops"] == 100e9


def test_another_cpu_is_measured_afresh(monkeypatch):
    probe = FakeProbe(monkeypatch, {torch.float32: 100e9})
    core_gemm_rate(torch.float32)
    _forget_process_rates(monkeypatch)
    monkeypatch.setattr(peak_flops, "cpu_identity", lambda: "Another CPU (family 6 model 143), flags 0123")
    probe.rates[torch.float32] = 400e9
    other = core_gemm_rate(torch.float32)
    assert other.flops == 400e9 and other.source.startswith("measured") and probe.calls[-1][2] == 5
    assert len(json.loads(cache_path().read_text())["entries"]) == 2


def test_a_read_only_cache_degrades_and_says_so_once(monkeypatch, caplog):
    def read_only(*args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(peak_flops.tempfile, "NamedTemporaryFile", read_only)
    FakeProbe(monkeypatch, {torch.float32: 100e9, torch.bfloat16: 200e9})
    with caplog.at_level(logging.WARNING, logger="hf_accum.measure.peak_flops"):
        assert core_gemm_rate(torch.float32).flops == 100e9
        assert core_gemm_rate(torch.bfloat16).flops == 200e9
    warnings = [r.getMessage() for r in caplog.records if "cache" in r.getMessage()]
    assert len(warnings) == 1 and "not written (PermissionError" in warnings[0] and CACHE_ENV in warnings[0]


def test_a_cache_folder_that_cannot_exist_degrades_and_says_so_once(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # a folder under a file (unwritable for root too)
    FakeProbe(monkeypatch, {torch.float32: 100e9, torch.bfloat16: 200e9})
    with caplog.at_level(logging.WARNING, logger="hf_accum.measure.peak_flops"):
        assert core_gemm_rate(torch.float32).flops == 100e9
        assert core_gemm_rate(torch.bfloat16).flops == 200e9
    warnings = [r.getMessage() for r in caplog.records if "cache" in r.getMessage()]
    assert len(warnings) == 1 and "NotADirectoryError" in warnings[0], warnings


def test_a_corrupt_cache_is_measured_again(monkeypatch, caplog):
    cache_path().parent.mkdir(parents=True)
    cache_path().write_text("{not json")
    FakeProbe(monkeypatch, {torch.float32: 100e9})
    with caplog.at_level(logging.WARNING, logger="hf_accum.measure.peak_flops"):
        assert core_gemm_rate(torch.float32).source.startswith("measured")
    assert "not read" in caplog.text
    assert len(json.loads(cache_path().read_text())["entries"]) == 1  # rewritten whole


def test_every_peak_names_its_source(monkeypatch):
    FakeProbe(monkeypatch, {torch.float32: 100e9})
    monkeypatch.setattr(peak_flops, "cores_for", lambda threads: 2)
    cpu = device_peak_flops("cpu", torch.float32)
    assert cpu.flops == 200e9
    assert cpu.source == f"2 core(s) x one core's GEMM, measured {TODAY}, best of 5 probes on 1 thread"
    assert "200 GFLOP/s float32 (2 core(s) x one core's GEMM, measured" in cpu.describe()
    assert device_peak_flops("cpu", torch.float32, 5e12, "accumulation.peak_flops").source == \
        "configured accumulation.peak_flops"
    monkeypatch.setenv(PEAK_FLOPS_ENV, "7e11")
    assert device_peak_flops("cpu", torch.float32).source == f"configured by ${PEAK_FLOPS_ENV}"
    monkeypatch.delenv(PEAK_FLOPS_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = device_peak_flops("cuda", torch.bfloat16)
    assert gpu.flops == pytest.approx(989.4e12) and gpu.source.endswith("(table)")


def test_cores_count_physical_cores_of_the_threads(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert peak_flops.cores_for(1) == 1
    alone = peak_flops.cores_for(10_000)
    assert 1 <= alone <= (os.cpu_count() or 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes of a run on this machine: each its share
    assert peak_flops.cores_for(10_000) == max(1, alone // 2)


# -- the half-precision check --------------------------------------------------------------------------------


def _fake_rates(monkeypatch, fp32: float, bf16: float):
    rates = {torch.float32: fp32, torch.bfloat16: bf16}
    monkeypatch.setattr(peak_flops, "core_gemm_rate", lambda dtype=torch.float32: GemmRate(rates[dtype], "faked"))


def test_slow_bf16_is_named_with_the_measured_ratio(monkeypatch):
    _fake_rates(monkeypatch, fp32=40e9, bf16=0.5e9)
    line = half_precision_slowdown("cpu", torch.bfloat16)
    assert line is not None and "0.013x float32" in line and "(0.5 vs 40.0 GFLOP/s" in line and "~80x" in line
    assert half_precision_slowdown("cpu", torch.float32) is None  # float32 compute: nothing to say
    _fake_rates(monkeypatch, fp32=40e9, bf16=110e9)
    assert half_precision_slowdown("cpu", torch.bfloat16) is None


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "GEMMs on this CPU run at" in r.getMessage()]


def _bf16_scenario() -> Scenario:
    return Scenario("bf16", lambda: tiny_causal_lm(dtype=torch.float32), random_rows(4, seed=3),
                    PaddingCollator(PAD), micro_batch=2, accumulation=2,
                    accelerator_kwargs={"mixed_precision": "bf16"}, args={"bf16": True}, loop_kwargs={"peak_flops": 1e9})


@pytest.mark.parametrize("slow", [True, False])
def test_loop_start_warns_once_when_bf16_is_slower(monkeypatch, caplog, slow):
    _fake_rates(monkeypatch, fp32=40e9, bf16=0.5e9 if slow else 110e9)
    with caplog.at_level(logging.WARNING):
        result, _ = run_exact(_bf16_scenario())
        run_exact(_bf16_scenario())  # a second run in the process (the recipe's memory probes): said once
    assert len(result.updates) == 1
    lines = _warnings(caplog)
    if slow:
        assert len(lines) == 1 and "bfloat16 GEMMs on this CPU run at 0.013x" in lines[0], lines
        assert "Accelerator(mixed_precision='no')" in lines[0] and "training.bf16=false" in lines[0]
    else:
        assert lines == []


def test_accum_trainer_start_warns_once_when_bf16_is_slower(monkeypatch, caplog, tmp_path):
    _fake_rates(monkeypatch, fp32=40e9, bf16=0.5e9)
    with caplog.at_level(logging.WARNING):
        run_trainer(_bf16_scenario(), str(tmp_path), _accum_trainer(), trainer_kwargs={"peak_flops": 1e9})
    lines = _warnings(caplog)
    assert len(lines) == 1 and "TrainingArguments(bf16=False)" in lines[0], lines


def _accum_trainer():
    from hf_accum import AccumTrainer

    return AccumTrainer
