"""Validating a config before anything loads: derived values, cross-field rules, each section's own check.

:func:`resolve` fills what is derived (``training.gradient_accumulation_steps`` from
``global_batch_size``, ``output_dir``) and refuses, with one line naming the key and the layer
it came from, everything that can be known wrong without a model: the batch arithmetic, the run's
length, precision on this machine, QLoRA without LoRA; then each section's own check
(``Section.validator``: the data and model modules own theirs) and the HF objects built from
the config, whose own checks run here rather than after the model has loaded.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from hf_accum.errors import InputError
from hf_accum.recipe.config.layers import load_config, parse_overrides
from hf_accum.recipe.config.schema import BUILTIN, COMMAND_LINE, SECTIONS, ConfigError, RecipeConfig, unknown_key


def world_size_from_env() -> int:
    """Processes of this launch, as torchrun / accelerate launch announce them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve(
    config: RecipeConfig,
    engines: Sequence[str],
    world_size: int | None = None,
    default_output_dir: str = "outputs/run",
) -> RecipeConfig:
    """Fill derived values (accumulation steps from the global batch, output_dir) and validate
    everything that does not need the model. ``engines``: the names of the recipe's engine table.
    Returns a new config; raises ConfigError."""
    config = dataclasses.replace(config, training=dict(config.training), notes=list(config.notes))
    world_size = world_size or world_size_from_env()
    t = config.training
    t.setdefault("output_dir", default_output_dir)
    if config.engine not in engines:
        raise unknown_key("engine=", config.engine, list(engines), what="value")
    _resolve_batch(config, world_size)
    _check_duration(config)
    _check_precision(config)
    _check_quantization(config)
    _check_sections(config)
    if config.lora is not None:
        config.lora_config()  # peft's own checks (e.g. bias, init options)
    _check_step_intervals(config)
    _check_training_objects(config)
    return config


def _check_sections(config: RecipeConfig) -> None:
    """Each section's own check, by the module that owns its meaning (``Section.validator``); their
    bad-input errors come out as ConfigErrors (the one-line message unchanged)."""
    for name, section in SECTIONS.items():
        try:
            section.validate(getattr(config, name), config)
        except ConfigError:
            raise
        except InputError as exc:
            raise ConfigError(str(exc)) from exc


def _check_quantization(config: RecipeConfig) -> None:
    """QLoRA trains adapters over frozen 4-bit weights (bitsandbytes itself: the quantization section's check)."""
    if config.quantization is not None and config.lora is None:
        raise ConfigError("quantization needs lora (QLoRA): quantized base weights cannot be fine-tuned directly")





def _layer_rank(source: str) -> int:
    return {BUILTIN: 0, COMMAND_LINE: 2}.get(source, 1)


def _resolve_batch(config: RecipeConfig, world_size: int) -> None:
    """``training.gradient_accumulation_steps`` from ``global_batch_size`` (the higher layer wins when
    both are set; in one layer they must agree). Errors name the layer each value came from."""
    from hf_accum.schedule import plan_global_batch

    t = config.training
    micro = t.get("per_device_train_batch_size", 8)
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if key in t and t[key] < 1:
            raise ConfigError(f"training.{key}={t[key]} ({config.source('training.' + key)}) must be >= 1")
    if config.global_batch_size is None:
        return
    given = t.get("gradient_accumulation_steps")
    batch_source = config.source("global_batch_size")
    steps_source = config.source("training.gradient_accumulation_steps")
    if given is not None and _layer_rank(steps_source) > _layer_rank(batch_source):
        config.notes.append(
            f"training.gradient_accumulation_steps={given} ({steps_source}) replaces global_batch_size="
            f"{config.global_batch_size} ({batch_source}): effective batch {micro * given * world_size}"
        )
        config.global_batch_size = None
        return
    try:
        plan = plan_global_batch(config.global_batch_size, micro, world_size)
    except ValueError as exc:
        raise ConfigError(f"{exc} [global_batch_size from {batch_source}]") from exc
    same_layer = _layer_rank(steps_source) == _layer_rank(batch_source)
    if given is not None and given != plan.accumulation_steps and same_layer:
        raise ConfigError(
            f"global_batch_size={config.global_batch_size} with {micro} per device x {world_size} processes needs "
            f"gradient_accumulation_steps={plan.accumulation_steps}, but training.gradient_accumulation_steps={given}; "
            f"both set in {batch_source}: set only one of them"
        )
    if given is not None and given != plan.accumulation_steps:
        config.notes.append(
            f"global_batch_size={config.global_batch_size} ({batch_source}) replaces "
            f"training.gradient_accumulation_steps={given} ({steps_source}): "
            f"{plan.accumulation_steps} accumulation steps"
        )
    t["gradient_accumulation_steps"] = plan.accumulation_steps


