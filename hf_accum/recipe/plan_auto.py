"""``hf-accum plan --auto``: the micro-batch a memory budget allows, measured on this device.

Builds the model a recipe config describes (model, LoRA/QLoRA, dtype, activation checkpointing: the
same builder the recipe uses; with no ``--config``, the embedded CPU default), measures the peak memory
of a training step at a few micro-batch sizes of ``--max-length``-token rows, and prints the largest
micro-batch that divides the per-process batch and fits the budget, with its accumulation steps, as a
table (:func:`hf_accum.memory.plan_micro_batch` holds the method).
"""

from __future__ import annotations

import argparse

import torch

from hf_accum.memory import default_budget, format_bytes, parse_bytes, plan_micro_batch, training_step_peak
from hf_accum.schedule import BatchPlan


def run_auto_plan(args: argparse.Namespace, processes: int) -> int:
    # The CLI is a front door to the recipe kit: the model is built as the recipe builds it.
    from hf_accum.recipe import config as recipe_config
    from hf_accum.recipe import modeling

    config = _config(args, recipe_config)
    max_length = args.max_length or config.data.max_length
    if max_length < 2:
        raise ValueError(f"--max-length {max_length}: needs at least 2 tokens (one prediction target)")
    per_process = _per_process_batch(args, config, processes)
    device = torch.device("cuda" if torch.cuda.is_available() and not config.training.get("use_cpu") else "cpu")
    budget = parse_bytes(args.memory_budget) if args.memory_budget else default_budget(device)
    tokenizer = modeling.load_tokenizer(config.model.name_or_path, config.model.chat_template,
                                        config.model.trust_remote_code)
    model = modeling.build_model(config, tokenizer, seed=0).to(device)
    precision = "bf16" if config.training.get("bf16") else "fp16" if config.training.get("fp16") else "no"
    print(f"measuring {config.model.name_or_path} on {device} ({max_length}-token rows, {precision} mixed "
          f"precision), budget {format_bytes(budget)} per process ...", flush=True)
    plan = plan_micro_batch(lambda m: training_step_peak(model, device, m, max_length, precision), per_process, budget)
    print(plan.table())
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
    return recipe_config.load_config(path, overrides)


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
