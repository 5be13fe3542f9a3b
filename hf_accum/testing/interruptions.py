"""What the resume workers share: their command line, the interruptions they inject into themselves (a real
SIGKILL or SIGTERM of the worker process), and the per-update records the tests compare.

A worker runs as ``python WORKER OUT TAG [--kill-at-micro-batch N] [--kill-in-save U] [--sigterm-at-update U]
[--sigterm-rank R]`` (or under torchrun). Every run of one story uses the same ``OUT`` (its checkpoints are in
``OUT/run``) and its own ``TAG``; rank 0 writes ``OUT/records/TAG/update-<n>.pt`` per update (the gradient the
optimizer applied, the LR, the logged loss) and, when training completes, ``OUT/final-TAG.pt`` (the trained
weights) and ``OUT/result-TAG.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any, Callable

import torch

from hf_accum.checkpoint import STAGING_PREFIX, latest_complete_checkpoint


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
