"""Multi-node: the batch arithmetic in nodes x processes per node (BatchPlan, hf-accum plan), a real
2-node job on this host (torchrun --nnodes 2, c10d rendezvous, 1 process per node) that is exact and
logs its plan, and the SLURM script's launcher commands and requeue decisions (fake srun/scontrol/accelerate on
PATH; hf-accum too where the test is about what follows the plan)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hf_accum.cli import main as cli_main
from hf_accum.planning.schedule import BatchPlan, plan_global_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(__file__)
TWO_NODES = "effective batch 32 = 8 per device x 2 accumulation x 2 processes (2 nodes x 1)"


def test_plan_speaks_nodes():
    assert plan_global_batch(32, 8, num_processes=2, num_nodes=2).describe() == TWO_NODES
    # one node keeps the single-node wording
    assert BatchPlan(8, 2, 2).describe() == "effective batch 32 = 8 per device x 2 accumulation x 2 processes"
    # where the processes run does not change the batch arithmetic (a checkpoint may resume elsewhere)
    assert BatchPlan(8, 2, 2, num_nodes=2) == BatchPlan(8, 2, 2)
    with pytest.raises(ValueError, match="num_processes=3 is not a whole number of processes on each of num_nodes=2"):
        BatchPlan(8, 2, 3, num_nodes=2)


def test_hf_accum_plan_nodes_x_gpus_per_node(capsys):
    assert cli_main(["plan", "--nodes", "2", "--gpus-per-node", "8", "--global-batch-size", "256",
                     "--micro-batch-size", "4"]) == 0
    assert capsys.readouterr().out.strip() == "effective batch 256 = 4 per device x 4 accumulation x 16 processes (2 nodes x 8)"
    assert cli_main(["plan", "--nodes", "2", "--gpus-per-node", "8", "--num-processes", "8", "--global-batch-size",
                     "64", "--micro-batch-size", "4"]) == 2
    assert "--num-processes 8 != --nodes 2 x --gpus-per-node 8 = 16" in capsys.readouterr().err


def test_hf_accum_plan_from_a_recipe_config(capsys):
    config = os.path.join(ROOT, "recipes", "configs", "llama3_8b_lora.yaml")
    assert cli_main(["plan", "--config", config, "--nodes", "2", "--gpus-per-node", "8", "global_batch_size=128"]) == 0
    assert capsys.readouterr().out.strip() == "effective batch 128 = 4 per device x 2 accumulation x 16 processes (2 nodes x 8)"


# -- a real 2-node job on this host ------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    from hf_accum.testing.launch import run_torchrun_nodes

    return run_torchrun_nodes(os.path.join(HERE, "multinode_worker.py"), tmp_path_factory.mktemp("nodes") / "report.json")


@pytest.mark.slow
def test_two_nodes_really_started(two_nodes):
    assert two_nodes["world_size"] == 2
    assert two_nodes["env"]["GROUP_WORLD_SIZE"] == "2" and two_nodes["env"]["LOCAL_WORLD_SIZE"] == "1"


@pytest.mark.slow
def test_two_node_run_is_exact_and_logs_its_plan(two_nodes):
    assert two_nodes["loop_updates"] == len(two_nodes["loop_errors"]) == 3
    assert max(two_nodes["loop_errors"]) < 1e-10, two_nodes["loop_errors"]
    assert len(two_nodes["trainer_errors"]) == 3 and max(two_nodes["trainer_errors"]) < 1e-10
    logged = two_nodes["log_lines"]
    assert sum(line.startswith(TWO_NODES + ";") for line in logged) == 1  # the loop
    assert TWO_NODES + " (sequences per update)" in logged  # AccumTrainer


# -- the SLURM script --------------------------------------------------------------------------------

FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST -> one host per line; scontrol requeue JOB -> logged
[ "$1" = requeue ] && echo "requeue $2" >> "$FAKE_DIR/scontrol.log"
[ "$1 $2" = "show hostnames" ] && [ "$3" = "gpu[07-08]" ] && printf 'gpu07\\ngpu08\\n'
exit 0
"""
FAKE_SCANCEL = """#!/bin/bash
# scancel --signal=USR1 JOB: the training processes would checkpoint and stop
echo "$@" >> "$FAKE_DIR/scancel.log"
touch "$FAKE_DIR/stop"
"""
FAKE_SRUN = """#!/bin/bash
# one task per node, each with its node id (sequentially here)
for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node SLURM_PROCID=$node "$@"; done
"""
FAKE_ACCELERATE = """#!/bin/bash
# record the launcher command instead of launching; then act out FAKE_MODE in FAKE_OUT (the run's output dir)
python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" >> "$FAKE_ACCELERATE_LOG"
checkpoint() { mkdir -p "$FAKE_OUT/checkpoint-$1" && touch "$FAKE_OUT/checkpoint-$1/hf_accum_plan.json"; }
case "${FAKE_MODE:-}" in
  preempted)  # train until scancel's signal, then checkpoint; the launcher reports the 75 as 1
    touch "$FAKE_DIR/started"
    for _ in $(seq 600); do [ -e "$FAKE_DIR/stop" ] && break; sleep 0.1; done
    checkpoint 6; exit 1 ;;
  crashed_after_a_checkpoint) checkpoint 6; exit 1 ;;
  crashed) exit 1 ;;
  finished) checkpoint 8; touch "$FAKE_OUT/metrics.json"; exit 0 ;;
esac
"""
FAKE_HF_ACCUM = """#!/bin/bash
# hf-accum for the tests of what the script does with the plan's verdict (saving its ~5 CPU-s start-up): the
# arguments recorded, nothing printed, exit FAKE_PLAN_EXIT. The real one: test_slurm_script_builds_one_launcher_per_node.
echo "$@" >> "$FAKE_DIR/hf-accum.log"
exit "${FAKE_PLAN_EXIT:-0}"
"""


