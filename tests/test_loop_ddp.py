"""Two real CPU processes (torchrun, gloo): exact across ranks with very different token counts,
one gradient all-reduce per update, LR equal to the big-batch run's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from test_loop_schedule import big_batch_learning_rates

HERE = os.path.dirname(__file__)


def run_torchrun(worker: str, out_path, nproc: int = 2, timeout: int = 300) -> dict:
    """Launch with torchrun: `accelerate launch --cpu --num_processes 2` silently starts ONE process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--standalone", os.path.join(HERE, worker), str(out_path)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(out_path) as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_torchrun("loop_ddp_worker.py", tmp_path_factory.mktemp("ddp") / "report.json")


@pytest.mark.slow
def test_two_processes_really_started(report):
    assert report["world_size"] == 2


@pytest.mark.slow
def test_ddp_gradient_equals_big_batch_over_all_ranks(report):
    assert report["updates"] == 6
    assert max(report["exact_errors"]) < 1e-10, report["exact_errors"]


@pytest.mark.slow
def test_naive_ddp_loop_is_wrong(report):
    assert max(report["naive_errors"]) > 1e-3, report["naive_errors"]


@pytest.mark.slow
def test_one_gradient_allreduce_per_update(report):
    assert report["allreduce_rounds"] == report["updates"]


@pytest.mark.slow
def test_ddp_lr_matches_big_batch(report):
    updates_per_epoch = math.ceil(28 / (2 * 3 * 2))
    expected = big_batch_learning_rates(2 * updates_per_epoch, warmup=1)
    assert report["learning_rates"] == pytest.approx(expected, rel=1e-12, abs=0)
