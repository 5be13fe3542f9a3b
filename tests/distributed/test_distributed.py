"""hf_accum.recipe.launch: no silent fallback (FSDP on one process, DeepSpeed not installed, one process started
instead of two, an Accelerator that dropped DeepSpeed), the DeepSpeed JSON files and the launcher
configs that point at them (accelerate's own loader and launcher environment, DeepSpeed's own config
parser), and the node layout."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from hf_accum.recipe import launch as D

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = os.path.join(ROOT, "tests", "distributed", "launch_probe.py")
DS_JSONS = sorted(glob.glob(os.path.join(ROOT, "recipes", "deepspeed", "*.json")))
DS_LAUNCHERS = sorted(glob.glob(os.path.join(ROOT, "recipes", "accelerate", "deepspeed_*.yaml")))
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")

TRAINING = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "max_grad_norm": 1.0}
TORCHRUN_2 = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
# What `accelerate launch --cpu --num_processes 2 script.py` leaves in the ONE process it starts (measured).
ACCELERATE_CPU_2 = {"ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": "29500"}


# -- one process instead of two --------------------------------------------------------------------


def test_one_process_instead_of_two_is_refused():
    with pytest.raises(D.LaunchError) as error:
        D.check_launch(TRAINING, ACCELERATE_CPU_2)
    message = str(error.value)
    assert "started only this one" in message and "torchrun --nproc_per_node" in message


@pytest.mark.parametrize(
    "environ, world_size",
    [({}, 1), (TORCHRUN_2, 2), ({"ACCELERATE_USE_CPU": "True"}, 1),
     ({**ACCELERATE_CPU_2, "PMI_SIZE": "2", "PMI_RANK": "0"}, 2)],
    ids=["python", "torchrun", "accelerate_launch_one_process", "accelerate_launch_mpirun"],
)
def test_launches_that_start_what_they_asked_pass(environ, world_size):
    launch = D.check_launch(TRAINING, environ)
    assert launch.backend == D.DDP and launch.world_size == world_size


@pytest.mark.slow
def test_accelerate_launch_cpu_two_processes_is_refused_for_real(tmp_path):
    """The real launcher: one process starts, the check names the 2 processes asked and the torchrun command."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines",
               "1", "--mixed_precision", "no", "--dynamo_backend", "no", PROBE, json.dumps(TRAINING)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert proc.stdout.count("probe started") == 1  # the launcher really started one process
    assert "accelerate launch was asked for 2 processes but started only this one" in proc.stderr
    assert "torchrun --nproc_per_node 2 " in proc.stderr


