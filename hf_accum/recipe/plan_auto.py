"""``hf-accum plan --auto``: the micro-batch a memory budget allows, measured on this device.

Builds the model a recipe config describes (model, LoRA/QLoRA, dtype, activation checkpointing: the
same builder the recipe uses; with no ``--config``, the embedded CPU default), measures the peak memory
of a training step at a few micro-batch sizes of ``--max-length``-token rows, and prints the largest
micro-batch that divides the per-process batch and fits the budget, with its accumulation steps, as a
table (:func:`hf_accum.measure.memory.plan_micro_batch` holds the method).

**The planner stays inside its own budget**: this process never imports torch, never reads the model and never
builds it (about 40 MB). Everything else runs in child processes (:mod:`hf_accum.recipe.plan_probe`), one at a
time, that this process watches: one reads and checks the config, then one per probe. On CPU, where the budget is
this machine's RAM, a child is stopped as soon as the two processes' resident memory together would cross 95% of
the budget, and that micro-batch counts as not fitting (the table shows the memory it had reached, ``> ...
(stopped)``, and a line says which probe was stopped). Two backstops for a loaded machine, where this process may
not be scheduled in time: each child starts with its private memory capped (``RLIMIT_DATA``) at what the budget
leaves, and a probe, once its imports are done, caps its own further growth at what is left of it. A probe's
measured peak is the larger of its tensor peak and (on CPU) its whole-process peak RSS: what a training process at
that micro-batch really needs. When even micro-batch 1 does not fit, the command says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any, Callable

import psutil

from hf_accum.measure.memory import MemoryBudgetError, OverBudget, format_bytes, parse_bytes, plan_micro_batch
from hf_accum.planning.schedule import BatchPlan

_POLL_SECONDS = 0.005
_SAFETY = 0.95
"""Stop a child at 95% of the budget: memory can grow between two polls."""


def run_auto_plan(args: argparse.Namespace, processes: int) -> int:
    given_budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    argv = _recipe_argv(args)
    if args.global_batch_size is not None:  # refused before a child starts (the config is read in one, seconds)
        per_process_batch(args.global_batch_size, processes)
    watch = ProbeWatch(given_budget, announce=lambda line: print(line, flush=True))
    # The config is read in a child too: the answers need torch (the device and its free memory) and the model
    # check (hf_accum.recipe.modeling); reading the config alone would not (hf_accum.recipe.config imports no torch).
    setup = watch.resolve({"argv": argv, "max_length": args.max_length,
                           "global_batch_size": args.global_batch_size, "processes": processes})
    budget = given_budget or int(setup["default_budget"])
    watch.budget = budget if setup["device"] == "cpu" else None  # a GPU budget is the GPU's memory, not RAM
    print(f"measuring {setup['model']} on {setup['device']} ({setup['max_length']}-token rows, "
          f"{setup['precision']} mixed precision), budget {format_bytes(budget)} per process ...", flush=True)
    spec = {key: setup[key] for key in ("device", "precision", "max_length")}
    spec["argv"] = argv
    try:
        plan = plan_micro_batch(lambda m: watch.measure(dict(spec, micro_batch=m)), setup["per_process"], budget)
    except MemoryBudgetError:
        for line in watch.measures(budget):  # one memory measure a line, each named
            print(line, flush=True)
        raise MemoryBudgetError(f"no micro-batch fits the budget of {format_bytes(budget)} per process (larger "
                                f"micro-batches not probed); to fit micro-batch 1: {advice(setup)}") from None
    print(plan.table())
    print(f"planner peak {format_bytes(watch.peak)} (this process + its probe), budget {format_bytes(budget)}")
    assert plan.micro_batch is not None and plan.accumulation_steps is not None
    chosen = BatchPlan(plan.micro_batch, plan.accumulation_steps, processes, args.nodes)
    print(f"{chosen.describe()}: measured peak {format_bytes(plan.measured[plan.micro_batch])} <= "
          f"{format_bytes(budget)}")
    print(f"use: training.per_device_train_batch_size={plan.micro_batch} "
          f"global_batch_size={chosen.global_batch_size}")
    return 0


def per_process_batch(global_batch: int, processes: int) -> int:
    """Sequences per process per update: ``global_batch`` over the processes, which must divide it."""
    if global_batch < 1 or global_batch % processes:
        raise ValueError(f"global batch {global_batch} is not a positive multiple of {processes} "
                         f"process{'' if processes == 1 else 'es'}")
    return global_batch // processes


def advice(setup: dict[str, Any]) -> str:
    """What could make micro-batch 1 fit, read from the planned config: only what it does not already do."""
    ways = [f"shorten the rows (--max-length, {setup['max_length']} tokens now)"]
    if not setup.get("checkpointing"):
        ways.append("recompute activations (training.activation_checkpointing=true)")
    if setup.get("lora") and not setup.get("quantized"):
        ways.append("quantize the frozen base (QLoRA: a quantization section, as recipes/configs/llama3_8b_qlora.yaml)")
    if not setup.get("lora"):
        ways.append("train LoRA adapters instead of every weight (a lora section)")
    return "; ".join(ways[:-1]) + ("; or " if len(ways) > 1 else "") + ways[-1]


def _recipe_argv(args: argparse.Namespace) -> list[str]:
    """The recipe's ``--config``/overrides argv, ``--model`` as ``model.name_or_path``."""
    argv = (["--config", args.config] if args.config else []) + list(args.overrides or [])
    if args.model:
        argv.append(f"model.name_or_path={args.model}")
    return argv


