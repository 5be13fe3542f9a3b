"""Preflight: build what the run will build, on toy inputs, before any model loads -- so that every value PEFT,
torch or transformers would refuse later (or accept and then train wrongly) is one line naming its key now.

:func:`build_run_objects` (called by :func:`hf_accum.recipe.checks.resolve`, once) builds, from the config:
``TrainingArguments`` (FSDP asked in its non-deprecated form), the loop engine's
:class:`~hf_accum.loop.LoopConfig` (with the ``accumulation`` section), the engine's optimizer on a one-element
parameter (stepped with a zero and a unit gradient: it must stay finite), the LR scheduler (stepped over a short
horizon: finite, non-negative), the data loaders' and seeds' arguments, the report_to integrations, and a
one-layer LoRA on a tiny ``nn.Linear`` through PEFT (``LoraConfig`` itself accepts ``r=0`` or a dropout of 1.5:
PEFT and torch refuse them only when the layer is built). Before and after, the values every object accepts but
that train wrongly without a word: a run without a length, a zero step interval, a negative clipping norm (it flips
the gradient), ``lora_alpha=0`` (it zeroes the adapter).

A refusal names the keys the message mentions, else the keys whose removal makes the build pass.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import torch

from hf_accum.errors import InputError
from hf_accum.recipe.config import RecipeConfig
from hf_accum.recipe.launch import fsdp_request


class PreflightError(InputError):
    """A value a run object refuses (or accepts and would train wrongly with); resolve raises it as a ConfigError."""


# What the recipe changes when it builds TrainingArguments (see recipes/finetune_llama.py); DeepSpeed's config is
# checked by the launch policy, and building it here would switch ZeRO-3 on for this process.
TRAINING_ARGUMENT_CHANGES = {"activation_checkpointing": False, "gradient_checkpointing": None,
                             "resume_from_checkpoint": None, "deepspeed": None}

# Values the built objects accept but that train wrongly without a word: key -> (accepted, allowed).
QUIET_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "training.adam_epsilon": (lambda v: v > 0, "> 0 (0 divides a zero gradient by zero)"),
    "training.max_grad_norm": (lambda v: v is None or v >= 0, ">= 0 (0: no clipping; a negative norm flips the "
                                                                "gradient)"),
    "training.label_smoothing_factor": (lambda v: 0 <= v < 1, ">= 0 and < 1"),
    "training.weight_decay": (lambda v: v >= 0, ">= 0"),
    "lora.lora_alpha": (lambda v: v > 0, "> 0 (the adapter's output is scaled by lora_alpha / r)"),
    "lora.lora_dropout": (lambda v: 0 <= v < 1, ">= 0 and < 1 (1 drops the adapter's every input)"),
}
# How torch's optimizers name the training keys in their messages.
MESSAGE_NAMES = {"adam_beta1": "beta parameter at index 0", "adam_beta2": "beta parameter at index 1",
                 "adam_epsilon": "epsilon", "learning_rate": "learning rate"}


def build_run_objects(config: RecipeConfig) -> None:
    """Build the run's objects from ``config`` on toy inputs; PreflightError (one line, keys named) on a refusal."""
    def training(**changes: Any) -> Any:
        return config.training_arguments(**{**TRAINING_ARGUMENT_CHANGES, **fsdp_request(config.training), **changes})

    def run_schedule(args: Any) -> None:  # the optimizer and its scheduler over a short horizon
        optimizer = _optimizer(config.engine, args)
        return _step(optimizer, _scheduler(args, optimizer), config.engine)

    _check_duration(config)
    _check_step_intervals(config)
    _check_compile(config)
    args = _built(config, "TrainingArguments", training, "training")
    if config.engine == "loop":
        _built(config, "the loop's LoopConfig", lambda: _loop_config(config, args), "training")
    optimizer = _built(config, "the optimizer", lambda: _optimizer(config.engine, args), "training",
                       rebuild=lambda: _optimizer(config.engine, training()))
    scheduler_name = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    scheduler = _built(config, f"the {scheduler_name} scheduler", lambda: _scheduler(args, optimizer), "training",
                       rebuild=lambda: (lambda a: _scheduler(a, _optimizer(config.engine, a)))(training()))
    _built(config, "the data loader or seeds", lambda: _loaders_and_seeds(args), "training",
           rebuild=lambda: _loaders_and_seeds(training()))
    _built(config, "report_to", lambda: _integrations(args), "training")
    lora = config.lora  # the section's dict itself (_blamed edits it in place)
    if lora is not None:
        config.lora_config()  # LoraConfig's own checks (e.g. bias, init options), "lora: <its message>"
        _built(config, "PEFT", lambda: _one_layer_lora(lora), "lora",
               rebuild=lambda: _one_layer_lora(lora))
    for dotted, (accepted, allowed) in QUIET_VALUES.items():
        section, _, key = dotted.partition(".")
        values = getattr(config, section)
        if values is not None and key in values and not accepted(values[key]):
            raise PreflightError(f"{dotted}={values[key]!r} ({config.source(dotted)}): allowed: {allowed}")
    # Last, what no rule above names: the optimizer's steps must stay finite, the learning rates finite and >= 0.
    _built(config, f"the optimizer with the {scheduler_name} scheduler",
           lambda: _step(optimizer, scheduler, config.engine), "training", rebuild=lambda: run_schedule(training()))


