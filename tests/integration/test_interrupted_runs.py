"""Runs that die and are started again with the same command, for both engines, as real subprocesses.

The story, one process (hf_accum/testing/cases/loop_resume_worker.py, hf_accum/testing/cases/trainer_resume_worker.py; 6 updates over 2 epochs,
windows of 4, 4 and a short 3 per epoch, a checkpoint every 2 updates, LoRA dropout on, shuffled data):

a. SIGKILL at a random micro-batch inside the short last window of epoch 1 (update 3), after checkpoint-2;
b. the same command resumes from checkpoint-2 (the short window and the epoch boundary again) and is
   SIGKILLed in the middle of writing checkpoint-4;
c. the same command resumes from checkpoint-2 again; SIGTERM after update 4: update 5 finishes,
   checkpoint-5 is written, exit code 75;
d. the same command resumes from checkpoint-5 (mid-epoch) and completes.

Stitched together (each update as the last run that executed it recorded it), the run must equal the
uninterrupted one: per-update applied gradients within 1e-12 relative, the same LRs and logged losses, and
identical final weights. The same on 2 DDP processes: SIGKILL of both ranks across the short window and the
epoch boundary, then SIGTERM of one rank only (both must stop after the same update), then completion.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from hf_accum.checkpoint import (
    ResumeMismatchError,
    is_complete_checkpoint,
    latest_complete_checkpoint,
)
from hf_accum.control import EXIT_PREEMPTED
from hf_accum.run_lock import LOCK_NAME
from hf_accum.testing import cases
from hf_accum.testing.interruptions import assert_same_run, parse_args, read_records, run_dir, stitched

pytestmark = pytest.mark.slow  # every test reads the story: 5 runs of a subprocess per engine
WORKERS = {engine: cases.script(f"{engine}_resume_worker.py") for engine in ("loop", "trainer")}
# Collator calls (prefetch included) that fall inside the short last window of epoch 1, after checkpoint-2.
SHORT_WINDOW_CALLS = (10, 11)
RANDOM = random.Random(20240611)


def run_worker(engine: str, out, tag: str, *injections: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, WORKERS[engine], str(out), tag, *injections]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def names(out) -> list[str]:
    return sorted(name for name in os.listdir(run_dir(str(out))) if name != LOCK_NAME)  # a SIGKILLed run leaves it


@pytest.fixture(scope="module", params=["loop", "trainer"])
def story(request, tmp_path_factory):
    """Run the uninterrupted reference and the interrupted story a-d; return what each step left behind."""
    engine = request.param
    reference_out = tmp_path_factory.mktemp(f"{engine}_reference")
    completed = run_worker(engine, reference_out, "ref")
    assert completed.returncode == 0, completed.stderr[-3000:]

    out = tmp_path_factory.mktemp(f"{engine}_story")
    kill_call = RANDOM.choice(SHORT_WINDOW_CALLS)
    steps = {}
    steps["a"] = (run_worker(engine, out, "a", "--kill-at-micro-batch", str(kill_call)), names(out))
    steps["b"] = (run_worker(engine, out, "b", "--kill-in-save", "4"), names(out))
    steps["c"] = (run_worker(engine, out, "c", "--sigterm-at-update", "4"), names(out))
    steps["d"] = (run_worker(engine, out, "d"), names(out))
    return {"engine": engine, "reference": str(reference_out), "out": str(out), "steps": steps, "kill_call": kill_call}


def test_sigkill_in_the_short_window_leaves_the_earlier_checkpoint(story):
    completed, left = story["steps"]["a"]
    assert completed.returncode == -signal.SIGKILL, completed.stderr[-3000:]
    assert left == ["checkpoint-2"], (left, story["kill_call"])
    assert sorted(read_records(story["out"], "a")) == [1, 2]


def test_kill_during_checkpoint_write_keeps_the_previous_checkpoint_complete(story):
    completed, left = story["steps"]["b"]
    assert completed.returncode == -signal.SIGKILL, completed.stderr[-3000:]
    # The half-written checkpoint-4 is only a hidden staging directory; checkpoint-2 is still complete.
    assert left == [".staging-checkpoint-4", "checkpoint-2"], left
    assert min(read_records(story["out"], "b")) == 3  # it had resumed from checkpoint-2


def test_sigterm_finishes_the_update_writes_a_checkpoint_and_exits_75(story):
    completed, left = story["steps"]["c"]
    assert completed.returncode == EXIT_PREEMPTED == 75, completed.stderr[-3000:]
    assert "training stopped after update 5 (SIGTERM); checkpoint" in completed.stderr
    assert "SIGTERM: finishing the current update" in completed.stderr
    # The stale staging directory is gone; save_total_limit=2 rotated checkpoint-2 out after checkpoint-5.
    assert left == ["checkpoint-4", "checkpoint-5"], left
    assert sorted(read_records(story["out"], "c")) == [3, 4, 5]


def test_resumed_story_equals_the_uninterrupted_run(story):
    completed, left = story["steps"]["d"]
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert sorted(read_records(story["out"], "d")) == [6]  # resumed from checkpoint-5, mid-epoch
    reference = read_records(story["reference"], "ref")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert_same_run(reference, stitched(story["out"], ["a", "b", "c", "d"]))
    final = torch.load(os.path.join(story["out"], "final-d.pt"), weights_only=True)
    expected = torch.load(os.path.join(story["reference"], "final-ref.pt"), weights_only=True)
    assert final.keys() == expected.keys() and len(final) > 0
    for name in expected:
        assert torch.equal(final[name], expected[name]), name


def test_resumed_run_reports_the_whole_run(story):
    """The last run's own result covers every update, the ones before the resumes included."""
    import json

    with open(os.path.join(story["out"], "result-d.json")) as handle:
        resumed = json.load(handle)
    with open(os.path.join(story["reference"], "result-ref.json")) as handle:
        reference = json.load(handle)
    key = "updates" if story["engine"] == "loop" else "log_history"
    losses = [entry.get("loss") for entry in resumed[key] if "loss" in entry]
    assert losses == pytest.approx([entry.get("loss") for entry in reference[key] if "loss" in entry], rel=1e-12)
    assert len(losses) == 6


# -- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plan, message",
    [({"accumulation": 2}, "gradient_accumulation_steps 4 -> 2"),
     ({"micro_batch": 1}, "per-device micro-batch 2 -> 1")],
)
def test_resume_with_another_batch_plan_is_refused(story, plan, message):
    """In-process, into the story's directory (it holds checkpoint-5 of a 2 x 4 x 1 plan)."""
    from hf_accum.testing.cases import loop_resume_worker, trainer_resume_worker

    args = parse_args([story["out"], "refused"])
    worker = loop_resume_worker if story["engine"] == "loop" else trainer_resume_worker
    with pytest.raises(ResumeMismatchError, match=message) as error:
        worker.run(args, **plan)
    assert "effective batch 8 = 2 per device x 4 accumulation x 1 process" in str(error.value)
    assert read_records(story["out"], "refused") == {}  # refused before any update
    assert is_complete_checkpoint(latest_complete_checkpoint(run_dir(story["out"])))
