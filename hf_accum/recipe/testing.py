"""Test support for the recipe kit: run ``recipes/finetune_llama.py`` of this checkout as a user does (a
subprocess under python, ``accelerate launch`` or torchrun) or in-process through the kit's exit-code wrapper,
and read what it wrote. THE one runner of the suite: every test that starts the recipe builds its command line
with :func:`recipe_command` and starts it with :func:`run_script` (to its end) or :func:`start_script` (to
signal it, or run another beside it). It lives in the kit, not in :mod:`hf_accum.testing`, because the library
never imports the kit. Needs the repository checkout (the script is not installed).

Retries: a 2-process launch is run a second time only for one named upstream failure, the gloo abort at
interpreter exit (:data:`hf_accum.testing.launch.EXIT_ABORT_SIGNATURE`) after the run wrote its metrics, and the
retry is announced with a warning carrying the first output. Any other failure (a lock or barrier race, a rank
that raised) fails at once: retrying it would hide an intermittent fault of the product.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from hf_accum.recipe import outputs as run_outputs
from hf_accum.testing.launch import EXIT_ABORT_SIGNATURE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "recipes", "finetune_llama.py")
# A short run of the embedded default: small data, few updates, every update logged.
SMALL = ["data.num_train_examples=240", "data.num_eval_examples=8", "training.logging_steps=1"]
# 10 updates with a checkpoint at 5: the runs the DeepSpeed and FSDP recipe tests compare with the DDP run.
TEN_UPDATES = ["training.max_steps=10", "training.save_steps=5", "data.num_train_examples=400"]

PYTHON = [sys.executable]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]


RECIPE_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def recipe_env() -> dict[str, str]:
    """This process's environment with one torch thread and no hub (what every recipe run of the suite gets)."""
    return {**os.environ, **RECIPE_ENV}


def recipe_arguments(out: Any, *overrides: str, small: Sequence[str] = SMALL) -> list[str]:
    """The recipe's arguments: ``SMALL training.output_dir=OUT OVERRIDES`` (a later key wins)."""
    return [*small, f"training.output_dir={out}", *overrides]


def recipe_command(launcher: Sequence[str], out: Any, *overrides: str, small: Sequence[str] = SMALL) -> list[str]:
    """``launcher recipes/finetune_llama.py SMALL training.output_dir=OUT OVERRIDES``."""
    return [*launcher, SCRIPT, *recipe_arguments(out, *overrides, small=small)]


def start_script(launcher: Sequence[str], out: Any, *overrides: str,
                 small: Sequence[str] = SMALL) -> subprocess.Popen[str]:
    """Start the recipe script and return at once, its output piped (a test that signals the run, or starts a
    second run beside it)."""
    return subprocess.Popen(recipe_command(launcher, out, *overrides, small=small), cwd=ROOT, env=recipe_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_script(launcher: Sequence[str], out: Any, *overrides: str, small: Sequence[str] = SMALL,
               timeout: int = 240, check: bool = True) -> subprocess.CompletedProcess:
    """Run the recipe script to its end; with ``check`` it must exit 0 (else the process is returned whatever its
    exit code, for a test of a refusal or a kill). A 2-process launch whose ranks wrote the run's metrics and then
    failed with the gloo abort at exit is run once more from the same starting files (its output directory as
    it was before), with a warning carrying the first output; every other failure raises at once."""
    cmd = recipe_command(launcher, out, *overrides, small=small)
    two_processes = list(launcher) == TORCHRUN_2
    with tempfile.TemporaryDirectory() as saved:
        before = os.path.join(saved, "out")
        if two_processes and os.path.isdir(out):
            shutil.copytree(out, before, symlinks=True)
        metrics_before = _modified(out)
        proc = subprocess.run(cmd, cwd=ROOT, env=recipe_env(), capture_output=True, text=True, timeout=timeout)
        if two_processes and _aborted_at_exit(proc, out, metrics_before):
            warnings.warn("recipe run retried after a rank aborted at exit (gloo, after the metrics were "
                          f"written):\n{proc.stderr[-3000:]}", stacklevel=2)
            shutil.rmtree(out, ignore_errors=True)
            if os.path.isdir(before):
                shutil.copytree(before, out, symlinks=True)
            proc = subprocess.run(cmd, cwd=ROOT, env=recipe_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-3000:]}\n{_stderr_by_rank(proc.stderr)}")
    return proc


