"""What the resume workers share: their command line, the interruptions they inject into themselves (a real
SIGKILL or SIGTERM of the worker process), and the per-update records the tests compare.

A worker runs as ``python WORKER OUT TAG [--kill-at-micro-batch N] [--kill-in-save U] [--sigterm-at-update U]
[--sigterm-rank R]`` (or under torchrun). Every run of one story uses the same ``OUT`` (its checkpoints are in
``OUT/run``) and its own ``TAG``; rank 0 writes ``OUT/records/TAG/update-<n>.pt`` per update (the gradient the
optimizer applied, the LR, the logged loss) and, when training completes, ``OUT/final-TAG.pt`` (the trained
weights) and ``OUT/result-TAG.json``.

Ctrl-C as a user types it: :class:`Terminal` runs a launcher in a pseudo-terminal, and the recipe under it
(``hf_accum/testing/cases/ctrl_c_recipe.py``) pauses where the test types each Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import torch

from hf_accum.checkpointing.checkpoint import STAGING_PREFIX, latest_complete_checkpoint
from hf_accum.checkpointing.run_lock import LOCK_NAME


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("--kill-at-micro-batch", type=int, default=0,
                        help="SIGKILL this process when the collator builds its N-th micro-batch")
    parser.add_argument("--kill-in-save", type=int, default=0,
                        help="SIGKILL this process in the middle of writing checkpoint-U")
    parser.add_argument("--sigterm-at-update", type=int, default=0, help="send SIGTERM to this process after update U")
    parser.add_argument("--sigterm-rank", type=int, default=0)
    return parser.parse_args(argv)


def run_dir(out: str) -> str:
    return os.path.join(out, "run")


def left_behind(out: str) -> list[str]:
    """What the story's runs left in ``OUT/run`` (a SIGKILLed run also leaves its lock file: not listed)."""
    return sorted(name for name in os.listdir(run_dir(out)) if name != LOCK_NAME)


def resume_argument(out: str) -> bool | None:
    """The same command for the first run and every restart: Trainer's ``resume_from_checkpoint=True`` (the
    latest complete checkpoint) once there is one."""
    return True if latest_complete_checkpoint(run_dir(out)) else None


class KillAtMicroBatch:
    """Collator wrapper: SIGKILL when building the N-th micro-batch (0: never), i.e. in the middle of a window."""

    def __init__(self, collator: Callable, n: int) -> None:
        self.collator = collator
        self.n = n
        self.calls = 0

    def __call__(self, examples: list[dict]) -> Any:
        self.calls += 1
        if self.calls == self.n:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.collator(examples)


def kill_during_checkpoint_write(update: int) -> None:
    """SIGKILL right after the first file of ``checkpoint-<update>`` is written (``torch.save`` patched in this
    worker process only): the checkpoint's staging directory is left half-written."""
    if not update:
        return
    original = torch.save
    marker = f"{STAGING_PREFIX}checkpoint-{update}"

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        original(obj, f, *args, **kwargs)
        if marker in str(f):
            os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def maybe_sigterm(args: argparse.Namespace, update: int, rank: int) -> None:
    """A real SIGTERM to this process after ``update`` (the run must finish the next update and stop)."""
    if args.sigterm_at_update and update == args.sigterm_at_update and rank == args.sigterm_rank:
        os.kill(os.getpid(), signal.SIGTERM)


class Recorder:
    """Per-update records of one run (rank 0 writes them). ``grad`` is the flat gradient the optimizer was
    handed (None for an update that applied nothing)."""

    def __init__(self, out: str, tag: str, enabled: bool) -> None:
        self.folder = os.path.join(out, "records", tag)
        self.enabled = enabled
        self.pending_grad: torch.Tensor | None = None
        if enabled:
            os.makedirs(self.folder, exist_ok=True)

    def optimizer_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        flat = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        self.pending_grad = torch.cat(flat).detach().clone()

    def update(self, step: int, learning_rate: float, loss: float, applied: bool) -> None:
        grad, self.pending_grad = self.pending_grad, None
        if self.enabled:
            path = os.path.join(self.folder, f"update-{step}.pt")
            torch.save({"grad": grad if applied else None, "lr": learning_rate, "loss": loss, "applied": applied},
                       path + ".tmp")
            os.replace(path + ".tmp", path)

    def finish(self, out: str, tag: str, weights: dict[str, torch.Tensor], result: Any) -> None:
        if self.enabled:
            torch.save(weights, os.path.join(out, f"final-{tag}.pt"))
            with open(os.path.join(out, f"result-{tag}.json"), "w") as handle:
                json.dump(result, handle)


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


# -- reading a story back (used by the tests) ------------------------------------------------------------