def _check_duration(config: RecipeConfig) -> None:
    """A run must have a length: max_steps > 0, or num_train_epochs > 0 (an untrained model saved
    as a finished run is worse than an error)."""
    t = config.training
    max_steps, epochs = t.get("max_steps", -1), t.get("num_train_epochs", 3.0)
    if max_steps == 0 or max_steps < -1:
        raise ConfigError(f"training.max_steps={max_steps} ({config.source('training.max_steps')}): use a number of "
                          "updates >= 1, or -1 to train for training.num_train_epochs")
    if max_steps == -1 and not epochs > 0:
        raise ConfigError(f"training.num_train_epochs={epochs} ({config.source('training.num_train_epochs')}) must "
                          "be > 0 (or set training.max_steps >= 1)")


def bf16_supported(use_cpu: bool) -> bool:
    import torch

    if use_cpu or not torch.cuda.is_available():
        # CPU autocast runs bf16, but TrainingArguments only allows it when use_cpu is explicit.
        return use_cpu
    return torch.cuda.is_bf16_supported()


def _check_precision(config: RecipeConfig) -> None:
    t = config.training
    wants_bf16 = t.get("bf16") or config.model.dtype == "bfloat16"
    if wants_bf16 and not bf16_supported(bool(t.get("use_cpu"))):
        raise ConfigError(
            "bf16 requested (training.bf16 / model.dtype: bfloat16) but this machine has no bf16-capable GPU. "
            "Set training.bf16: false and model.dtype: float32, or training.use_cpu: true for CPU bf16 autocast."
        )
    if t.get("bf16") and t.get("fp16"):
        raise ConfigError("training.bf16 and training.fp16 are both true; pick one")
    if config.model.dtype not in ("float32", "bfloat16", "float16", "auto"):
        raise ConfigError(f"model.dtype={config.model.dtype!r}; allowed: float32, bfloat16, float16, auto")


def load_recipe_config(argv: Sequence[str], engines: Sequence[str]) -> RecipeConfig:
    """The recipe's config from its command line: layers merged, typed and validated (nothing loaded,
    nothing written). The default output dir is ``outputs/<config file name>``."""
    path, overrides = parse_overrides(argv)
    name = os.path.splitext(os.path.basename(path))[0] if path else "cpu_default"
    return resolve(load_config(path, overrides), engines, default_output_dir=os.path.join("outputs", name))



# How often each periodic action runs: (strategy key, interval key).
STEP_INTERVALS = (
    ("save_strategy", "save_steps"), ("eval_strategy", "eval_steps"), ("logging_strategy", "logging_steps"),
)


