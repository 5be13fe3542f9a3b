"""Nothing lost, nothing misdescribed: runs as a user starts them (real subprocesses, signals and files).

* one run per output directory: a second run on a running run's directory stops at once (exit 2, naming the
  running one), with or without ``overwrite_output_dir``; the first finishes unharmed;
* verified checkpoints: a damaged latest checkpoint (truncated file, bytes flipped inside an adapter tensor)
  is skipped on ``resume_from_checkpoint=true`` and the run ends with the uninterrupted run's adapter; a
  damaged checkpoint named explicitly is refused naming the file and the newest good checkpoint;
* requeue-safe resume: a run killed while writing its first checkpoint, re-run with the same command plus
  ``resume_from_checkpoint=true``, starts afresh and cleans the unfinished write;
* a full disk during a checkpoint or the final files: one ``error:`` line, exit 3, the last good checkpoint named
  (the inf/NaN limit has its own code, 5);
* under torchrun, SIGTERM: every rank checkpoints; torchrun itself exits 1 (documented in docs/runs.md); the
  same command resumes and finishes with every output of a 2-process run of the loop engine.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from hf_accum.checkpointing import run_lock
from hf_accum.checkpointing.checkpoint import (
    remove_staging_debris,
    resolve_resume_checkpoint,
    verified_resume_checkpoint,
)
from hf_accum.checkpointing.manifest import MANIFEST_FILE, CheckpointCorrupt, verify_checkpoint, write_manifest
from hf_accum.control import NonFiniteLossError, TrainingStopped
from hf_accum.errors import EXIT_BAD_INPUT, EXIT_DISK_FULL, EXIT_NONFINITE, EXIT_PREEMPTED
from hf_accum.recipe import outputs as run_outputs
from hf_accum.recipe.testing import (
    PYTHON,
    SMALL,
    TORCHRUN_2,
    check_outputs,
    recipe_arguments,
    recipe_env,
    run_main,
    run_script,
    start_script,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The suite's short run, with 4 held-out examples (their generation is most of a short run's evaluation).
RUNS_SMALL = [*SMALL, "data.num_eval_examples=4"]
ENV = recipe_env()
ADAPTER = "adapter_model.safetensors"


def run(out, *overrides: str, launcher: list[str] = PYTHON, timeout: int = 300) -> subprocess.CompletedProcess:
    """The recipe run to its end, whatever its exit code."""
    return run_script(launcher, out, *overrides, small=RUNS_SMALL, timeout=timeout, check=False)


def run_here(out, *overrides: str) -> subprocess.CompletedProcess:
    """The recipe run to its end in THIS process, whatever its exit code: a run nothing kills (a resume, a full
    disk) or one that must be refused before anything loads (the refusal reads files and the lock, which another
    process may hold); a process of its own would show nothing more, and cost a start-up (~8 CPU-s)."""
    return run_main(*recipe_arguments(out, *overrides, small=RUNS_SMALL))


def succeeded(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    return proc


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def adapter(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, ADAPTER))


def assert_same_adapter(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def flip_bytes_inside_a_tensor(path: str) -> None:
    """Change 4 bytes in the middle of the safetensors data (past its JSON header): a weight changes value,
    the file still loads."""
    with open(path, "r+b") as handle:
        header = int.from_bytes(handle.read(8), "little")
        size = os.path.getsize(path)
        position = 8 + header + (size - 8 - header) // 2
        handle.seek(position)
        original = handle.read(4)
        handle.seek(position)
        handle.write(bytes(b ^ 0x5A for b in original))


def truncate(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)


# -- the lock ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lock_refuses_a_second_process_and_frees_with_its_dead_holder(tmp_path):
    out = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from hf_accum.checkpointing import run_lock; run_lock.acquire(sys.argv[1]); "
         "print('held', flush=True); time.sleep(600)", out],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.OutputDirInUse) as refused:
            run_lock.acquire(out, "training.output_dir")
        message = str(refused.value)
        assert f"pid {holder.pid} on " in message and " since " in message and "training.output_dir=" in message
        assert "\n" not in message
    finally:
        holder.kill()  # SIGKILL: no clean-up runs, the lock dies with the process
        holder.wait()
    assert os.path.exists(os.path.join(out, run_lock.LOCK_NAME))  # left behind, but free
    with run_lock.run_lock(out):
        assert run_lock.holds(out)
    assert not run_lock.holds(out) and not os.path.exists(os.path.join(out, run_lock.LOCK_NAME))


def test_lock_is_reentrant_in_one_process_and_leaves_no_directory_it_created(tmp_path):
    out = str(tmp_path / "a" / "b")
    with run_lock.run_lock(out):
        with run_lock.run_lock(out):  # the recipe holds it, then the engine takes it again
            pass
        assert run_lock.holds(out)
    assert not os.path.exists(tmp_path / "a")


@pytest.fixture(scope="module")
def held_by_another_process(tmp_path_factory):
    """A directory locked by a live process (one for the module: the refused runs write nothing); yields
    (directory, that process's pid)."""
    out = str(tmp_path_factory.mktemp("held") / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from hf_accum.checkpointing import run_lock; run_lock.acquire(sys.argv[1]); "
         "print('held', flush=True); time.sleep(600)", out],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    yield out, holder.pid
    holder.kill()
    holder.wait()


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["loop", "trainer"])
def test_both_engines_refuse_an_output_dir_another_run_holds(front_end, held_by_another_process):
    from torch.utils.data import DataLoader

    from hf_accum import AccumTrainer, LoopConfig, train
    from hf_accum.batching import PaddingCollator
    from hf_accum.testing import PAD, Scenario, fresh_accelerator, tiny_causal_lm, training_args

    out, pid = held_by_another_process
    model = tiny_causal_lm(dtype=torch.float32)
    rows = [{"input_ids": list(range(3, 9))} for _ in range(4)]
    with pytest.raises(run_lock.OutputDirInUse, match=rf"output_dir='{out}' is in use by another run \(pid {pid} on "):
        if front_end == "loop":
            accelerator = fresh_accelerator(2)
            loader = DataLoader(rows, batch_size=2, collate_fn=PaddingCollator(PAD))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            train(model, optimizer, loader, accelerator, LoopConfig(disable_tqdm=True, output_dir=out))
        else:
            scenario = Scenario("locked", None, rows, PaddingCollator(PAD), micro_batch=2, accumulation=2)
            AccumTrainer(model=model, args=training_args(scenario, out), train_dataset=rows,
                         data_collator=scenario.collator).train()
    assert sorted(os.listdir(out)) == [run_lock.LOCK_NAME]  # nothing written by the refused run