def _check_duration(config: RecipeConfig) -> None:
    """A run must have a length: max_steps >= 1, or num_train_epochs > 0; a negative epoch count means nothing
    even where max_steps sets the length (an untrained model saved as a finished run is worse than an error)."""
    t = config.training
    if t.max_steps == 0 or t.max_steps < -1:
        raise PreflightError(f"training.max_steps={t.max_steps} ({config.source('training.max_steps')}): use a "
                             "number of updates >= 1, or -1 to train for training.num_train_epochs")
    if t.num_train_epochs < 0 or (t.max_steps == -1 and not t.num_train_epochs > 0):
        allowed = "> 0 (or set training.max_steps >= 1)" if t.max_steps == -1 else \
            f">= 0 (training.max_steps={t.max_steps} sets the length)"
        raise PreflightError(f"training.num_train_epochs={float(t.num_train_epochs)} "
                             f"({config.source('training.num_train_epochs')}) must be {allowed}")


def _check_compile(config: RecipeConfig) -> None:
    """``training.torch_compile`` with DeepSpeed or FSDP: both front-ends refuse it once the model is built (no
    exactness test covers a compiled model under a sharding engine, hf_accum.compile); here it is refused first."""
    t = config.training
    engine = "training.deepspeed" if t.get("deepspeed") else "training.fsdp" if t.get("fsdp") else None
    if t.get("torch_compile") and engine is not None:
        raise PreflightError(
            f"training.torch_compile=true ({config.source('training.torch_compile')}) with {engine} "
            f"({config.source(engine)}): not verified exact under DeepSpeed or FSDP; use one of them, not both"
        )


def _check_step_intervals(config: RecipeConfig) -> None:
    """``save_steps`` / ``eval_steps`` / ``logging_steps`` must be a positive number of updates (or a fraction of
    them, below 1) where their strategy is ``steps``: 0 would divide by zero in the loop and be ignored silently by
    Trainer, in either engine."""
    for action in ("save", "eval", "logging"):
        strategy = str(getattr(config.training, f"{action}_strategy"))
        steps = getattr(config.training, f"{action}_steps")
        if strategy.rsplit(".", 1)[-1].lower() != "steps" or steps is None or steps > 0:
            continue
        raise PreflightError(
            f"training.{action}_steps={steps:g} ({config.source(f'training.{action}_steps')}) with training."
            f"{action}_strategy=steps: use a number of updates >= 1 (or a fraction of the planned updates, between 0 "
            f"and 1), or set training.{action}_strategy=no"
        )


def _loop_config(config: RecipeConfig, args: Any) -> Any:
    from hf_accum.loop import LoopConfig, LoopConfigError

    try:  # the loop holds the section itself (hf_accum.settings)
        return LoopConfig.from_training_arguments(args, accumulation=config.accumulation)
    except LoopConfigError as error:  # name the recipe's key: accumulation.* for the section's, else training.*
        message = str(error).replace("LoopConfig.label_smoothing", "training.label_smoothing_factor")
        for key in config.accumulation.names():
            message = message.replace(f"LoopConfig.{key}", f"accumulation.{key}")
        message = message.replace("LoopConfig.", "training.")
        found = re.search(r"(accumulation|training)\.\w+", message)
        raise PreflightError(f"{message} ({config.source(found.group(0))})" if found else message) from None