def _check_step_intervals(config: RecipeConfig) -> None:
    """``save_steps`` / ``eval_steps`` / ``logging_steps`` must be a positive number of updates (or a
    fraction of them, below 1) where their strategy is ``steps``: 0 would divide by zero in the loop and
    be ignored silently by Trainer, in either engine."""
    t = config.training
    for strategy_key, steps_key in STEP_INTERVALS:
        strategy = str(t.get(strategy_key, "no" if strategy_key == "eval_strategy" else "steps"))
        steps = t.get(steps_key)
        if strategy.rsplit(".", 1)[-1].lower() != "steps" or steps is None or steps > 0:
            continue
        raise ConfigError(
            f"training.{steps_key}={steps:g} ({config.source('training.' + steps_key)}) with training.{strategy_key}="
            f"steps: use a number of updates >= 1 (or a fraction of the planned updates, between 0 and 1), or set "
            f"training.{strategy_key}=no"
        )


# What the recipe changes when it builds TrainingArguments (see recipes/finetune_llama.py); DeepSpeed's
# config is checked by the launch policy, and building it here would switch ZeRO-3 on for this process.
TRAINING_ARGUMENT_CHANGES = {"activation_checkpointing": False, "gradient_checkpointing": None,
                             "resume_from_checkpoint": None, "deepspeed": None}


def _check_training_objects(config: RecipeConfig) -> None:
    """Build ``TrainingArguments``, the engine's optimizer (on an empty parameter) and its scheduler from
    the config now, so that their own checks run before any model loads, as one-line errors naming the
    keys they concern and where those were set."""
    args = _built(config, "TrainingArguments", lambda: config.training_arguments(**TRAINING_ARGUMENT_CHANGES))
    if config.engine == "loop":
        from hf_accum.loop import LoopConfig

        _built(config, "the loop's LoopConfig", lambda: LoopConfig.from_training_arguments(args))
    optimizer = _built(config, "the optimizer", lambda: _empty_optimizer(config.engine, args))
    scheduler = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    _built(config, f"the {scheduler} scheduler", lambda: _scheduler(args, optimizer))


def _empty_optimizer(engine: str, args):
    """The optimizer the engine will build, over one empty parameter: the loop's AdamW (as the recipe
    builds it), or the one Trainer picks from ``training.optim``."""
    import torch

    parameter = [torch.nn.Parameter(torch.zeros(0))]
    if engine == "loop":
        return torch.optim.AdamW(parameter, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                 eps=args.adam_epsilon, weight_decay=args.weight_decay)
    from transformers import Trainer

    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    return optimizer_class(parameter, **kwargs)


def _scheduler(args, optimizer):
    from transformers import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=1, num_training_steps=10,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs or None)


def _built(config: RecipeConfig, what: str, build):
    """``build()``, its own refusal (TypeError/ValueError) as a one-line ConfigError naming the keys it
    mentions and their sources."""
    try:
        return build()
    except (TypeError, ValueError) as exc:  # a ConfigError from Section.build too: "training: <its message>"
        detail = " ".join(str(exc).split())
        if detail.startswith("training: "):
            detail = detail[len("training: "):]
        raise ConfigError(f"{what} refuses the training section: {detail}{_named_keys(config, detail)}") from exc


# How torch's optimizers name the training keys in their messages.
MESSAGE_NAMES = {"adam_beta1": "beta parameter at index 0", "adam_beta2": "beta parameter at index 1",
                 "adam_epsilon": "epsilon", "learning_rate": "learning rate"}


def _named_keys(config: RecipeConfig, detail: str) -> str:
    """`` [training.adam_beta1=1.5 (command line)]`` for the training keys an HF/torch message concerns."""
    named = [f"training.{key}={value!r} ({config.source('training.' + key)})"
             for key, value in config.training.items() if _mentions(detail, key, value)]
    return f" [{'; '.join(named)}]" if named else " [a value of the training section]"


def _mentions(detail: str, key: str, value) -> bool:
    names = (key, MESSAGE_NAMES.get(key), *(value if isinstance(value, dict) else ()))
    quoted_value = isinstance(value, str) and len(value) > 2 and value in detail  # e.g. "adamw_nope is not a valid"
    return quoted_value or any(name and str(name) in detail for name in names)