def _modified(out: Any) -> int | None:
    """The modification time of ``out``'s metrics.json (ns), None when there is none."""
    path = os.path.join(out, run_outputs.METRICS_NAME)
    return os.stat(path).st_mtime_ns if os.path.exists(path) else None


def _aborted_at_exit(proc: subprocess.CompletedProcess, out: Any, metrics_before: int | None) -> bool:
    """The known gloo exit abort: a failed run that wrote its metrics (this run, not an earlier one) and whose
    output carries the abort's message."""
    written = _modified(out) not in (None, metrics_before)
    return proc.returncode != 0 and written and EXIT_ABORT_SIGNATURE in proc.stderr


def _stderr_by_rank(stderr: str, lines: int = 30) -> str:
    """The end of each rank's traceback (torchrun prefixes them ``[rankN]:``) and of the rest: the rank that
    failed first is rarely the one whose traceback ends the output."""
    ranks = sorted({line.split("]:", 1)[0] + "]" for line in stderr.splitlines() if line.startswith("[rank")})
    parts = [f"--- stderr {rank}\n" + "\n".join([ln for ln in stderr.splitlines() if ln.startswith(rank)][-lines:])
             for rank in ranks]
    rest = [ln for ln in stderr.splitlines() if not ln.startswith("[rank")]
    return "\n".join(parts + ["--- stderr (other lines)\n" + "\n".join(rest[-lines:])])


def read_metrics(out: Any) -> dict:
    import json

    with open(os.path.join(out, run_outputs.METRICS_NAME)) as fh:
        return json.load(fh)


def held_out_losses(out: Any) -> dict[int, float]:
    """update -> the held-out loss scored after it, for the updates of the run in ``out`` that scored one."""
    return {update["step"]: update["eval_loss"] for update in read_metrics(out)["updates"]
            if update.get("eval_loss") is not None}


def bad_input_errors() -> tuple[type[Exception], ...]:
    from hf_accum.recipe.config import ConfigError
    from hf_accum.recipe.data import DataError
    from hf_accum.recipe.modeling import ModelError

    return (ConfigError, DataError, ModelError)


BAD_INPUT = bad_input_errors()


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("finetune_llama", SCRIPT)
    assert spec is not None and spec.loader is not None, SCRIPT
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(*argv: str) -> subprocess.CompletedProcess:
    """The recipe's ``main`` in THIS process through the kit's exit-code wrapper, as ``python finetune_llama.py
    ARGV`` would exit (2 for bad input, one ``error:`` line; 75 stopped by a signal, 5 by inf/NaN updates, 3 for a
    full disk): its exit code and what it printed, as a finished process (no process started: for tests/unit, and
    wherever a process of its own would show nothing more). Its stderr holds what the script's stderr would: the
    library's log lines (``[hf_accum] ...``) and tqdm's bars with the ``error:`` line. One torch thread, as
    :func:`run_script`'s processes have: a run here and one there compute the same numbers."""
    import torch

    from hf_accum.control import NonFiniteLossError, TrainingStopped

    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _log_handlers_writing_to(err):
            code = run_outputs.run_cli(load_script().main, list(argv), bad_input=BAD_INPUT,
                                       stopped=(TrainingStopped, NonFiniteLossError))
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess([SCRIPT, *argv], code, stdout=out.getvalue(), stderr=err.getvalue())


@contextlib.contextmanager
def _log_handlers_writing_to(stream: io.StringIO) -> Iterator[None]:
    """Every plain ``logging.StreamHandler`` of this process (hf_accum's ``[hf_accum]`` lines, transformers') writes
    to ``stream`` meanwhile: a handler keeps the stream it was made with (the stderr of whichever test first
    imported the library), so redirecting ``sys.stderr`` alone would not catch a run's log lines. Handlers on
    stdout are left alone; subclasses (files, pytest's log capture) too."""
    import logging

    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    stdouts = (sys.__stdout__, sys.stdout)
    handlers = {id(handler): handler for logger in loggers for handler in logger.handlers
                if type(handler) is logging.StreamHandler and handler.stream not in stdouts}
    swapped = [(handler, handler.stream) for handler in handlers.values()]
    for handler, _ in swapped:
        _point(handler, stream)
    try:
        yield
    finally:
        for handler, previous in reversed(swapped):
            _point(handler, previous)