# -- FSDP on CPU ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "training, environ",
    [({**TRAINING, "fsdp": "full_shard", "use_cpu": True}, {}),
     (TRAINING, {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_CPU": "true"})],
    ids=["training.fsdp+use_cpu", "accelerate_fsdp_config"],
)
def test_fsdp_on_one_process_is_refused(training, environ, monkeypatch):
    monkeypatch.setattr(D, "gpu_like_device_available", lambda: False)
    with pytest.raises(D.LaunchError) as error:
        D.check_launch(training, environ)
    message = str(error.value)
    assert "FSDP was asked for" in message  # what was asked
    assert "would train unsharded" in message  # what would run
    assert "torchrun --nproc_per_node 2" in message  # what works


@pytest.mark.parametrize("gpu", [False, True])
def test_fsdp_on_two_processes_passes_on_cpu_and_gpu(monkeypatch, gpu):
    """On CPU hf_accum runs FSDP2 itself (hf_accum.fsdp), where Accelerate alone would train DDP."""
    monkeypatch.setattr(D, "gpu_like_device_available", lambda: gpu)
    assert D.check_launch({**TRAINING, "fsdp": "full_shard", "use_cpu": not gpu}, TORCHRUN_2).backend == D.FSDP


@pytest.mark.slow
def test_accelerate_fsdp_config_on_this_cpu_starts_fsdp_on_every_process():
    """recipes/accelerate/fsdp.yaml launched here (CPU): 2 processes, both accepted as FSDP."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/fsdp.yaml",
               "--num_processes", "2", PROBE, json.dumps(TRAINING)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"backend": "fsdp", "world_size": 2') == 2


def test_fsdp_and_deepspeed_together_are_refused():
    with pytest.raises(D.LaunchError, match="both DeepSpeed .* and FSDP"):
        D.check_launch({**TRAINING, "fsdp": "full_shard", "deepspeed": DS_JSONS[0]}, {})


# -- DeepSpeed asked for --------------------------------------------------------------------------


def test_missing_deepspeed_install_is_refused(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    with pytest.raises(D.LaunchError) as error:
        D.check_launch({**TRAINING, "deepspeed": "recipes/deepspeed/zero2.json"}, TORCHRUN_2)
    message = str(error.value)
    assert "training.deepspeed=recipes/deepspeed/zero2.json" in message and "pip install 'hf_accum[deepspeed]'" in message


@needs_deepspeed
def test_deepspeed_from_the_config_is_accepted():
    launch = D.check_launch({**TRAINING, "deepspeed": os.path.join(ROOT, "recipes", "deepspeed", "zero3.json")},
                            TORCHRUN_2)
    assert launch.backend == D.DEEPSPEED and launch.world_size == 2
    assert launch.deepspeed_config["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize(
    "change, message",
    [
        ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps=8 but the recipe has gradient_accumulation_steps = 4"),
        ({"train_batch_size": 64}, "train_batch_size=64 but the recipe has"),
        ({"gradient_clipping": 0.5}, "gradient_clipping=0.5 but the recipe has max_grad_norm = 1.0"),
        ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' section"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4"),
    ],
)
def test_deepspeed_config_contradicting_the_recipe_is_refused(change, message):
    config = {**json.load(open(DS_JSONS[0])), **change}
    with pytest.raises(D.LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        D.check_launch({**TRAINING, "deepspeed": config}, TORCHRUN_2)


def test_missing_deepspeed_file_is_refused(tmp_path):
    with pytest.raises(D.LaunchError, match="no such file"):
        D.load_deepspeed_config(str(tmp_path / "nope.json"))


@needs_deepspeed
def test_accelerator_built_with_cpu_true_drops_deepspeed_and_check_engine_says_so(monkeypatch):
    """Accelerate 1.15 ignores DeepSpeed when cpu=True -- the trap loop_accelerator avoids."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from hf_accum.testing import fresh_accelerator

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # Accelerator sets it; restored afterwards
    fresh_accelerator(1)  # resets Accelerate's singletons
    launch = D.check_launch({**TRAINING, "deepspeed": DS_JSONS[0]}, {})
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=launch.deepspeed_config))
    with pytest.raises(D.LaunchError, match="deepspeed was asked for .* but the Accelerator runs NO"):
        D.check_engine(accelerator, launch)
    fresh_accelerator(1)


def offload_launch(**extra) -> D.Launch:
    config = {**json.load(open(os.path.join(ROOT, "recipes", "deepspeed", "zero3_offload.json"))), **extra}
    return D.Launch(D.DEEPSPEED, "training.deepspeed=zero3_offload.json", 2, 1, config)


@pytest.mark.parametrize(
    "optimizer, refused",
    [("SGD", "SGD by DeepSpeedCPUAdam"), ("AdamW", None), ("AdamW_betas", "betas=(0.9, 0.95), eps=1e-08 by"),
     ("Adagrad", None)],
)
def test_zero_offload_optimizer_swap_is_refused_when_it_changes_the_optimizer(optimizer, refused):
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    built = {"SGD": lambda: torch.optim.SGD(params, lr=1.0), "AdamW": lambda: torch.optim.AdamW(params, lr=1e-3),
             "AdamW_betas": lambda: torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95)),
             "Adagrad": lambda: torch.optim.Adagrad(params)}[optimizer]()
    if refused is None:
        D.check_offload_optimizer(built, offload_launch())
    else:
        with pytest.raises(D.LaunchError, match=refused.replace("(", r"\(").replace(")", r"\)")):
            D.check_offload_optimizer(built, offload_launch())
    D.check_offload_optimizer(built, offload_launch(zero_force_ds_cpu_optimizer=False))  # torch's own runs
    no_offload = D.Launch(D.DEEPSPEED, "zero3", 2, 1, json.load(open(os.path.join(ROOT, "recipes", "deepspeed", "zero3.json"))))
    D.check_offload_optimizer(built, no_offload)