def test_the_write_probe_has_no_name_a_kill_could_leave_behind(tmp_path, monkeypatch):
    import tempfile

    from hf_accum.checkpointing.checkpoint import check_output_dir_writable

    seen = []
    original = tempfile.TemporaryFile

    def probe(*args, **kwargs):  # the moment a kill could strike: the probe file is open
        handle = original(*args, **kwargs)
        seen.append(os.listdir(kwargs["dir"]))
        return handle

    monkeypatch.setattr(tempfile, "TemporaryFile", probe)
    run_outputs.probe_writable(str(tmp_path / "recipe"))
    check_output_dir_writable(str(tmp_path / "loop"))
    assert seen == [[], []]


@pytest.mark.slow
def test_a_second_run_on_a_running_runs_directory_is_refused_and_the_first_is_unharmed(tmp_path):
    out = tmp_path / "run"
    first = start_script(PYTHON, out, "training.max_steps=6", "training.save_steps=2", "training.learning_rate=0.001",
                         small=RUNS_SMALL)
    deadline = time.time() + 240
    while not (out / run_lock.LOCK_NAME).exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    # SIGSTOP keeps the first run alive (holding its lock) however slow this machine is; SIGCONT lets it go on.
    first.send_signal(signal.SIGSTOP)
    try:
        assert first.poll() is None, "the first run ended before it could be paused"
        # Another learning rate; then the same with overwrite_output_dir: neither may touch the running run.
        seconds = [run_here(out, "training.max_steps=6", "training.learning_rate=0.002"),
                   run_here(out, "training.max_steps=6", "training.learning_rate=0.002",
                                "overwrite_output_dir=true")]
    finally:
        first.send_signal(signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    for second in seconds:
        assert second.returncode == EXIT_BAD_INPUT, second.stderr[-3000:]
        line = last_line(second.stderr)
        assert line.startswith("error: training.output_dir=") and "is in use by another run" in line
        assert f"pid {first.pid} on " in line
        assert "resolved config:" not in second.stdout  # stopped before anything was loaded or written
    metrics = json.loads((out / run_outputs.METRICS_NAME).read_text())
    assert len(metrics["updates"]) == 6
    assert "learning_rate: 0.001" in (out / "resolved_config.yaml").read_text()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not (out / run_lock.LOCK_NAME).exists()


# -- verified checkpoints ---------------------------------------------------------------------------------


def write_checkpoint(out: str, update: int, content: bytes = b"weights") -> str:
    from hf_accum.checkpointing.checkpoint import staged_checkpoint

    with staged_checkpoint(out, update, commits=True, barrier=lambda: None,
                           seal=lambda folder: open(os.path.join(folder, "hf_accum_plan.json"), "w").write("{}")) as f:
        with open(os.path.join(f, "optimizer.pt"), "wb") as handle:
            handle.write(content * 1000)
    return os.path.join(out, f"checkpoint-{update}")


@pytest.mark.slow
def test_one_rank_verifies_a_checkpoint_and_every_rank_gets_its_verdict(tmp_path):
    """2 gloo processes resume from a directory whose newest checkpoint has a damaged file (same size, other
    bytes: only the sha256 finds it). Rank 0 alone hashes; both ranks choose the same older checkpoint, and
    naming the damaged one ends both with the same line and exit code 2."""
    from hf_accum.testing.launch import run_torchrun

    run = str(tmp_path / "run")
    good, bad = write_checkpoint(run, 2), write_checkpoint(run, 4)
    with open(os.path.join(bad, "optimizer.pt"), "r+b") as handle:
        handle.write(b"W")  # one byte changed in place: the size still matches the manifest
    worker = os.path.join(os.path.dirname(HERE), "distributed", "manifest_verify_worker.py")
    out = tmp_path / "report.json"
    run_torchrun(worker, out, nproc=2, timeout=300, extra_args=[run])
    ranks = [json.load(open(f"{out}.rank{rank}")) for rank in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["chosen"] for r in ranks] == [good, good]
    assert [r["exit_code"] for r in ranks] == [EXIT_BAD_INPUT, EXIT_BAD_INPUT]
    (refusal,) = ranks[0]["refusal"]
    assert ranks[1]["refusal"] == [refusal]
    assert f"checkpoint {bad} is damaged: optimizer.pt differs from its manifest's sha256" in refusal
    # Rank 0 read both checkpoints (the damaged one twice: it is never cached as good); rank 1 read nothing.
    hashed = ranks[0]["hashed"]
    assert {os.path.dirname(path) for path in hashed} == {"checkpoint-2", "checkpoint-4"}
    assert ranks[1]["hashed"] == []


def test_every_checkpoint_carries_a_manifest_that_finds_damage(tmp_path):
    out = str(tmp_path)
    good, bad = write_checkpoint(out, 2), write_checkpoint(out, 4)
    listed = json.load(open(os.path.join(bad, MANIFEST_FILE)))["files"]
    assert sorted(listed) == ["hf_accum_plan.json", "optimizer.pt"] and listed["optimizer.pt"]["size"] == 7000
    assert verify_checkpoint(bad).ok
    with open(os.path.join(bad, "optimizer.pt"), "r+b") as handle:  # same size, other bytes
        handle.write(b"W")
    lines = []
    assert verified_resume_checkpoint(out, report=lines.append) == good
    assert lines == [f"warning: skipping {bad}: optimizer.pt differs from its manifest's sha256 (its bytes changed)"]
    assert resolve_resume_checkpoint(True, out) == good
    with pytest.raises(CheckpointCorrupt) as refused:
        resolve_resume_checkpoint(bad, out)
    assert str(refused.value) == (f"checkpoint {bad} is damaged: optimizer.pt differs from its manifest's sha256 "
                                  f"(its bytes changed); resume from {good} instead")
    truncate(os.path.join(good, "optimizer.pt"))
    with pytest.raises(ValueError, match="no checkpoint in .* verifies"):
        resolve_resume_checkpoint(True, out)
    with pytest.raises(CheckpointCorrupt, match=r"optimizer.pt has 3500 bytes, the manifest says 7000 .*start fresh"):
        resolve_resume_checkpoint(good, out)


def test_a_checkpoint_without_manifest_is_accepted_with_a_note(tmp_path):
    out = str(tmp_path)
    old = write_checkpoint(out, 2)
    os.remove(os.path.join(old, MANIFEST_FILE))
    lines = []
    assert verified_resume_checkpoint(out, report=lines.append) == old
    assert lines == [f"note: {old} has no {MANIFEST_FILE} (written by an older hf_accum): resuming unverified"]
    write_manifest(old)
    assert verify_checkpoint(old).ok


def test_staging_debris_is_removed_by_the_run_that_holds_the_directory(tmp_path):
    out = str(tmp_path)
    os.makedirs(os.path.join(out, ".staging-checkpoint-2", "checkpoint-2"))
    (tmp_path / ".staging-metrics.json.123").write_text("x")
    assert remove_staging_debris(out) == [".staging-checkpoint-2", ".staging-metrics.json.123"]
    assert os.listdir(out) == []


@pytest.fixture(scope="module")
def finished_pair(tmp_path_factory):
    """An uninterrupted reference run (4 updates, checkpoints 2 and 4) and a read-only copy of its directory for
    the tests to cut from (a copy, not a second run of the same command: the run is deterministic, so a second run
    would write the same files; each test resumes a further copy of it in a directory of its own). Run in this
    process: nothing kills it (one torch thread, as the resumed runs' processes: their adapters equal it bit for bit)."""
    base = tmp_path_factory.mktemp("pair")
    reference, copy = base / "reference", base / "copy"
    overrides = ("training.max_steps=4", "training.save_steps=2")
    succeeded(run_main(*recipe_arguments(reference, *overrides, small=RUNS_SMALL)))
    shutil.copytree(reference, copy)
    return reference, copy, overrides


def as_unfinished(source, target):
    """``source`` as a run killed right after its last checkpoint: the final files are not there yet."""
    shutil.copytree(source, target)
    for name in (run_outputs.METRICS_NAME, run_outputs.PLOT_NAME, run_outputs.ADAPTER_DIR):
        path = target / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return target


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped_adapter_bytes", "truncated_optimizer", "truncated_loop_state"])
def test_a_damaged_latest_checkpoint_is_skipped_and_the_run_ends_as_the_uninterrupted_one(
    damage, finished_pair, tmp_path
):
    reference, copy, overrides = finished_pair
    out = as_unfinished(copy, tmp_path / "run")
    latest = out / "checkpoint-4"
    if damage == "flipped_adapter_bytes":
        flip_bytes_inside_a_tensor(str(latest / ADAPTER))
    elif damage == "truncated_optimizer":
        truncate(str(latest / "optimizer.pt"))
    else:
        truncate(str(latest / "hf_accum_loop_state.json"))
    proc = succeeded(run_here(out, *overrides, "training.resume_from_checkpoint=true"))
    assert f"warning: skipping {latest}: " in proc.stdout
    assert f"resuming from {out / 'checkpoint-2'}" in proc.stdout
    assert_same_adapter(adapter(out / run_outputs.ADAPTER_DIR), adapter(reference / run_outputs.ADAPTER_DIR))
    assert verify_checkpoint(str(latest)).ok  # written again by the resumed run


@pytest.mark.slow
def test_a_damaged_checkpoint_named_explicitly_is_refused_naming_the_file_and_the_good_one(finished_pair, tmp_path):
    _, copy, overrides = finished_pair
    out = as_unfinished(copy, tmp_path / "run")
    flip_bytes_inside_a_tensor(str(out / "checkpoint-4" / ADAPTER))
    proc = run_here(out, *overrides, f"training.resume_from_checkpoint={out / 'checkpoint-4'}")
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    assert last_line(proc.stderr) == (
        f"error: training.resume_from_checkpoint: checkpoint {out / 'checkpoint-4'} is damaged: {ADAPTER} differs "
        f"from its manifest's sha256 (its bytes changed); resume from {out / 'checkpoint-2'} instead"
    )
    assert "resolved config:" not in proc.stdout  # refused before anything loaded
    truncate(str(out / "checkpoint-2" / "optimizer.pt"))  # every checkpoint damaged: not silently started afresh
    proc = run_here(out, *overrides, "training.resume_from_checkpoint=true")
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    assert f"warning: skipping {out / 'checkpoint-2'}: optimizer.pt has " in proc.stdout
    assert last_line(proc.stderr).startswith("error: training.resume_from_checkpoint: resume_from_checkpoint=True: "
                                             f"no checkpoint in '{out}' verifies")


# -- requeue-safe resume ------------------------------------------------------------------------------------

KILLED_IN_FIRST_SAVE = (
    "import runpy, sys; from hf_accum.testing.interruptions import kill_during_checkpoint_write; "
    "kill_during_checkpoint_write(2); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_killed_in_its_first_checkpoint_write_the_same_command_with_resume_trains(engine, tmp_path):
    out = tmp_path / "run"
    overrides = (f"engine={engine}", "training.max_steps=4", "training.save_steps=2",
                 "training.resume_from_checkpoint=true")
    killer = [sys.executable, "-c", KILLED_IN_FIRST_SAVE.format(tests=HERE)]
    killed = run(out, *overrides, launcher=killer)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (out / ".staging-checkpoint-2").is_dir() and not (out / "checkpoint-2").exists()
    proc = succeeded(run_here(out, *overrides))  # the requeue: exactly the same command (nothing kills it)
    assert ("note: training.resume_from_checkpoint=true but no checkpoint exists yet (removed 1 unfinished "
            "checkpoint write(s)): starting from scratch") in proc.stdout
    assert len(json.loads((out / run_outputs.METRICS_NAME).read_text())["updates"]) == 4
    assert not [p for p in os.listdir(out) if p.startswith(".")]
    assert "ignores training.resume_from_checkpoint" not in proc.stdout


# -- a full disk ----------------------------------------------------------------------------------------------


def test_disk_full_is_one_line_naming_the_last_good_checkpoint(tmp_path, capsys):
    out = str(tmp_path)
    good = write_checkpoint(out, 2)

    def training(argv):
        with run_outputs.disk_full_is_one_line(out):
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(out, "checkpoint-4", "optimizer.pt"))

    assert run_outputs.run_cli(training, []) == EXIT_DISK_FULL == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no space left on the device of ")
    assert f"the last good checkpoint is {good}: free space, then run the same command with " in err

    def torch_writer(argv):  # torch.save's C++ writer says only that its stream broke
        with run_outputs.disk_full_is_one_line(str(tmp_path / "none")):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    assert run_outputs.run_cli(torch_writer, []) == 3
    assert "no checkpoint written yet: free space and rerun" in capsys.readouterr().err

    def diverged(argv):  # the inf/NaN limit: its own code, so that a wrapper tells it from a full disk
        raise NonFiniteLossError("updates 2..3: 2 consecutive updates had inf/NaN losses or gradients")

    assert run_outputs.run_cli(diverged, [], stopped=(TrainingStopped, NonFiniteLossError)) == EXIT_NONFINITE == 5
    assert "stopped: updates 2..3" in capsys.readouterr().err

    def a_bug(argv):
        with run_outputs.disk_full_is_one_line(out):
            raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        run_outputs.run_cli(a_bug, [])


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 4 MiB (room for the output directory and about one checkpoint of the tiny default)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    tried = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True,
                           text=True)
    if tried.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({tried.stderr.strip() or tried.returncode}): covered by "
                    "test_disk_full_is_one_line_naming_the_last_good_checkpoint only")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["second_checkpoint", "final_files"])