def _point(handler: Any, stream: Any) -> None:
    """``handler.setStream`` without its flush of the old stream: a handler made while an earlier test's captured
    stderr was ``sys.stderr`` still holds that stream, closed since ("I/O operation on closed file" on flush)."""
    handler.acquire()
    try:
        handler.stream = stream
    finally:
        handler.release()


def fails_cleanly(argv: list[str], out: Any, capsys: Any, must_not_exist: bool = True) -> str:
    """Exit code 2, one ``error:`` line last, and nothing written (``out`` absent, or unchanged)."""
    before = snapshot(out)
    script = load_script()
    code = run_outputs.run_cli(script.main, [*SMALL, f"training.output_dir={out}", *argv], bad_input=BAD_INPUT)
    err = capsys.readouterr().err
    assert code == 2, err
    assert snapshot(out) == before, "nothing may be written when validation fails"
    if must_not_exist:
        assert not os.path.exists(out)
    assert err.strip().splitlines()[-1].startswith("error: ")  # one clear line, last
    return err


def snapshot(path: Any) -> dict:
    """Every file under ``path`` with its size and modification time (or the file itself)."""
    path = str(path)
    if os.path.isfile(path):
        return {path: (os.path.getsize(path), os.path.getmtime(path))}
    return {os.path.join(root, name): (os.path.getsize(os.path.join(root, name)),
                                       os.path.getmtime(os.path.join(root, name)))
            for root, _, names in os.walk(path) for name in names}


def write(path: Any, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def load_adapter(out: Any) -> dict:
    """The LoRA adapter a recipe run saved in ``out``."""
    from safetensors.torch import load_file

    return load_file(os.path.join(out, run_outputs.ADAPTER_DIR, "adapter_model.safetensors"))


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[key].double() - b[key].double()).abs().max()) for key in a)


def cut_after_checkpoint(finished: Any, cut: Any, update: int) -> None:
    """``cut``: ``finished`` as a kill right after ``checkpoint-<update>`` would have left it."""
    import yaml

    from hf_accum.recipe.config import RESOLVED_CONFIG_NAME

    shutil.copytree(finished, cut)
    for name in os.listdir(cut):
        later = name.startswith("checkpoint-") and int(name.split("-")[1]) > update
        if later or name in (run_outputs.METRICS_NAME, run_outputs.ADAPTER_DIR, run_outputs.PLOT_NAME):
            path = os.path.join(cut, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    config_path = os.path.join(cut, RESOLVED_CONFIG_NAME)
    with open(config_path) as handle:
        resolved = yaml.safe_load(handle)
    resolved["training"]["output_dir"] = str(cut)  # the same command, in its own directory
    with open(config_path, "w") as handle:
        yaml.safe_dump(resolved, handle)


def check_outputs(out: Any, metrics: dict, lora: bool = True, eval_examples: int = 8) -> None:
    """What every finished run of the embedded default (``SMALL``) leaves in ``out``: the adapter (LoRA A and B,
    the ``modules_to_save``), the resolved config naming ``out``, the plot, the held-out scores before and after,
    and the utilization of every update (model FLOPs, FLOP/s, MFU against the peak)."""
    import math

    from safetensors.torch import load_file

    from hf_accum.recipe import config as recipe_config

    folder = run_outputs.ADAPTER_DIR if lora else run_outputs.MODEL_DIR
    weights = load_file(os.path.join(out, folder, "adapter_model.safetensors"))
    assert any("lora_A" in k for k in weights) and any("lora_B" in k for k in weights)
    assert any("embed_tokens" in k for k in weights)  # modules_to_save are saved with the adapter
    saved = recipe_config.build_config(recipe_config.load_yaml(os.path.join(out, recipe_config.RESOLVED_CONFIG_NAME)))
    assert saved.training["output_dir"] == str(out)
    assert os.path.getsize(os.path.join(out, run_outputs.PLOT_NAME)) > 1000
    assert metrics["eval_before"]["examples"] == eval_examples and metrics["eval_after"]["examples"] == eval_examples
    assert metrics["data"]["train_examples"] == 240
    assert all(u["flops"] > 0 for u in metrics["updates"])
    assert metrics["flops_per_update"] > 0 and metrics["flops_per_second"] > 0 and metrics["mfu"] > 0
    assert math.isclose(metrics["mfu"], metrics["flops_per_second"] / metrics["peak_flops"], rel_tol=1e-6)
