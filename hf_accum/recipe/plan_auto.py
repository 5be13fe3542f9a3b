"""``hf-accum plan --auto``: the micro-batch a memory budget allows, measured on this device.

Builds the model a recipe config describes (model, LoRA/QLoRA, dtype, activation checkpointing: the
same builder the recipe uses; with no ``--config``, the embedded CPU default), measures the peak memory
of a training step at a few micro-batch sizes of ``--max-length``-token rows, and prints the largest
micro-batch that divides the per-process batch and fits the budget, with its accumulation steps, as a
table (:func:`hf_accum.memory.plan_micro_batch` holds the method).

**The planner stays inside its own budget**: it never builds the model itself. Each probe runs in a child
process (:mod:`hf_accum.recipe.plan_probe`) that this process watches; on CPU, where the budget is this
machine's RAM, the child is stopped as soon as the two processes' resident memory together would cross the
budget, and that micro-batch counts as not fitting (its "measured" value is the memory it had reached). A
probe's measured peak is the larger of its tensor peak and (on CPU) its whole-process peak RSS: what a training
process at that micro-batch really needs. When even micro-batch 1 does not fit, the command says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil
import torch

from hf_accum.memory import MemoryBudgetError, default_budget, format_bytes, parse_bytes, plan_micro_batch
from hf_accum.schedule import BatchPlan

_POLL_SECONDS = 0.01
_SAFETY = 0.95
"""Stop a probe at 95% of the budget: memory can grow between two polls (10 ms)."""


def run_auto_plan(args: argparse.Namespace, processes: int) -> int:
    # The CLI is a front door to the recipe kit: the model is built as the recipe builds it.
    from hf_accum.recipe import config as recipe_config
    from hf_accum.recipe import modeling

    config, argv = _config(args, recipe_config)
    max_length = args.max_length or config.data.max_length
    if max_length < 2:
        raise ValueError(f"--max-length {max_length}: needs at least 2 tokens (one prediction target)")
    per_process = _per_process_batch(args, config, processes)
    device = torch.device("cuda" if torch.cuda.is_available() and not config.training.get("use_cpu") else "cpu")
    budget = parse_bytes(args.memory_budget) if args.memory_budget else default_budget(device)
    modeling.check_model_section(config.model)  # a missing model: one line, before any probe starts
    precision = "bf16" if config.training.get("bf16") else "fp16" if config.training.get("fp16") else "no"
    print(f"measuring {config.model.name_or_path} on {device} ({max_length}-token rows, {precision} mixed "
          f"precision), budget {format_bytes(budget)} per process ...", flush=True)
    watch = ProbeWatch(budget if device.type == "cpu" else None)
    spec = {"argv": argv, "max_length": max_length, "device": str(device), "precision": precision}
    try:
        plan = plan_micro_batch(lambda m: watch.measure(dict(spec, micro_batch=m)), per_process, budget)
    except MemoryBudgetError as error:
        raise MemoryBudgetError(f"{error}; planner peak {format_bytes(watch.peak)} (probe included)") from None
    print(plan.table())
    print(f"planner peak {format_bytes(watch.peak)} (this process + its probe), budget {format_bytes(budget)}")
    chosen = BatchPlan(plan.micro_batch, plan.accumulation_steps, processes, args.nodes)
    print(f"{chosen.describe()}: measured peak {format_bytes(plan.measured[plan.micro_batch])} <= "
          f"{format_bytes(budget)}")
    print(f"use: training.per_device_train_batch_size={plan.micro_batch} "
          f"global_batch_size={chosen.global_batch_size}")
    return 0


def _config(args: argparse.Namespace, recipe_config):
    overrides_argv = (["--config", args.config] if args.config else []) + list(args.overrides or [])
    path, overrides = recipe_config.parse_overrides(overrides_argv)
    if args.model:
        overrides["model.name_or_path"] = args.model
        overrides_argv.append(f"model.name_or_path={args.model}")
    return recipe_config.load_config(path, overrides), overrides_argv


def _per_process_batch(args: argparse.Namespace, config, processes: int) -> int:
    """Sequences per process per update: the target global batch over the processes (must divide)."""
    if args.global_batch_size is not None:
        global_batch = args.global_batch_size
    elif config.global_batch_size is not None:
        global_batch = config.global_batch_size
    else:
        t = config.training
        global_batch = t.get("per_device_train_batch_size", 8) * t.get("gradient_accumulation_steps", 1) * processes
    if global_batch < 1 or global_batch % processes:
        raise ValueError(f"global batch {global_batch} is not a positive multiple of {processes} processes")
    return global_batch // processes


_OUT_OF_MEMORY = ("OutOfMemory", "out of memory", "MemoryError", "can't allocate memory", "Cannot allocate memory")


class ProbeWatch:
    """Runs probes in child processes; with a ``budget`` (CPU), stops a child before this process and it together
    cross ``_SAFETY`` x budget. ``peak``: the largest sum of both resident sizes seen."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.peak = 0

    def measure(self, spec: dict) -> int:
        me = psutil.Process()
        child = subprocess.Popen([sys.executable, "-m", "hf_accum.recipe.plan_probe", json.dumps(spec)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=self._data_limit(me.memory_info().rss))
        watched = psutil.Process(child.pid)
        while child.poll() is None:
            try:
                total = me.memory_info().rss + watched.memory_info().rss
            except psutil.NoSuchProcess:
                break
            self.peak = max(self.peak, total)
            if self.budget is not None and total > _SAFETY * self.budget:
                child.kill()
                child.wait()
                return max(total, self.budget + 1)  # over: at least what it had reached
            time.sleep(_POLL_SECONDS)
        out, err = child.communicate()
        if child.returncode != 0:
            last = (err.strip().splitlines() or ["(no output)"])[-1]
            # Stopped by the data limit before it could report (empty stderr), or a device OOM: over budget.
            if any(sign in err for sign in _OUT_OF_MEMORY) or (self.budget is not None and not err.strip()):
                return 2**62
            raise RuntimeError(f"plan --auto probe at micro-batch {spec['micro_batch']} failed: {last}")
        result = json.loads(out.strip().splitlines()[-1])
        rss = result["rss_peak"] if spec["device"] == "cpu" else 0
        return max(result["tensor_peak"], rss)

    def _data_limit(self, parent_rss: int):
        """A hard backstop for when this process is not scheduled in time to stop the child (a loaded machine):
        the child's private writable memory (RLIMIT_DATA, what tensors and the Python heap use) is capped at
        what the budget leaves after this process; an allocation beyond it fails and the size counts as over."""
        if self.budget is None:
            return None
        limit = max(int(_SAFETY * self.budget) - parent_rss, 1)

        def apply() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

        return apply
