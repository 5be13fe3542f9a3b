"""Runs that die and are started again with the same command, for both engines, as real subprocesses.

The story, one process (hf_accum/testing/cases/loop_resume_worker.py, hf_accum/testing/cases/trainer_resume_worker.py; 6 updates over 2 epochs,
windows of 4, 4 and a short 3 per epoch, a checkpoint every 2 updates, LoRA dropout on, shuffled data):

a. SIGKILL at a random micro-batch inside the short last window of epoch 1 (update 3), after checkpoint-2;
b. the same command resumes from checkpoint-2 (the short window and the epoch boundary again) and is
   SIGKILLed in the middle of writing checkpoint-4;
c. the same command resumes from checkpoint-2 again; SIGTERM after update 4: update 5 finishes,
   checkpoint-5 is written, exit code 75;
d. the same command resumes from checkpoint-5 (mid-epoch) and completes (in the pytest process, as the reference
   below: nothing kills it).

Runs a-c are each a process of their own that really dies (SIGKILL, exit 75), both engines' forked by ONE worker
process once its imports are done (hf_accum/testing/cases/resume_story_worker.py): a start-up (~5 CPU-s) is most
of what a run costs, and a process started by ``python WORKER`` would show nothing more.

Stitched together (each update as the last run that executed it recorded it), the run must equal the
uninterrupted one (run in the pytest process: nothing kills it): per-update applied gradients within 1e-12 relative, the same LRs and logged losses, and
identical final weights. The same on 2 DDP processes: SIGKILL of both ranks across the short window and the
epoch boundary, then SIGTERM of one rank only (both must stop after the same update), then completion.

Ctrl-C as a user types it into a terminal (a pseudo-terminal; :class:`hf_accum.testing.interruptions.Terminal`),
the recipe under ``accelerate launch`` (one process, and 2 through its torchrun-based launcher), ``torchrun`` (2
processes) and ``python``: one note at the first Ctrl-C, typed in update 3; a second Ctrl-C in the middle of
writing checkpoint-3 aborts it, leaving checkpoint-2 whole (it verifies against its manifest, and resumes); every
worker exits 130, and the launcher stays until they have ended.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from hf_accum.checkpointing.checkpoint import (
    CHECKPOINT_PREFIX,
    ResumeMismatchError,
    is_complete_checkpoint,
    latest_complete_checkpoint,
)
from hf_accum.checkpointing.manifest import verify_checkpoint
from hf_accum.control import CTRL_C_NOTE, EXIT_INTERRUPTED, EXIT_PREEMPTED
from hf_accum.recipe.testing import (
    ROOT,
    TORCHRUN_2,
    recipe_arguments,
    recipe_command,
    recipe_env,
    run_main,
)
from hf_accum.testing import cases
from hf_accum.testing.interruptions import (
    Terminal,
    assert_same_run,
    left_behind,
    parse_args,
    read_records,
    run_dir,
    stitched,
    worker_exits,
    worker_pids,
)

pytestmark = pytest.mark.slow  # the story: one worker process forking 6 runs; Ctrl-C: a recipe run each
ENGINES = ("loop", "trainer")
STORY_WORKER = cases.script("resume_story_worker.py")
# Collator calls (prefetch included) that fall inside the short last window of epoch 1, after checkpoint-2.
SHORT_WINDOW_CALLS = (10, 11)
RANDOM = random.Random(20240611)


def run_worker_here(engine: str, out, tag: str) -> subprocess.CompletedProcess:
    """A run of the worker that nothing kills (the uninterrupted reference, the story's last resume), in THIS
    process: a process of its own would show nothing more, and cost a start-up (~8 CPU-s). One torch thread, as the
    workers' processes have (OMP_NUM_THREADS=1): the story's final weights must equal the reference bit for bit.
    Returned as the process would have ended: exit 0, or 1 with the traceback on stderr."""
    import traceback

    from hf_accum.testing.cases import loop_resume_worker, trainer_resume_worker

    worker = loop_resume_worker if engine == "loop" else trainer_resume_worker
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        worker.run(parse_args([str(out), tag]))
    except Exception:
        return subprocess.CompletedProcess([tag], 1, stdout="", stderr=traceback.format_exc())
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess([tag], 0, stdout="", stderr="")


def run_killed_steps(tmp_path_factory, steps: list[dict]) -> list[tuple[subprocess.CompletedProcess, list[str]]]:
    """The story's runs that are killed (or stop with 75), in order, each a process of its own forked by ONE
    worker process after its imports (hf_accum/testing/cases/resume_story_worker.py: one start-up for all of
    them); each as the process ended (exit code, ``-9`` for SIGKILL; stderr) and what it left in ``OUT/run``."""
    folder = tmp_path_factory.mktemp("killed_steps")
    steps_file, report = folder / "steps.json", folder / "report.json"
    steps_file.write_text(json.dumps(steps))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, STORY_WORKER, str(report), str(steps_file), "--fork"]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0 and report.exists(), completed.stderr[-3000:]
    ended = json.loads(report.read_text())
    assert len(ended) == len(steps), ended
    return [(subprocess.CompletedProcess([step["tag"]], end["returncode"], stdout="", stderr=end["stderr"]),
             end["left"]) for step, end in zip(steps, ended)]


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """Both engines' stories: the uninterrupted references (here), the killed runs a-c (processes of their own,
    forked by one worker process: :func:`run_killed_steps`), then d, the resume that completes (here: nothing kills
    it); engine -> what each step left behind."""
    made = {}
    for engine in ENGINES:
        reference_out = tmp_path_factory.mktemp(f"{engine}_reference")
        reference = run_worker_here(engine, reference_out, "ref")
        assert reference.returncode == 0, reference.stderr
        out = tmp_path_factory.mktemp(f"{engine}_story")
        made[engine] = {"engine": engine, "reference": str(reference_out), "out": str(out), "steps": {},
                        "kill_call": RANDOM.choice(SHORT_WINDOW_CALLS)}
    killed = [("a", lambda story: ["--kill-at-micro-batch", str(story["kill_call"])]),
              ("b", lambda story: ["--kill-in-save", "4"]),
              ("c", lambda story: ["--sigterm-at-update", "4"])]
    steps = [{"engine": engine, "out": made[engine]["out"], "tag": tag, "injections": injections(made[engine])}
             for tag, injections in killed for engine in ENGINES]
    for step, ended in zip(steps, run_killed_steps(tmp_path_factory, steps)):
        made[step["engine"]]["steps"][step["tag"]] = ended
    for engine, story in made.items():
        story["steps"]["d"] = (run_worker_here(engine, story["out"], "d"), left_behind(story["out"]))
    return made


@pytest.fixture(params=ENGINES)
def story(request, stories):
    return stories[request.param]


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


# -- Ctrl-C typed into a terminal, under each launcher ------------------------------------------------------

ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]
CTRL_C_LAUNCHERS = {
    # The README's `accelerate launch recipes/finetune_llama.py` on a machine without GPUs: accelerate's
    # one-process launcher, in the terminal's foreground group with the script.
    "accelerate_launch": [*ACCELERATE, "--num_processes", "1"],
    # 2 CPU processes (gloo) through accelerate's torchrun-based launcher: workers in sessions of their own.
    "accelerate_launch_2_processes": [*ACCELERATE, "--multi_gpu", "--num_processes", "2"],
    "python": [sys.executable],
    "torchrun_2_processes": TORCHRUN_2,
}
CTRL_C_WORKER = cases.script("ctrl_c_recipe.py")
# 6 updates, a checkpoint every 2; 2 held-out rows (their generation is most of a short run's evaluation, and no
# check here reads the score).
CTRL_C_RUN = ("training.max_steps=6", "training.save_steps=2", "data.num_eval_examples=2")


def type_ctrl_c_into_a_recipe_run(tmp_path, launcher: str, ctrl_c: int) -> dict:
    """The recipe (6 updates, a checkpoint every 2) under ``launcher`` in a terminal: Ctrl-C typed in update 3
    and, when ``ctrl_c`` is 2, again in the middle of writing checkpoint-3."""
    out, report = tmp_path / "run", tmp_path / "report"
    report.mkdir()
    command = [*CTRL_C_LAUNCHERS[launcher], CTRL_C_WORKER, str(report),
               *recipe_arguments(out, *CTRL_C_RUN)]
    terminal = Terminal(command, recipe_env(), ROOT)
    try:
        in_update_3 = terminal.wait_for("ctrl-c test: rank 0 paused in update 3", timeout=300)
        terminal.type_ctrl_c()
        terminal.wait_for("ctrl-c test: rank 0 paused writing checkpoint-3", timeout=120, start=in_update_3)
        # The worker is held there: a launcher that did not wait would be gone by now (accelerate's one-process
        # launcher used to end 0.25 s after the Ctrl-C).
        launcher_alive_in_the_checkpoint = still_running_after(terminal.process, seconds=3)
        if ctrl_c == 2:
            terminal.type_ctrl_c()
        else:
            (report / "go").touch()  # let the checkpoint complete
        code, launcher_ended = terminal.wait(timeout=180)
    finally:
        terminal.close(stray_pids=worker_pids(terminal.output))
    return {"code": code, "launcher_ended": launcher_ended, "alive": launcher_alive_in_the_checkpoint,
            "output": terminal.output, "exits": worker_exits(str(report)), "out": str(out),
            "checkpoints": sorted(name for name in os.listdir(out) if CHECKPOINT_PREFIX in name)}


def still_running_after(process: subprocess.Popen, seconds: float) -> bool:
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return True
    return False


@pytest.mark.parametrize("launcher", ["accelerate_launch_2_processes", "accelerate_launch", "python",
                                      "torchrun_2_processes"])
def test_ctrl_c_twice_aborts_the_checkpoint_and_keeps_the_previous_one(tmp_path, launcher):
    run = type_ctrl_c_into_a_recipe_run(tmp_path, launcher, ctrl_c=2)
    tail = run["output"][-4000:]
    processes = 2 if launcher.endswith("2_processes") else 1
    # One note, from the main process, at the first Ctrl-C; every worker then exits 130.
    assert run["output"].count(CTRL_C_NOTE) == 1, tail
    assert sorted(run["exits"]) == list(range(processes)), tail
    assert all(end["code"] == EXIT_INTERRUPTED == 130 for end in run["exits"].values()), (run["exits"], tail)
    # The launcher waited: alive while the checkpoint was being written, and ended after every worker.
    assert run["alive"], tail
    assert all(end["monotonic"] <= run["launcher_ended"] for end in run["exits"].values()), (run, tail)
    # accelerate's launchers and torchrun (its agent re-raises the signal) exit 1 (docs/runs.md); python: 130.
    assert run["code"] == (EXIT_INTERRUPTED if launcher == "python" else 1), tail
    assert "interrupted (Ctrl-C): stopped; final outputs were not written" in run["output"]
    # The aborted checkpoint-3 left nothing behind; checkpoint-2 is whole (every file as its manifest says).
    assert run["checkpoints"] == ["checkpoint-2"], run["checkpoints"]
    verdict = verify_checkpoint(os.path.join(run["out"], "checkpoint-2"), collective=False)
    assert verdict.ok and verdict.has_manifest, verdict
    if launcher == "accelerate_launch":  # and it resumes: the same command continues from it
        resumed = run_main(*recipe_arguments(run["out"], *CTRL_C_RUN,
                                             "training.resume_from_checkpoint=true"))  # nothing kills it: here
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resuming from {os.path.join(run['out'], 'checkpoint-2')}" in resumed.stdout + resumed.stderr


def test_ctrl_c_once_under_accelerate_launch_saves_and_the_launcher_waits(tmp_path):
    run = type_ctrl_c_into_a_recipe_run(tmp_path, "accelerate_launch", ctrl_c=1)
    tail = run["output"][-4000:]
    assert run["output"].count(CTRL_C_NOTE) == 1, tail
    assert "training stopped after update 3 (SIGINT); checkpoint" in run["output"], tail
    assert run["exits"][0]["code"] == EXIT_INTERRUPTED, (run["exits"], tail)
    assert run["alive"] and run["exits"][0]["monotonic"] <= run["launcher_ended"], (run, tail)
    assert run["checkpoints"] == ["checkpoint-2", "checkpoint-3"], run["checkpoints"]
    assert verify_checkpoint(os.path.join(run["out"], "checkpoint-3"), collective=False).ok


def test_under_accelerate_launch_the_run_holds_the_terminal_while_training_only(tmp_path):
    """The terminal's foreground: the script's own process group while it trains (Ctrl-Z refused there, with a
    line), the launcher's again once training ends; the run completes as usual."""
    command = recipe_command(CTRL_C_LAUNCHERS["accelerate_launch"], tmp_path / "run", "training.max_steps=8",
                             "data.num_eval_examples=2")
    terminal = Terminal(command, recipe_env(), ROOT)
    try:
        in_training = terminal.wait_for("update 1 |", timeout=300)
        foreground_in_training = os.tcgetpgrp(terminal.master)
        os.write(terminal.master, b"\x1a")  # Ctrl-Z
        terminal.wait_for("Ctrl-Z: a run under accelerate launch is not suspended", timeout=60, start=in_training)
        terminal.wait_for("held-out exact match: before", timeout=300, start=in_training)
        foreground_after_training = os.tcgetpgrp(terminal.master)
        code, _ = terminal.wait(timeout=120)
    finally:
        terminal.close(stray_pids=[])
    launcher_group = terminal.process.pid  # the session's leader, as a shell makes a foreground job's first process
    assert foreground_in_training != launcher_group
    assert foreground_after_training == launcher_group
    assert code == 0, terminal.output[-3000:]
    assert "update 8 |" in terminal.output
