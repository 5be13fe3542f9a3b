"""AccumTrainer under Trainer's own FSDP2 (``TrainingArguments(fsdp="full_shard")``) on 2 real CPU processes
(torchrun, gloo), where Accelerate alone would silently train DDP: every update equals the big-batch update in
float64 (full fine-tuning and LoRA, prompt masking, ~10x uneven per-rank tokens, short last windows); the stock
Trainer given the same arguments runs DDP on CPU and is not exact; FSDP1 is refused. Jobs ``trainer_*`` of the
FSDP2 family's one launch (tests/distributed/fsdp_worker.py)."""

from __future__ import annotations

import pytest

from hf_accum.testing.launch import job_report
from hf_accum.testing.logs import fused_on

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(fsdp_family):
    """Jobs trainer_* of the FSDP2 family's one launch (conftest.py)."""
    jobs = {"full": "trainer_full", "lora": "trainer_lora", "stock": "trainer_stock", "fsdp1": "trainer_fsdp1"}
    return {"world_size": fsdp_family["world_size"], **{name: job_report(fsdp_family, job) for name, job in jobs.items()}}


@pytest.mark.parametrize("name", ["full", "lora"])
def test_accum_trainer_updates_equal_the_big_batch_updates_under_fsdp2(report, name):
    run = report[name]
    assert report["world_size"] == 2 and run["is_fsdp_enabled"] and run["distributed_type"] == "FSDP"
    assert run["all_dtensor"]  # really sharded, not DDP
    assert run["updates"] == len(run["errors"]) == 6
    assert max(run["errors"]) < 1e-10, run["errors"]  # measured 6e-16 (LoRA 1.5e-15)


@pytest.mark.parametrize("name", ["full", "lora"])
def test_accum_trainer_fuses_the_loss_under_fsdp2(report, name):
    assert fused_on(report[name]["fused_log"], "FSDP2"), report[name]["fused_log"]


def test_stock_trainer_silently_runs_ddp_on_cpu_and_is_not_exact(report):
    stock = report["stock"]
    assert stock["distributed_type"] == "MULTI_CPU" and not stock["is_fsdp_enabled"]
    assert min(stock["errors"]) > 1e-2, stock["errors"]


def test_fsdp1_is_refused_with_the_reason(report):
    assert "FsdpUnavailableError" in report["fsdp1"] and "fsdp_config.version=2" in report["fsdp1"]
