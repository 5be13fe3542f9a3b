"""The interrupted-run story on 2 DDP processes (torchrun, gloo), for both engines.

7 micro-batches per rank and epoch, K=3: windows of 3, 3 and a short 1; 6 updates over 2 epochs, a checkpoint
every 2 updates.

a. both ranks SIGKILLed at a random micro-batch after the short window of epoch 1 (updates 3-4): the resumed
   run must replay the short window and cross the epoch boundary;
b. the same command resumes from checkpoint-2; SIGTERM reaches rank 1 only, after update 4: both ranks must
   finish update 5, write checkpoint-5 and exit with code 75;
c. the same command resumes from checkpoint-5 and completes (both engines' in one launch of
   hf_accum/testing/cases/resume_story_worker.py: the same runs of the same workers, one start-up).

Stitched, the run equals the uninterrupted one (gradients within 1e-12, LRs, losses, final weights), and a
1-process run refuses the 2-process checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch

from hf_accum.checkpointing.checkpoint import ResumeMismatchError, latest_complete_checkpoint
from hf_accum.testing import cases
from hf_accum.testing.interruptions import (
    assert_same_run,
    left_behind,
    parse_args,
    read_records,
    run_dir,
    stitched,
)
from hf_accum.testing.launch import job_report, torchrun

ENGINES = ("loop", "trainer")
WORKERS = {engine: cases.script(f"{engine}_resume_worker.py") for engine in ENGINES}
STORY_WORKER = cases.script("resume_story_worker.py")
# Collator calls per rank from the start of epoch 2 (after update 3, the short window) to inside update 4.
ACROSS_THE_EPOCH_BOUNDARY = (8, 9, 10)
RANDOM = random.Random(20240612)


@pytest.fixture(scope="module")
def stories(tmp_path_factory, loop_ddp_family):
    """Both engines' stories: a and b a launch each (they are killed, or stop with 75); c, the resumes that
    complete, both engines in ONE launch (hf_accum/testing/cases/resume_story_worker.py: nothing kills them, and a
    launch's start-up, ~10 CPU-s, is most of its cost). engine -> what each step left behind."""
    made = {}
    for engine in ENGINES:
        # The uninterrupted run: job resume_references of the loop DDP family's one launch (conftest.py).
        reference_out = job_report(loop_ddp_family, "resume_references")[engine]
        out = tmp_path_factory.mktemp(f"{engine}_ddp_story")
        made[engine] = {"engine": engine, "reference": str(reference_out), "out": str(out), "steps": {},
                        "kill_call": RANDOM.choice(ACROSS_THE_EPOCH_BOUNDARY)}
    for engine, story in made.items():
        completed = torchrun(WORKERS[engine], [story["out"], "a", "--kill-at-micro-batch", str(story["kill_call"])],
                             timeout=600)
        story["steps"]["a"] = (completed, left_behind(story["out"]))
    for engine, story in made.items():
        completed = torchrun(WORKERS[engine], [story["out"], "b", "--sigterm-at-update", "4", "--sigterm-rank", "1"],
                             timeout=600)
        story["steps"]["b"] = (completed, left_behind(story["out"]))
    folder = tmp_path_factory.mktemp("ddp_completions")
    steps_file = folder / "steps.json"
    steps_file.write_text(json.dumps([{"engine": engine, "out": story["out"], "tag": "c", "injections": []}
                                      for engine, story in made.items()]))
    completed = torchrun(STORY_WORKER, [str(folder / "report.json"), str(steps_file)], timeout=900)
    for story in made.values():
        story["steps"]["c"] = (completed, left_behind(story["out"]))
    return made


@pytest.fixture(params=ENGINES)
def story(request, stories):
    return stories[request.param]


@pytest.mark.slow
def test_both_ranks_killed_leave_the_earlier_checkpoint(story):
    completed, left = story["steps"]["a"]
    assert completed.returncode != 0
    assert left == ["checkpoint-2"], (left, story["kill_call"])


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_both_after_the_same_update(story):
    completed, left = story["steps"]["b"]
    # Rank 0 never received the signal: it learned of it from the window's all-reduce.
    assert "training stopped after update 5 (stop requested on another process); checkpoint" in completed.stderr
    # The first rank to exit exits with 75; torchrun then sends SIGTERM to the other, already on its way out.
    root_cause = re.search(r"Root Cause[\s\S]*?exitcode\s*:\s*(-?\d+)", completed.stderr)
    assert root_cause and root_cause.group(1) == "75", completed.stderr[-3000:]
    assert left == ["checkpoint-4", "checkpoint-5"], left
    assert sorted(read_records(story["out"], "b")) == [3, 4, 5]


@pytest.mark.slow
def test_resumed_ddp_story_equals_the_uninterrupted_run(story):
    completed, _ = story["steps"]["c"]
    assert completed.returncode == 0, completed.stderr[-3000:]
    reference = read_records(story["reference"], "ref")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert_same_run(reference, stitched(story["out"], ["a", "b", "c"]))
    final = torch.load(os.path.join(story["out"], "final-c.pt"), weights_only=True)
    expected = torch.load(os.path.join(story["reference"], "final-ref.pt"), weights_only=True)
    assert final.keys() == expected.keys() and len(final) > 0
    for name in expected:
        assert torch.equal(final[name], expected[name]), name


@pytest.mark.slow
def test_one_process_refuses_the_two_process_checkpoint(story):
    from hf_accum.testing.cases import loop_resume_worker, trainer_resume_worker

    worker = loop_resume_worker if story["engine"] == "loop" else trainer_resume_worker
    with pytest.raises(ResumeMismatchError, match=r"number of processes 2 -> 1\)") as error:
        worker.run(parse_args([story["out"], "refused"]), accumulation=3)
    assert "effective batch 12 = 2 per device x 3 accumulation x 2 processes" in str(error.value)
    assert latest_complete_checkpoint(run_dir(story["out"])).endswith("checkpoint-6")