def fake_bin(directory, real_plan: bool) -> str:
    fakes = {"scontrol": FAKE_SCONTROL, "srun": FAKE_SRUN, "accelerate": FAKE_ACCELERATE, "scancel": FAKE_SCANCEL}
    if not real_plan:
        fakes["hf-accum"] = FAKE_HF_ACCUM
    for name, text in fakes.items():
        path = directory / name
        path.write_text(text)
        path.chmod(0o755)
    return str(directory)


def slurm_env(tmp_path, real_plan: bool, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        # fakes first, then this interpreter's bin (the real hf-accum, unless faked)
        "PATH": os.pathsep.join([fake_bin(tmp_path, real_plan), os.path.dirname(sys.executable), os.environ["PATH"]]),
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
        "FAKE_ACCELERATE_LOG": str(tmp_path / "accelerate.log"), "FAKE_DIR": str(tmp_path), **extra,
    }


SLURM_SCRIPT = os.path.join(ROOT, "recipes", "accelerate", "slurm_multi_node.sh")
PLAN_ARGS = "plan --config recipes/configs/llama3_8b_lora.yaml --nodes 2 --gpus-per-node 8"


def run_slurm_script(tmp_path, *overrides: str, real_plan: bool = True,
                     **extra: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    log = tmp_path / "accelerate.log"
    proc = subprocess.run(["bash", SLURM_SCRIPT, *overrides], cwd=ROOT, env=slurm_env(tmp_path, real_plan, **extra),
                          capture_output=True, text=True, timeout=120)
    launches = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, launches


def with_an_earlier_jobs_checkpoint(tmp_path):
    """``tmp_path/run`` holding checkpoint-2 of an earlier job (old: not progress of this one)."""
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "hf_accum_plan.json").touch()
    os.utime(out / "checkpoint-2" / "hf_accum_plan.json", (0, 0))
    return out


def planned(tmp_path) -> list[str]:
    """What the script asked the fake hf-accum, one call a line."""
    return (tmp_path / "hf-accum.log").read_text().splitlines()


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory):
    """One job end to end with the real hf-accum plan, whose run finishes (metrics.json): read for what the script
    prints and launches, and for its not requeueing. (tmp dir, run dir, the script's process, the launches)"""
    tmp_path = tmp_path_factory.mktemp("slurm")
    out = with_an_earlier_jobs_checkpoint(tmp_path)
    proc, launches = run_slurm_script(tmp_path, f"training.output_dir={out}", "training.max_steps=100",
                                      FAKE_MODE="finished", FAKE_OUT=str(out))
    return tmp_path, out, proc, launches


