"""Run orchestration for the fine-tuning recipe: both engines, the metric, and the outputs.

``recipes/finetune_llama.py`` reads top to bottom by calling these steps in order:

1. :func:`prepare_config` -- YAML + overrides, typed and validated, output dir checked
   (every check that needs no model; nothing is written);
2. :func:`load_tokenizer_and_data` -- chat template, prompt masking, truncation counts;
3. :func:`build_model` -- skeleton first (LoRA targets checked), then weights, LoRA/QLoRA,
   gradient checkpointing;
4. :func:`evaluate` before and after :func:`train_loop` or :func:`train_trainer`;
5. :func:`summarize_run` and :func:`save_outputs` -- adapter (or model), tokenizer, resolved
   config, metrics JSON, plot.

The output directory is created only in step 5 (or by Trainer once training starts), so a
run that fails validation leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from hf_accum import config as C
from hf_accum import data as D
from hf_accum import modeling as M

METRICS_NAME = "metrics.json"
PLOT_NAME = "training_curves.png"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def say(*parts: Any) -> None:
    """Print on the main process only (every rank runs the same script)."""
    if is_main_process():
        print(*parts, flush=True)


# ----------------------------------------------------------------------------------------------
# 1. Config
# ----------------------------------------------------------------------------------------------


def prepare_config(argv: Sequence[str]) -> C.RecipeConfig:
    """Typed, resolved and validated config; raises ConfigError before anything is loaded."""
    path, overrides = C.parse_overrides(argv)
    config = C.load_config(path, overrides)
    name = os.path.splitext(os.path.basename(path))[0] if path else "cpu_default"
    config = C.resolve(config, default_output_dir=os.path.join("outputs", name))
    C.check_output_dir(config)
    return config


# ----------------------------------------------------------------------------------------------
# 2. Data
# ----------------------------------------------------------------------------------------------


@dataclass
class RecipeData:
    train: D.EncodedSplit
    eval_rows: list[dict[str, Any]]
    columns: D.Columns


def load_tokenizer_and_data(config: C.RecipeConfig):
    m, d = config.model, config.data
    tokenizer = M.load_tokenizer(m.name_or_path, m.chat_template, m.trust_remote_code)
    columns = D.Columns(d.prompt_column, d.answer_column, d.messages_column, d.system_prompt)
    if d.dataset == D.EMBEDDED_DATASET:
        splits = D.synthetic_splits(d.num_train_examples, d.num_eval_examples, d.seed)
        train_rows, eval_rows = splits["train"], splits.get(d.eval_split or "", [])
    else:
        train_rows = D.load_split(d.dataset, d.train_split)
        eval_rows = D.load_split(d.dataset, d.eval_split) if d.eval_split else []
    train = D.encode_rows(tokenizer, train_rows, columns, d.max_length)
    say(f"data: {d.dataset} train {train.summary()}; held-out {len(eval_rows[: d.max_eval_examples])} examples")
    return tokenizer, RecipeData(train, eval_rows[: d.max_eval_examples], columns)


# ----------------------------------------------------------------------------------------------
# 3. Model
# ----------------------------------------------------------------------------------------------


def check_model_fits_config(config: C.RecipeConfig, tokenizer) -> None:
    """LoRA targets must exist: checked on a weightless skeleton, before loading or writing."""
    if config.lora is None:
        return
    m = config.model
    skeleton = M.model_skeleton(m.name_or_path, tokenizer, m.config_overrides, m.trust_remote_code)
    M.check_lora_targets(skeleton, config.lora_config())


def checkpointing_requested(config: C.RecipeConfig) -> bool:
    """``training.activation_checkpointing`` (or its deprecated alias ``gradient_checkpointing``)."""
    t = config.training
    value = t.get("activation_checkpointing")
    return bool(t.get("gradient_checkpointing") if value is None else value)


def build_model(config: C.RecipeConfig, tokenizer):
    m, t = config.model, config.training
    quantization = config.bnb_config()
    model = M.load_model(
        m.name_or_path, tokenizer, m.dtype, quantization, seed=t.get("seed", 42),
        config_overrides=m.config_overrides, attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
    )
    checkpointing = checkpointing_requested(config)
    if config.lora is not None:
        model = M.apply_lora(model, config.lora_config(), quantization is not None, checkpointing)
    elif checkpointing:
        M.enable_gradient_checkpointing(model)
    return model


# ----------------------------------------------------------------------------------------------
# 4. Metric and engines
# ----------------------------------------------------------------------------------------------


def evaluate(model, tokenizer, data: RecipeData, config: C.RecipeConfig) -> dict[str, Any] | None:
    """Held-out exact match (main process only; the other ranks wait at the next barrier)."""
    if not data.eval_rows or not is_main_process():
        return None
    return D.exact_match(
        model, tokenizer, data.eval_rows, data.columns, config.data.eval_max_new_tokens,
        batch_size=config.training.get("per_device_eval_batch_size", 32),
    )


@dataclass
class EngineResult:
    updates: list[dict[str, Any]] = field(default_factory=list)
    world_size: int = 1
    batch_plan: str = ""
    accumulation_steps: int = 1
    micro_batch_size: int = 1
    model: Any = None


def _log_line(record: dict[str, Any]) -> str:
    parts = [f"update {record.get('step')}"]
    for key in ("loss", "learning_rate", "grad_norm", "targets", "sequences"):
        if record.get(key) is not None:
            value = record[key]
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def make_collator(config: C.RecipeConfig, tokenizer):
    """``data.packing``: padding-free packing (one row per micro-batch, ``position_ids`` restarting
    per sequence) or right padding; both mask the prompt (loss on answers only). Both engines train
    with ``use_cache=False``, which packed rows need."""
    from hf_accum.batching import PackingCollator, PaddingCollator

    return PackingCollator() if config.data.packing else PaddingCollator(tokenizer.pad_token_id)


def train_loop(model, tokenizer, data: RecipeData, config: C.RecipeConfig, args) -> EngineResult:
    """The Accelerate engine: ``hf_accum.loop.train`` with the exact normalization."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from hf_accum.loop import LoopConfig, train

    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=precision, cpu=args.use_cpu
    )
    generator = torch.Generator().manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(
        data.train.examples, batch_size=args.per_device_train_batch_size, shuffle=True, generator=generator,
        collate_fn=make_collator(config, tokenizer), num_workers=args.dataloader_num_workers,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )
    # The scheduler is *not* prepared: the loop builds it over the planned number of updates.
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    warmup = args.warmup_steps
    loop_config = LoopConfig(
        num_train_epochs=args.num_train_epochs, max_steps=args.max_steps, lr_scheduler_type=args.lr_scheduler_type,
        warmup_steps=int(warmup) if warmup >= 1 else 0, warmup_ratio=warmup if warmup < 1 else 0.0,
        max_grad_norm=args.max_grad_norm, label_smoothing=args.label_smoothing_factor, disable_tqdm=args.disable_tqdm,
    )
    records: list[dict[str, Any]] = []

    def on_update(update):
        records.append(asdict(update))
        if accelerator.is_main_process and (update.step == 1 or update.step % max(1, int(args.logging_steps)) == 0):
            tqdm.write(update.line())

    result = train(model, optimizer, loader, accelerator, loop_config, on_update=on_update)
    plan = result.batch_plan
    accelerator.wait_for_everyone()
    return EngineResult(
        records, accelerator.num_processes, plan.describe(), plan.accumulation_steps, plan.micro_batch_size,
        accelerator.unwrap_model(model),
    )