# -- the DeepSpeed JSON files and the launcher configs -----------------------------------------------


def test_ready_deepspeed_files_ship():
    assert {os.path.basename(p) for p in DS_JSONS} == {"zero2.json", "zero3.json", "zero3_offload.json"}


@needs_deepspeed
@pytest.mark.parametrize("path", DS_JSONS, ids=os.path.basename)
def test_deepspeed_json_fills_from_the_recipe_and_parses(path):
    """Every batch value is "auto", filled as Accelerate fills it; DeepSpeed's own parser accepts the result."""
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    config = D.load_deepspeed_config(path)
    assert all(config[key] == "auto" for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                 "train_batch_size", "gradient_clipping"))
    plugin = DeepSpeedPlugin(hf_ds_config=config, gradient_accumulation_steps=4, gradient_clipping=1.0)
    plugin.set_mixed_precision("bf16")
    hidden = 32
    plugin.deepspeed_config_process(must_match=False, **{
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 8,
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
    })
    assert "auto" not in json.dumps(plugin.deepspeed_config)
    parsed = DeepSpeedConfig(plugin.deepspeed_config)
    stage = 2 if "zero2" in path else 3
    assert parsed.zero_optimization_stage == stage
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (2, 4)
    assert parsed.gradient_clipping == 1.0 and parsed.bfloat16_config.enabled
    if stage == 3:
        assert parsed.zero_config.gather_16bit_weights_on_model_save  # a ZeRO-3 model can be saved whole
    offload = parsed.zero_config.offload_param
    assert (offload is not None and offload.device == "cpu") == ("offload" in path)


def launcher_environment(yaml_path: str) -> dict:
    """The environment `accelerate launch --config_file yaml_path` gives the script, from accelerate's own
    launcher code (the DeepSpeed branch of accelerate.commands.launch.launch_command)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", yaml_path, "script.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return prepare_deepspeed_cmd_env(args)[1]


@needs_deepspeed
@pytest.mark.parametrize("path", DS_LAUNCHERS, ids=os.path.basename)
def test_deepspeed_launcher_points_at_a_json_accelerate_accepts(path, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin

    config = load_config_from_file(path)
    json_path = config.deepspeed_config["deepspeed_config_file"]
    assert os.path.isfile(os.path.join(ROOT, json_path))
    monkeypatch.chdir(ROOT)  # the launcher configs name the JSON relative to the repository root
    environ = launcher_environment(path)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()  # what Accelerate builds in the script; refuses keys that conflict with the file
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == (2 if "zero2" in path else 3)
    launch = D.check_launch(TRAINING, {**environ, **TORCHRUN_2})
    assert launch.backend == D.DEEPSPEED and launch.source == "accelerate launch (distributed_type: DEEPSPEED)"


@needs_deepspeed
def test_launcher_setting_mixed_precision_next_to_the_json_is_refused_by_accelerate(tmp_path, monkeypatch):
    """Negative control: why the DeepSpeed launcher configs carry no mixed_precision (the JSON's bf16 is
    "auto", filled from the recipe's training.bf16)."""
    from accelerate.utils import DeepSpeedPlugin

    path = tmp_path / "bad.yaml"
    path.write_text(open(DS_LAUNCHERS[0]).read().replace("deepspeed_config:", "mixed_precision: bf16\ndeepspeed_config:"))
    monkeypatch.chdir(ROOT)
    for key, value in launcher_environment(str(path)).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="deepspeed_config_file"):
        DeepSpeedPlugin()


