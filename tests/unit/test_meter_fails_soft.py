"""A meter never stops training (issue 36): when the model FLOPs, the peak or the timing cannot be had, both
front-ends train on, exactly, one warning says which number is missing and why, and no MFU is reported.

Each failure is forced with monkeypatch at the place the meter calls it; without the fail-soft entry points of
:mod:`hf_accum.measure.utilization` every one of these runs raised before (or during) its first update.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.measure import utilization
from hf_accum.measure.peak_flops import PeakFlops
from hf_accum.measure.utilization import ModelFlops, UtilizationMeter, describe, summarize
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_trainer, tiny_causal_lm

EXACT = 1e-10
LOGGER = "hf_accum.measure.utilization"


class Unreadable(RuntimeError):
    pass


def _scenario() -> Scenario:
    return Scenario("meter", tiny_causal_lm, random_rows(8, seed=3), PaddingCollator(PAD), micro_batch=2,
                    accumulation=2, loop_kwargs={"peak_flops": 1e9})


def _missing_lines(caplog, number: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and r.getMessage().startswith(number)
            and "not reported" in r.getMessage()]


def _break_the_count(monkeypatch):
    def update_flops(self, tokens, head_rows, squared_lengths):
        raise Unreadable("per-layer head_dim")

    monkeypatch.setattr(ModelFlops, "update_flops", update_flops)


def test_loop_trains_when_the_flop_count_raises(monkeypatch, caplog):
    _break_the_count(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result, auditor = run_exact(_scenario())
    assert len(result.updates) == 2 and auditor.max_relative_error < EXACT
    assert all(u.flops is None and u.mfu is None for u in result.updates)
    assert result.utilization["mfu"] is None and describe(result.utilization) == "model FLOPs not counted"
    lines = _missing_lines(caplog, "model FLOPs")
    assert len(lines) == 1 and "Unreadable: per-layer head_dim" in lines[0], lines


def test_accum_trainer_trains_when_the_flop_count_raises(monkeypatch, caplog, tmp_path):
    _break_the_count(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run = run_trainer(_scenario(), str(tmp_path), AccumTrainer, trainer_kwargs={"peak_flops": 1e9})
    assert len(run.errors) == 2 and run.max_error < EXACT
    assert all(u.flops is None for u in run.trainer.updates) and run.trainer.utilization["mfu"] is None
    assert not any("mfu" in log for log in run.update_logs)
    lines = _missing_lines(caplog, "model FLOPs")
    assert len(lines) == 1 and "per-layer head_dim" in lines[0], lines


def test_loop_trains_when_the_model_cannot_be_read(monkeypatch, caplog):
    def of(cls, model):
        raise Unreadable("'head_dim' is a per-layer attribute")

    monkeypatch.setattr(ModelFlops, "of", classmethod(of))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result, auditor = run_exact(_scenario())
    assert len(result.updates) == 2 and auditor.max_relative_error < EXACT
    assert all(u.flops is None for u in result.updates)
    lines = _missing_lines(caplog, "model FLOPs")
    assert len(lines) == 1 and "LlamaForCausalLM" in lines[0] and "per-layer attribute" in lines[0], lines


def test_both_front_ends_train_when_the_peak_raises(monkeypatch, caplog, tmp_path):
    def device_peak_flops(*args, **kwargs):
        raise Unreadable("no cpuinfo")

    monkeypatch.setattr("hf_accum.measure.utilization.device_peak_flops", device_peak_flops)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result, auditor = run_exact(_scenario())
    assert auditor.max_relative_error < EXACT
    assert all(u.flops and u.flops_per_second and u.mfu is None for u in result.updates)  # FLOPs kept, no MFU
    assert result.utilization["mfu"] is None and "MFU n/a" in describe(result.utilization)
    lines = _missing_lines(caplog, "MFU")
    assert len(lines) == 1 and "no cpuinfo" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run = run_trainer(_scenario(), str(tmp_path), AccumTrainer)
    assert run.max_error < EXACT and run.trainer.utilization["mfu"] is None
    assert len(_missing_lines(caplog, "MFU")) == 1


def test_the_meter_survives_a_failing_clock(caplog):
    def clock() -> float:
        raise OSError("clock gone")

    meter = UtilizationMeter(PeakFlops(1e9, "configured"), world_size=1, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        meter.start()
        assert meter.lap(1e9) == {} and meter.lap(1e9) == {} and meter.take_interval() == {}
    lines = _missing_lines(caplog, "update time")
    assert len(lines) == 1 and "OSError: clock gone" in lines[0]


def test_summary_and_end_line_survive_bad_records(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        summary = summarize([{"flops": "many", "seconds": 1.0}], PeakFlops(1e9, "configured"), 1)
    assert summary["mfu"] is None and summary["flops_per_update"] is None
    assert "not summarized" in summary["peak_flops_source"] and len(_missing_lines(caplog, "the run's")) == 1
    assert describe({"flops_per_update": "many"}).startswith("utilization not reported")


@pytest.fixture(autouse=True)
def nothing_said_yet(monkeypatch):
    monkeypatch.setattr(utilization, "_said", set())


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