def _optimizer(engine: str, args: Any) -> torch.optim.Optimizer:
    """The engine's optimizer over one parameter: the loop's AdamW as the recipe builds it, or the one Trainer
    picks from ``training.optim``."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    if engine == "loop":
        return torch.optim.AdamW([parameter], lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                 eps=args.adam_epsilon, weight_decay=args.weight_decay)
    from transformers import Trainer

    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    return optimizer_class([parameter], **kwargs)


def _scheduler(args: Any, optimizer: torch.optim.Optimizer) -> Any:
    from transformers import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=1, num_training_steps=10,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs or None)


def _step(optimizer: torch.optim.Optimizer, scheduler: Any, engine: str) -> None:
    """Ten updates (the first with a zero gradient, as LoRA's A matrices get at step 1): parameter and rates finite.
    Only torch's own optimizers (others may need a device or a model); the scheduler stepped as the engine steps it
    (the loop: once per update, without a metric; Trainer steps a plateau scheduler on its evaluations)."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return
    parameter = optimizer.param_groups[0]["params"][0]
    for step in range(10):
        parameter.grad = torch.full_like(parameter, float(step > 0))
        optimizer.step()
        if not torch.isfinite(parameter).all():
            raise ValueError(f"update {step + 1} (gradient {float(step > 0)}) makes the parameter {parameter.item()}")
        if engine == "loop" or isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            scheduler.step()
            if not all(math.isfinite(rate) and rate >= 0 for rate in scheduler.get_last_lr()):
                raise ValueError(f"the learning rate after update {step + 1} is {scheduler.get_last_lr()}")


def _loaders_and_seeds(args: Any) -> None:
    import random

    import numpy

    for size in (args.per_device_train_batch_size, args.per_device_eval_batch_size):
        torch.utils.data.DataLoader(range(2), batch_size=size,  # type: ignore[arg-type]  # any sized sequence
                                    num_workers=args.dataloader_num_workers)
    for seed in {args.seed, args.data_seed} - {None}:
        random.Random(seed), numpy.random.RandomState(seed), torch.Generator().manual_seed(seed)


def _integrations(args: Any) -> None:
    from transformers.integrations import get_reporting_integration_callbacks

    get_reporting_integration_callbacks(args.report_to)


# LoraConfig keys that describe the model's structure (which modules, which layers, special initialisations that
# need data or quantized weights): the one-layer probe neutralises them; the model skeleton checks the names.
_STRUCTURE: dict[str, Any] = {
    "target_modules": ["proj"], "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
    "exclude_modules": None, "rank_pattern": {}, "alpha_pattern": {}, "target_parameters": None,
    "trainable_token_indices": None, "layer_replication": None, "megatron_config": None,
    "use_qalora": False, "loftq_config": {}, "eva_config": None, "corda_config": None, "task_type": None,
}


def _one_layer_lora(lora: dict[str, Any]) -> None:
    """A one-layer LoRA through PEFT on a tiny ``nn.Linear``, one forward and backward in training mode."""
    import peft

    fields = peft.LoraConfig.__dataclass_fields__
    values = {**lora, **{key: value for key, value in _STRUCTURE.items() if key in fields}}
    if values.get("init_lora_weights") not in (True, False, "gaussian", None):
        values["init_lora_weights"] = True  # pissa, olora, eva, loftq...: need real weights or data

    class OneLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    model = peft.get_peft_model(OneLayer(), peft.LoraConfig(**values))
    model.train()
    model(torch.ones(2, 4)).sum().backward()


def _built(config: RecipeConfig, what: str, build: Callable[[], Any], section: str,
           rebuild: Callable[[], Any] | None = None) -> Any:
    """``build()``; its refusal (TypeError/ValueError, a ConfigError of ``Section.build``) as one line naming the
    keys it concerns and their sources. ``rebuild`` (from the config, without one key) finds the keys otherwise."""
    try:
        return build()
    except (TypeError, ValueError, ImportError) as exc:
        if isinstance(exc, InputError) and not str(exc).startswith(f"{section}: "):
            raise  # ours, naming its key already (Section.build's "training: <HF message>" is not)
        detail = " ".join(str(exc).split())
        if detail.startswith(f"{section}: "):
            detail = detail[len(section) + 2:]
        named = _mentioned(config, section, detail) if section == "training" else []
        named = named or _blamed(config, section, rebuild)
        keys = "; ".join(f"{section}.{key}={getattr(config, section)[key]!r} ({config.source(f'{section}.{key}')})"
                         for key in named) or f"a value of the {section} section"
        raise PreflightError(f"{what} refuses the {section} section: {detail} [{keys}]") from exc


def _mentioned(config: RecipeConfig, section: str, detail: str) -> list[str]:
    """The keys of ``section`` an HF/torch message names (by key, by torch's wording, by a quoted value)."""
    def mentions(key: str, value: Any) -> bool:
        names = (key, MESSAGE_NAMES.get(key), *(value if isinstance(value, dict) else ()))
        quoted_value = isinstance(value, str) and len(value) > 2 and value in detail  # "adamw_nope is not a valid"
        return quoted_value or any(name and str(name) in detail for name in names)

    return [key for key, value in getattr(config, section).items() if mentions(key, value)]


def _blamed(config: RecipeConfig, section: str, rebuild: Callable[[], Any] | None) -> list[str]:
    """The keys whose removal (back to the class default) lets ``rebuild`` pass."""
    if rebuild is None:
        return []
    values = getattr(config, section)
    original, blamed = dict(values), []
    for key in original:
        del values[key]
        try:
            rebuild()
            blamed.append(key)
        except Exception:
            pass
        finally:
            values.clear()
            values.update(original)  # the same keys in the same order
    return blamed