def train_trainer(model, tokenizer, data: RecipeData, config: C.RecipeConfig, args) -> EngineResult:
    """The Trainer engine: ``hf_accum.AccumTrainer`` with the standard Trainer API."""
    from transformers import TrainerCallback

    from hf_accum import AccumTrainer

    records: list[dict[str, Any]] = []

    class Collect(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                records.append({"step": state.global_step, "epoch": state.epoch, **logs})

    trainer = AccumTrainer(
        model=model, args=args, train_dataset=data.train.examples,
        data_collator=make_collator(config, tokenizer), processing_class=tokenizer, callbacks=[Collect()],
    )
    plan = batch_plan(args)
    trainer.train()
    barrier()
    return EngineResult(records, args.world_size, plan.describe(), plan.accumulation_steps, plan.micro_batch_size, trainer.model)


def set_seed(seed: int) -> None:
    from transformers import set_seed as hf_set_seed

    hf_set_seed(seed)


def batch_plan(args):
    """``global = micro x accumulation x processes`` from the resolved TrainingArguments."""
    from hf_accum.schedule import BatchPlan

    return BatchPlan(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size)


def training_arguments(config: C.RecipeConfig):
    """TrainingArguments for both engines. Checkpointing was already enabled on the model (before
    PEFT wrapping), so Trainer must not wrap it again; nor must it drop ``prompt_length``."""
    changes = {"activation_checkpointing": False, "gradient_checkpointing": None}
    if config.engine == "trainer" and config.training.get("save_strategy", "no") == "no":
        # Trainer creates its output_dir on init; keep the real one untouched until save_outputs.
        import tempfile

        changes["output_dir"] = tempfile.mkdtemp(prefix="hf_accum_trainer_")
    return config.training_arguments(**changes)


def warn_unused_training_keys(config: C.RecipeConfig) -> None:
    if config.engine != "loop":
        return
    ignored = sorted(set(config.training) - C.LOOP_TRAINING_FIELDS)
    if ignored:
        say(f"note: engine 'loop' ignores training.{', training.'.join(ignored)} (only engine 'trainer' uses them)")


# ----------------------------------------------------------------------------------------------
# 5. Outputs
# ----------------------------------------------------------------------------------------------


def plot_curves(updates: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [u["step"] for u in updates]
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax_loss.plot(steps, [u.get("loss", math.nan) for u in updates], lw=1)
    ax_loss.set_ylabel("loss (per-token mean)")
    ax_lr.plot(steps, [u.get("learning_rate", math.nan) for u in updates], lw=1, color="tab:orange")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer update")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_outputs(config: C.RecipeConfig, model, tokenizer, metrics: dict[str, Any]) -> str:
    out = config.training["output_dir"]
    if not is_main_process():
        return out
    os.makedirs(out, exist_ok=True)
    target = os.path.join(out, ADAPTER_DIR if config.lora is not None else MODEL_DIR)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    C.save_config(config, out)
    with open(os.path.join(out, METRICS_NAME), "w") as fh:
        json.dump(metrics, fh, indent=2, default=str)
    if metrics["updates"]:
        plot_curves(metrics["updates"], os.path.join(out, PLOT_NAME))
    return out


def percent(result: dict[str, Any] | None) -> str:
    return "n/a" if result is None else f"{100 * result['exact_match']:.1f}%"


# ----------------------------------------------------------------------------------------------
# Entry point helpers
# ----------------------------------------------------------------------------------------------


def run_cli(run: Callable[[Sequence[str]], Any], argv: Sequence[str] | None = None) -> int:
    """Run ``run(argv)``; configuration/data/model errors print one clear line and exit 2."""
    try:
        run(sys.argv[1:] if argv is None else argv)
    except (C.ConfigError, D.DataError, M.ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def summarize_run(config, result: EngineResult, data: RecipeData, before, after, trainable, times) -> dict[str, Any]:
    """The metrics JSON: batch arithmetic, world size, metric before/after, per-update logs."""
    return {
        "engine": config.engine, "world_size": result.world_size, "batch_plan": result.batch_plan,
        "accumulation_steps": result.accumulation_steps, "micro_batch_size": result.micro_batch_size,
        "global_batch_size": result.micro_batch_size * result.accumulation_steps * result.world_size,
        "eval_before": before, "eval_after": after,
        "train_seconds": times["train"], "wall_seconds": time.time() - times["start"], "trainable": trainable,
        "data": {"train_examples": len(data.train.examples), "truncated": data.train.truncated,
                 "dropped": data.train.dropped, "eval_examples": len(data.eval_rows)},
        "updates": result.updates,
    }


def describe_trainable(model) -> dict[str, Any]:
    trainable = M.trainable_summary(model)
    say(f"trained: {trainable['trainable_parameters']:,} of {trainable['total_parameters']:,} parameters "
        f"({trainable['trainable_fraction']:.1%}): {', '.join(trainable['trainable_modules'])}")
    return trainable