# -- nodes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "environ, nodes",
    [({}, 1), (TORCHRUN_2, 1), ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2),
     ({"GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, 2)],
)
def test_num_nodes_from_the_launcher(environ, nodes):
    assert D.num_nodes(environ) == nodes


# -- leaving the process group (the gloo abort at interpreter exit) ---------------------------------


@pytest.mark.slow
def test_leave_process_group_tears_the_group_down_and_is_a_no_op_without_one(tmp_path):
    """Run in a child: a process group in the pytest process would outlive the test."""
    script = (
        "import torch.distributed as dist\n"
        "from hf_accum.distributed import leave_process_group\n"
        "leave_process_group()\n"  # no group yet: nothing to do, no error
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "assert dist.is_initialized()\n"
        "leave_process_group()\n"
        "print('initialized after:', dist.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "initialized after: False" in done.stdout


def test_every_torchrun_worker_leaves_its_process_group():
    """A worker ending with its gloo group up may abort at exit (SIGABRT) and take the other rank's report
    with it: CI failed that way. Every worker script the tests launch under torchrun ends by leaving it."""
    workers = sorted([*glob.glob(os.path.join(ROOT, "tests", "distributed", "*worker*.py")),
                      *glob.glob(os.path.join(ROOT, "hf_accum", "testing", "cases", "*worker*.py"))])
    assert len(workers) >= 8  # one per family (loop DDP, Trainer + TRL, FSDP2, DeepSpeed) and the story workers
    missing = [os.path.basename(path) for path in workers
               if "leave_process_group()" not in open(path).read().split('if __name__ == "__main__":')[-1]]
    assert not missing, f"workers that exit with the process group up: {missing}"


def test_a_job_that_raises_fails_only_its_own_tests(tmp_path):
    """The job table (hf_accum/testing/jobs.py) records a job's exception and runs the next one; reading that job
    fails with its traceback, the other jobs read normally. In this process: no process group, world size 1."""
    from hf_accum.testing.jobs import run_job_table
    from hf_accum.testing.launch import JobReports, job_report

    def broken(out_dir):
        raise ValueError("normalized by K")

    ran = []
    jobs = {"first": lambda out_dir: {"errors": [0.0]}, "broken": broken,
            "after": lambda out_dir: ran.append(os.path.isdir(out_dir)) or {"errors": [1e-16]}}
    out = tmp_path / "report.json"
    run_job_table(jobs, str(out))
    family = json.loads(out.read_text())
    assert ran == [True] and family["world_size"] == 1
    assert job_report(family, "first") == {"errors": [0.0], "world_size": 1}
    assert JobReports(family)["after"]["errors"] == [1e-16]
    with pytest.raises(AssertionError, match="job 'broken' raised in the worker:(.|\n)*ValueError: normalized by K"):
        JobReports(family)["broken"]
    with pytest.raises(AssertionError, match="job 'missing' is not in the report"):
        job_report(family, "missing")


ABORTING_WORKER = """
import os, sys
out, mode = sys.argv[1], sys.argv[2]
with open(out + ".attempts", "a") as attempts:
    attempts.write("x")
first = os.path.getsize(out + ".attempts") == 1
if mode == "abort_after_report":
    with open(out, "w") as report:
        report.write('{"ok": 1}')
if mode == "abort_without_report" or first:
    sys.stderr.write("terminate called without an active exception\\n")
    sys.stderr.flush()
    os.abort()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["abort_after_report", "abort_without_report"])
def test_run_torchrun_retries_only_an_abort_after_the_report(tmp_path, mode):
    """The gloo abort at exit after the report was written: run once more (with a warning). The same message
    from a worker that wrote no report (one that raised and left its group up): a real failure, not retried."""
    from hf_accum.testing.launch import run_torchrun

    worker = tmp_path / "worker.py"
    worker.write_text(ABORTING_WORKER)
    out = tmp_path / "report.json"
    if mode == "abort_after_report":
        with pytest.warns(UserWarning, match="retried after a rank aborted at exit"):
            assert run_torchrun(str(worker), out, nproc=1, timeout=120, extra_args=[mode]) == {"ok": 1}
        assert (tmp_path / "report.json.attempts").read_text() == "xx"
    else:
        with pytest.raises(AssertionError, match="terminate called without an active exception"):
            run_torchrun(str(worker), out, nproc=1, timeout=120, extra_args=[mode])
        assert (tmp_path / "report.json.attempts").read_text() == "x"