def test_a_full_disk_ends_in_one_line_with_exit_3(where, small_disk):
    out = small_disk / "run"
    every = 2 if where == "second_checkpoint" else 4
    overrides = ["training.max_steps=4", f"training.save_steps={every}"]
    if where == "final_files":  # leave less room than the final adapter needs after checkpoint-4
        (small_disk / "ballast").write_bytes(b"\0" * (1200 << 10))
    proc = run_here(out, *overrides)
    assert proc.returncode == EXIT_DISK_FULL, proc.stderr[-3000:]
    line = last_line(proc.stderr)
    good = out / ("checkpoint-2" if where == "second_checkpoint" else "checkpoint-4")
    assert line.startswith(f"error: no space left on the device of '{out}'")
    assert f"the last good checkpoint is {good}: " in line
    assert "Traceback" not in proc.stderr
    assert verify_checkpoint(str(good)).ok and not [p for p in os.listdir(out) if p.startswith(".staging")]


# -- torchrun and SIGTERM -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_every_rank_and_torchrun_exits_1(tmp_path):
    """What docs/runs.md promises: torchrun forwards SIGTERM to its workers, which finish the update, write one
    checkpoint and exit 75; torchrun itself then exits 1 (its agent re-raises the signal). The same command with
    training.resume_from_checkpoint=true completes the run. Also the loop engine's 2-process run of the recipe end
    to end (its start in the first launch, its outputs from the second; test_recipe.py has the trainer's)."""
    out = tmp_path / "run"
    overrides = ("training.max_steps=30", "training.save_steps=2")
    process = start_script(TORCHRUN_2, out, *overrides, small=RUNS_SMALL)
    deadline = time.time() + 240
    while not (out / "checkpoint-2").is_dir() and process.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 1, stderr[-3000:]
    assert "x 2 processes" in stderr  # the effective-batch line ([hf_accum] logger)
    assert stdout.count("resolved config:") == 1  # printed by the main process only
    assert stdout.count("importing torch, transformers") == 1
    assert stdout.count("held-out exact match before training: ") == 1
    stops = [line for line in stderr.splitlines() if line.startswith("stopped: training stopped after update")]
    assert stops and all(f"exit code {EXIT_PREEMPTED}" in line for line in stops)
    assert "training.resume_from_checkpoint=true" in stops[0]
    latest = verified_resume_checkpoint(str(out))
    assert latest is not None and not (out / run_outputs.METRICS_NAME).exists()
    resumed = succeeded(run(out, *overrides, "training.resume_from_checkpoint=true", launcher=TORCHRUN_2))
    assert f"resuming from {latest}" in resumed.stdout
    metrics = json.loads((out / run_outputs.METRICS_NAME).read_text())
    check_outputs(out, metrics, eval_examples=4)
    assert metrics["world_size"] == 2
    # Same global batch as one process: the accumulation halves.
    assert (metrics["micro_batch_size"], metrics["accumulation_steps"], metrics["global_batch_size"]) == (8, 2, 32)
    assert len(metrics["updates"]) == 30
    # Sequences are counted over both ranks: 8 x 2 x 2; 240 rows are 15 micro-batches per rank and epoch, 7 windows
    # of 2 and a short last one of 1 (8 x 1 x 2), which is still an update: 8 updates an epoch.
    assert [u["sequences"] for u in metrics["updates"]] == ([32] * 7 + [16]) * 3 + [32] * 6
    assert "held-out exact match after training: 100%" in resumed.stderr  # the main process scores all 4 rows