def read_records(out: str, tag: str) -> dict[int, dict]:
    folder = os.path.join(out, "records", tag)
    if not os.path.isdir(folder):
        return {}
    records = {}
    for name in os.listdir(folder):
        if name.startswith("update-") and name.endswith(".pt"):
            records[int(name[len("update-"):-3])] = torch.load(os.path.join(folder, name), weights_only=True)
    return records


def stitched(out: str, tags: list[str]) -> dict[int, dict]:
    """The run as it finally happened: each update as recorded by the last run that executed it."""
    records: dict[int, dict] = {}
    for tag in tags:
        records.update(read_records(out, tag))
    return records


def assert_same_run(reference: dict[int, dict], resumed: dict[int, dict], tolerance: float = 1e-12) -> None:
    """Update for update: the same applied gradient (relative error <= tolerance), LR and logged loss."""
    assert sorted(resumed) == sorted(reference), (sorted(resumed), sorted(reference))
    for step in sorted(reference):
        want, got = reference[step], resumed[step]
        assert got["applied"] == want["applied"], step
        assert got["lr"] == want["lr"], (step, got["lr"], want["lr"])
        assert abs(got["loss"] - want["loss"]) <= tolerance * abs(want["loss"]), (step, got["loss"], want["loss"])
        if want["grad"] is not None:
            error = torch.linalg.vector_norm(got["grad"] - want["grad"]) / torch.linalg.vector_norm(want["grad"])
            assert error <= tolerance, (step, float(error))


# -- Ctrl-C typed into a terminal (tests/integration/test_interrupted_runs.py) ----------------------------


class Terminal:
    """A command run the way a shell runs a foreground job in a terminal: in a pseudo-terminal that is its
    controlling terminal, as the leader of its session and of the terminal's foreground process group.

    :meth:`type_ctrl_c` writes the byte 0x03 as a keyboard does: the terminal's line discipline sends SIGINT to
    the foreground process group (whichever it is then), exactly as for a user's Ctrl-C. Everything the processes
    write to the terminal is collected in :attr:`output` (``\\r\\n`` read as ``\\n``).
    """

    def __init__(self, command: list[str], env: dict[str, str], cwd: str) -> None:
        master, slave = os.openpty()
        self.process = subprocess.Popen([sys.executable, "-c", _WITH_CONTROLLING_TERMINAL, *command], stdin=slave,
                                        stdout=slave, stderr=slave, env=env, cwd=cwd, start_new_session=True)
        os.close(slave)
        self.master = master
        self.output = ""
        self.closed = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every process has closed the terminal
                chunk = b""
            with self._changed:
                if not chunk:
                    self.closed = True
                    self._changed.notify_all()
                    return
                self.output += chunk.decode(errors="replace").replace("\r\n", "\n")
                self._changed.notify_all()

    def wait_for(self, text: str, timeout: float, start: int = 0) -> int:
        """The end of the first ``text`` in the output after position ``start``, waiting up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while (found := self.output.find(text, start)) < 0:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise AssertionError(f"{text!r} not seen in {timeout:.0f} s; output:\n{self.output[-4000:]}")
                self._changed.wait(min(left, 1.0))
            return found + len(text)

    def type_ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def wait(self, timeout: float) -> tuple[int, float]:
        """The command's exit code and when it was seen to end (``time.monotonic()``)."""
        code = self.process.wait(timeout)
        ended = time.monotonic()
        self._reader.join(timeout)  # the rest of the output (workers that outlived the launcher included)
        return code, ended

    def close(self, stray_pids: list[int]) -> None:
        """Kill what is left (the launcher's group, and ``stray_pids``: workers in sessions of their own)."""
        for kill in (lambda: os.killpg(self.process.pid, signal.SIGKILL),
                     *(lambda pid=pid: os.kill(pid, signal.SIGKILL) for pid in stray_pids)):
            try:
                kill()
            except OSError:
                pass
        self.process.wait()
        self._reader.join(5)
        os.close(self.master)


# Run in the new session's leader (no preexec_fn: the test process may have threads): its standard input, the
# pseudo-terminal, becomes its controlling terminal; then it becomes the command (the same process).
_WITH_CONTROLLING_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execvp(sys.argv[1], sys.argv[1:])"
)


def worker_pids(output: str) -> list[int]:
    """The pids the Ctrl-C workers (hf_accum/testing/cases/ctrl_c_recipe.py) announced."""
    return [int(pid) for pid in re.findall(r"ctrl-c test: rank \d+ pid (\d+)", output)]


def worker_exits(report_dir: str) -> dict[int, dict]:
    """rank -> {"code", "monotonic", "pid"} of every Ctrl-C worker that ended through Python's exit."""
    exits = {}
    for name in os.listdir(report_dir):
        if name.startswith("exit-") and name.endswith(".json"):
            with open(os.path.join(report_dir, name)) as handle:
                exits[int(name[len("exit-"):-len(".json")])] = json.load(handle)
    return exits