_OUT_OF_MEMORY = ("OutOfMemory", "out of memory", "MemoryError", "can't allocate memory", "Cannot allocate memory")


class ProbeWatch:
    """Runs the planner's children one at a time; with a ``budget`` (CPU), stops a child before this process and
    it together cross ``_SAFETY`` x budget. ``peak``: the largest sum of both resident sizes seen."""

    def __init__(self, budget: int | None, announce: Callable[[str], None] = print) -> None:
        self.budget = budget
        self.peak = 0
        self.announce = announce
        self.measured: dict[int, str] = {}
        """Micro-batch -> what its probe measured, in words naming the measure."""

    def measures(self, budget: int) -> list[str]:
        """Each probe's measure and the planner's own peak, one named measure a line (printed when nothing fits)."""
        lines = [f"micro-batch {m}: {what}" for m, what in sorted(self.measured.items())]
        return [*lines, f"planner peak: {format_bytes(self.peak)} (this process and its probe together, at most)",
                f"budget: {format_bytes(budget)} per process"]

    def resolve(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The planner's inputs from the config (a ``ValueError`` with the child's one line for bad input)."""
        returncode, out, err, reached = self._run({"resolve": spec})
        if reached is not None or (returncode != 0 and self._out_of_memory(err)):
            raise MemoryBudgetError(f"no micro-batch fits the budget of {format_bytes(self.budget or 0)}: it does not "
                                    f"even hold the planner reading the config (stopped at "
                                    f"{format_bytes(reached or self.peak)}); no probe was run")
        answer = self._answer(returncode, out, err, "reading the config")
        if "error" in answer:
            raise ValueError(answer["error"])
        return answer

    def measure(self, spec: dict[str, Any]) -> int:
        """Peak bytes of one probe at ``spec['micro_batch']``; an :class:`OverBudget` lower bound when stopped."""
        if self.budget is not None:
            spec = dict(spec, rss_headroom=self._child_allowance())
        returncode, out, err, reached = self._run({"probe": spec})
        micro_batch = spec["micro_batch"]
        if reached is not None:
            self.announce(f"probe at micro-batch {micro_batch} stopped at {format_bytes(reached)} (this process + "
                          f"probe), over {_SAFETY:.0%} of the budget: counted as not fitting")
            self.measured[micro_batch] = (f"needs more than {format_bytes(int(reached))} (this process and the probe "
                                          "when it was stopped)")
            return OverBudget(reached)
        if returncode != 0 and self._out_of_memory(err):
            # An allocation refused (the memory cap, or a device out of memory) before it could report.
            self.announce(f"probe at micro-batch {micro_batch} ran out of the memory the budget leaves it: counted "
                          "as not fitting")
            allowance = self._child_allowance()
            self.measured[micro_batch] = (f"needs more than {format_bytes(allowance)} (the probe's own memory cap, "
                                          "which it ran out of)")
            return OverBudget(allowance)
        result = self._answer(returncode, out, err, f"probe at micro-batch {micro_batch}")
        rss = result["rss_peak"] if spec["device"] == "cpu" else 0
        peak = max(int(result["tensor_peak"]), int(rss))
        self.measured[micro_batch] = f"measured peak {format_bytes(peak)} (the probe's training step)"
        return peak

    def _out_of_memory(self, err: str) -> bool:
        # Stopped by the data limit before it could say anything (empty stderr), or an out-of-memory message.
        return any(sign in err for sign in _OUT_OF_MEMORY) or (self.budget is not None and not err.strip())

    @staticmethod
    def _answer(returncode: int, out: str, err: str, what: str) -> dict[str, Any]:
        if returncode != 0:
            last = (err.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"plan --auto: {what} failed: {last}")
        answer: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return answer

    def _child_allowance(self) -> int:
        """Resident bytes a child may reach: the safe part of the budget less this process."""
        assert self.budget is not None
        return max(int(_SAFETY * self.budget) - psutil.Process().memory_info().rss, 1)

    def _run(self, spec: dict[str, Any]) -> tuple[int, str, str, int | None]:
        """Run one child to its end, or stop it over the budget: (returncode, stdout, stderr, the tree's resident
        bytes when it was stopped, else None)."""
        me = psutil.Process()
        limit = self._child_allowance() if self.budget is not None else None
        child = subprocess.Popen([sys.executable, "-m", "hf_accum.recipe.plan_probe", json.dumps(spec)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=None if limit is None else _data_limit(limit))
        watched = psutil.Process(child.pid)
        reached = None
        while child.poll() is None:
            try:
                total = me.memory_info().rss + watched.memory_info().rss
            except psutil.NoSuchProcess:
                break
            self.peak = max(self.peak, total)
            if self.budget is not None and total > _SAFETY * self.budget:
                child.kill()
                reached = total
                break
            time.sleep(_POLL_SECONDS)
        out, err = child.communicate()
        return child.returncode, out, err, reached


def _data_limit(limit: int) -> Callable[[], None]:
    """A hard backstop for when the watcher is not scheduled in time to stop the child (a loaded machine): the
    child's private writable memory (RLIMIT_DATA, what tensors and the Python heap use) is capped at what the
    budget leaves after the watcher; an allocation beyond it fails and the size counts as over."""

    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    return apply