# -- using a trained run ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_rebuilds_the_tiny_base_and_puts_the_runs_adapter_on_it(finished_pair, tmp_path, capsys):
    """The embedded default's base is built in-process (its adapter names no base on disk): generate rebuilds it
    from resolved_config.yaml. Without the adapter it must answer as the run's base did before training, with it
    as the trained model did after (the recipe's own held-out samples, in metrics.json)."""
    from hf_accum import cli
    from hf_accum.recipe.generate import complete, load_trained

    reference, _, _ = finished_pair
    metrics = json.loads((reference / run_outputs.METRICS_NAME).read_text())
    model, tokenizer, config = load_trained(str(reference))
    budget = config.data.eval_max_new_tokens
    before = metrics["eval_before"]["samples"]
    assert any(sample["generated"] for sample in before)  # the random base says something: a real comparison
    with model.disable_adapter():
        assert [complete(model, tokenizer, s["prompt"], budget) for s in before] == [s["generated"] for s in before]
    after = metrics["eval_after"]["samples"]
    assert [complete(model, tokenizer, s["prompt"], budget) for s in after] == [s["generated"] for s in after]

    assert cli.main(["generate", "--run", str(reference), before[0]["prompt"]]) == 0
    assert capsys.readouterr().out == after[0]["generated"] + "\n"
    unfinished = as_unfinished(reference, tmp_path / "unfinished")
    for run_dir, message in ((tmp_path / "missing", "no such directory"),
                             (tmp_path, "holds no resolved_config.yaml: not a recipe run's output directory"),
                             (unfinished, "holds no adapter/ or model/: the run has not finished")):
        assert cli.main(["generate", "--run", str(run_dir), "hello"]) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith("hf-accum generate: error: --run ") and message in line and "\n" not in line