@pytest.mark.slow  # hf-accum's start-up (torch, transformers) dominates
def test_slurm_script_builds_one_launcher_per_node(finished_job):
    _, out, proc, launches = finished_job
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "effective batch 64 = 4 per device x 1 accumulation x 16 processes (2 nodes x 8)"
    assert len(launches) == 2
    for node_rank, argv in enumerate(launches):
        assert option(argv, "--config_file") == "recipes/accelerate/multi_node.yaml"
        assert option(argv, "--num_machines") == "2"
        assert option(argv, "--num_processes") == "16"
        assert option(argv, "--machine_rank") == str(node_rank)
        assert option(argv, "--main_process_ip") == "gpu07"  # the first host of the allocation
        assert option(argv, "--main_process_port") == "29500"
        script = argv.index("recipes/finetune_llama.py")
        # A requeued job continues from its latest complete checkpoint (a first start has none: it starts fresh).
        assert argv[script + 1:] == ["--config", "recipes/configs/llama3_8b_lora.yaml",
                                     "training.resume_from_checkpoint=true", f"training.output_dir={out}",
                                     "training.max_steps=100"]


@pytest.mark.slow
def test_slurm_script_stops_before_launching_when_the_batch_does_not_divide(tmp_path, capsys):
    # The plan's verdict on the command the script gives it (in this process: the real plan of the script's
    # command runs in test_slurm_script_builds_one_launcher_per_node) ...
    assert cli_main([*PLAN_ARGS.split(), "global_batch_size=100"]) == 2
    assert "nearest valid global_batch_size: 64 or 128" in capsys.readouterr().err
    # ... and what the script does with it: that command, then nothing launched, and the plan's exit code.
    proc, launches = run_slurm_script(tmp_path, "global_batch_size=100", real_plan=False, FAKE_PLAN_EXIT="2")
    assert planned(tmp_path) == [f"{PLAN_ARGS} global_batch_size=100"]
    assert proc.returncode == 2 and launches == []


def requeues(tmp_path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("mode, requeued, code", [
    ("crashed_after_a_checkpoint", True, 0),  # progress was made (a node failure, a SIGTERM to the steps): again
    ("crashed", False, 1),                    # no new checkpoint: a crash that repeats must not loop
    ("finished", False, 0),                   # the job of test_slurm_script_builds_one_launcher_per_node
])
def test_slurm_script_requeues_on_a_new_checkpoint_not_on_the_launchers_exit_code(mode, requeued, code, tmp_path,
                                                                                   request):
    if mode == "finished":
        tmp_path, out, proc, _ = request.getfixturevalue("finished_job")
    else:
        out = with_an_earlier_jobs_checkpoint(tmp_path)
        proc, _ = run_slurm_script(tmp_path, f"training.output_dir={out}", real_plan=False, FAKE_MODE=mode,
                                   FAKE_OUT=str(out))
        assert planned(tmp_path) == [f"{PLAN_ARGS} training.output_dir={out}"]
    assert proc.returncode == code, proc.stderr
    assert requeues(tmp_path) == (["requeue 4242"] if requeued else [])
    if requeued:
        assert f"the run resumes from {out}/checkpoint-6" in proc.stdout


@pytest.mark.slow
def test_slurm_script_told_to_stop_signals_the_training_and_requeues(tmp_path):
    out = tmp_path / "run"
    env = slurm_env(tmp_path, real_plan=False, FAKE_MODE="preempted", FAKE_OUT=str(out))
    proc = subprocess.Popen(["bash", SLURM_SCRIPT, f"training.output_dir={out}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "started").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends to the batch script
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert planned(tmp_path) == [f"{PLAN_ARGS} training.output_dir={out}"]
    assert (tmp_path / "scancel.log").read_text().split() == ["--signal=USR1", "4242"]
    assert requeues(tmp_path) == ["requeue 4242"]
    assert f"srun exited with 1; the run resumes from {out}/checkpoint-6" in stdout
