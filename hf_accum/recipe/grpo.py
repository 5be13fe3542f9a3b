"""``objective: grpo`` in the recipe: the objective table entry and GRPO training in the trainer engine.

The recipe (``recipes/finetune_llama.py``) reads what differs between objectives from one
:class:`~hf_accum.recipe.preference.Objective`. For GRPO:

* **data**: the formats SFT detects (chat, prompt_completion, alpaca: a prompt and its reference answer), read by
  :func:`hf_accum.recipe.data.load_tokenizer_and_data`; each training example becomes a TRL prompt row
  ``{"prompt": [messages], "answer": <reference>, "task": ...}`` (:func:`prompt_rows`), the reference as the tokenizer
  gives it back, so that a reward compares like with like;
* **rewards**: ``grpo.reward_funcs`` (:mod:`hf_accum.recipe.rewards`), resolved before any model loads;
* **engine** ``trainer``: :class:`hf_accum.AccumGRPOTrainer` with TRL's own generation and ``GRPOConfig`` built from
  the training section and the ``grpo`` section (TRL's names); ``engine: loop`` is refused before loading
  (:mod:`hf_accum.recipe.grpo_section`);
* **warm start** (``grpo.warm_start_steps``): SFT updates (:class:`hf_accum.AccumTrainer`) on the reference answers
  first, so that a model that never answers right gets rewards to learn from; the held-out exact match is scored
  after them, and the GRPO stage's ``before X% -> after Y%`` printed;
* **progress**: a line every ``logging_steps`` updates with the loss, the reward mean (and each reward's), the mean
  completion length, and the generation vs training seconds per update (:class:`GRPOProgress`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from hf_accum.recipe.config.schema import RecipeConfig
from hf_accum.recipe.data import RecipeData, load_tokenizer_and_data
from hf_accum.recipe.data.formats import Example
from hf_accum.recipe.data.metric import as_decoded
from hf_accum.recipe.data.splits import load_splits
from hf_accum.recipe.preference import Objective, drop_reference_adapter, training_values
from hf_accum.recipe.rewards import resolve_rewards, reward_name

METRIC = "exact match"


@dataclass
class GRPOData(RecipeData):
    """The SFT data of the run (the warm start trains on it, the held-out rows score the exact match) and the
    training prompts with their reference answers."""

    prompts: list[dict[str, Any]] = field(default_factory=list)
    """TRL's conversational prompt rows (:func:`prompt_rows`)."""
    scored: dict[str, Any] = field(default_factory=dict)
    """Held-out results already scored by the GRPO engine (``"after training"``), not scored twice."""


def prompt_rows(tokenizer: Any, examples: list[Example]) -> list[dict[str, Any]]:
    """TRL's conversational prompt rows: the conversation up to its last answer, that answer as the reference."""
    rows = []
    for example in examples:
        conversation = example.conversation()
        rows.append({"prompt": conversation[:-1], "answer": as_decoded(tokenizer, conversation[-1]["content"]),
                     "task": example.task})
    return rows


def load_grpo_data(model: Any, data: Any) -> tuple[Any, GRPOData]:
    """The tokenizer, the SFT-encoded data and the prompt rows of a GRPO run, before any model loads."""
    tokenizer, sft = load_tokenizer_and_data(model, data)
    examples = [example for example in load_splits(data).train if example.messages is not None]
    prompts = prompt_rows(tokenizer, examples)
    report = [*sft.report, f"grpo: {len(prompts)} training prompts with reference answers"]
    fields = {f.name: getattr(sft, f.name) for f in dataclasses.fields(sft)}
    return tokenizer, GRPOData(**{**fields, "report": report}, prompts=prompts)


# ----------------------------------------------------------------------------------------------
# TRL's config
# ----------------------------------------------------------------------------------------------


def trl_settings(config: RecipeConfig) -> dict[str, Any]:
    """The ``grpo`` section's TRL-named keys (every one but the recipe's own)."""
    grpo = config.grpo
    return {f.name: getattr(grpo, f.name) for f in dataclasses.fields(grpo) if f.name not in grpo.RECIPE_KEYS}


def grpo_config(config: RecipeConfig, args: Any) -> Any:
    """TRL's ``GRPOConfig``: every ``TrainingArguments`` value the recipe resolved (GRPOConfig's own defaults, e.g.
    learning_rate 1e-6, never apply), the ``grpo`` section, and the dataset's extra columns kept (the rewards read
    ``answer``)."""
    from trl import GRPOConfig

    values = training_values(args)
    values["remove_unused_columns"] = False  # "answer" and "task" reach the reward functions
    return GRPOConfig(**values, **trl_settings(config))


# ----------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------


class GenerationTimer:
    """Wraps the trainer's ``_generate_and_score_completions`` (TRL's generation, called unchanged): the seconds
    it took and the completion tokens it made since the last :meth:`take`."""

    def __init__(self, generate: Callable[..., Any] | None = None) -> None:
        self.generate = generate
        self.seconds = 0.0
        self.tokens = 0
        self.measured = generate is not None
        """False where this TRL's generation could not be wrapped: the progress line shows no split."""

    def wrapping(self, generate: Callable[..., Any]) -> GenerationTimer:
        self.generate, self.measured = generate, True
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        assert self.generate is not None  # called only once wrapping
        start = time.perf_counter()
        output = self.generate(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        mask = output.get("completion_mask") if isinstance(output, dict) else None
        self.tokens += int(mask.sum()) if mask is not None else 0
        return output

    def take(self) -> tuple[float, int]:
        taken = (self.seconds, self.tokens)
        self.seconds, self.tokens = 0.0, 0
        return taken


def _timed_generation(trainer: Any) -> GenerationTimer:
    """A :class:`GenerationTimer` around TRL's generation (called unchanged); a TRL without the method keeps its
    generation untimed, said once (a progress line never stops a run)."""
    from hf_accum.compat import wrap_trl_generation
    from hf_accum.recipe.outputs import say

    timer = GenerationTimer()
    if not wrap_trl_generation(trainer, timer.wrapping):
        say("note: this TRL's generation cannot be timed (no GRPOTrainer._generate_and_score_completions): the "
            "progress line shows each update's seconds without the generation / training split")
    return timer


def _progress_callback_class() -> type:
    from transformers import TrainerCallback

    class GRPOProgress(TrainerCallback):
        """Each update's wall time split into generation and training; at each TRL log, one line (loss, reward
        mean, each reward's mean, completion length, seconds per update) and one ``record.updates`` entry."""

        def __init__(self, record: Any, timer: GenerationTimer, rewards: list[str]) -> None:
            self.record, self.timer, self.rewards = record, timer, rewards
            self.last = time.perf_counter()
            self.since_log = 0  # updates since TRL's last log

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            generation, tokens = self.timer.take()
            seconds, self.last = now - self.last, now
            self.record.updates.append({"step": state.global_step, "seconds": seconds, "generation_seconds": generation,
                                        "training_seconds": seconds - generation, "targets": tokens})
            self.since_log += 1

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if not logs or "reward" not in logs or not self.record.updates:
                return
            try:
                self._log(state, logs)
            except Exception as error:  # a progress line never stops a run
                from hf_accum.recipe.outputs import say

                say(f"note: GRPO progress line not printed ({type(error).__name__}: {error})")
            self.since_log = 0

        def _log(self, state: Any, logs: dict[str, Any]) -> None:
            """TRL's logged means (over the updates since its last log) go into the last update's entry."""
            from hf_accum.recipe.outputs import say

            window = self.record.updates[-max(1, self.since_log):]
            seconds = sum(u["seconds"] for u in window) / len(window)
            generation = sum(u["generation_seconds"] for u in window) / len(window)
            update = self.record.updates[-1]
            update.update(loss=logs.get("loss"), learning_rate=logs.get("learning_rate"),
                          grad_norm=logs.get("grad_norm"), reward=logs["reward"], reward_std=logs.get("reward_std"),
                          completion_length=logs.get("completions/mean_length"))
            each = ", ".join(f"{name} {logs[f'rewards/{name}/mean']:.2f}" for name in self.rewards
                             if f"rewards/{name}/mean" in logs)
            loss = f"loss {update['loss']:.4f}, " if update["loss"] is not None else ""
            length = update["completion_length"]
            split = (f"generation {generation:.1f} s, training {seconds - generation:.1f} s" if self.timer.measured
                     else f"{seconds:.1f} s")
            say(f"update {state.global_step}/{state.max_steps}: {loss}reward {update['reward']:.3f}"
                + (f" ({each})" if len(self.rewards) > 1 else "")
                + (f", completion {length:.1f} tokens" if length is not None else "")
                + f", per update: {split}")

    return GRPOProgress


def quiet_log_dicts(trainer: Any) -> None:
    """Keep the trainer's progress bar but stop it printing each raw log dict (``{'loss': ..., 'completions/...'}``,
    dozens of keys per log with GRPO): :class:`GRPOProgress` prints what matters, as the SFT and DPO defaults' loop
    engine prints its own line. Nothing is lost: the logs still reach ``state.log_history`` and every other callback
    (metrics.json, report_to)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class BarOnly(ProgressCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            return None

    trainer.pop_callback(PrinterCallback)  # training.disable_tqdm: the dicts printed bare
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(BarOnly)


# ----------------------------------------------------------------------------------------------
# The trainer engine
# ----------------------------------------------------------------------------------------------


def warm_start(model: Any, tokenizer: Any, data: GRPOData, collator: Any, args: Any, config: RecipeConfig) -> Any:
    """``grpo.warm_start_steps`` SFT updates of :class:`hf_accum.AccumTrainer` on the reference answers (the run's
    batch, or ``grpo.warm_start_batch_size`` sequences; same LR schedule shape over those steps, the run's
    accumulation settings), nothing saved; the model they leave."""
    from transformers import TrainingArguments

    from hf_accum import AccumTrainer

    steps, learning_rate = config.grpo.warm_start_steps, config.grpo.warm_start_learning_rate
    values = training_values(args)
    if config.grpo.warm_start_batch_size:  # checked before loading: whole micro-batches on every process
        values["gradient_accumulation_steps"] = config.grpo.warm_start_batch_size // (
            args.per_device_train_batch_size * args.world_size)
    values.update(max_steps=steps, learning_rate=learning_rate or args.learning_rate,
                  output_dir=f"{args.output_dir}/warm_start", save_strategy="no", eval_strategy="no",
                  report_to=[], resume_from_checkpoint=None)
    trainer = AccumTrainer(model=model, args=TrainingArguments(**values), train_dataset=data.train.examples,
                           data_collator=collator, processing_class=tokenizer, accumulation=config.accumulation)
    quiet_log_dicts(trainer)
    trainer.train()
    return trainer.model


def freeze_modules_to_save(model: Any) -> list[Any]:
    """``grpo.train_modules_to_save: false``: the PEFT model's fully trained copies (``modules_to_save``) take no
    gradient, so the optimizer TRL builds holds the LoRA matrices only; said once with the count. Returns the frozen
    parameters (trainable again after GRPO: PEFT saves the trainable ``modules_to_save`` only)."""
    from hf_accum.recipe.outputs import say

    frozen = [p for name, p in model.named_parameters() if ".modules_to_save." in name and p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    left = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(f"GRPO trains the LoRA matrices only ({left:,} parameters): {sum(p.numel() for p in frozen):,} in "
        "lora.modules_to_save kept as they are (grpo.train_modules_to_save=false)")
    return frozen


def train_grpo_with_trainer(evaluate: Callable[..., Any], model: Any, tokenizer: Any, data: GRPOData, collator: Any,
                            args: Any, record: Any, resume: Any, launch: Any) -> tuple[Any, Any]:
    """The warm start (``grpo.warm_start_steps``, skipped on resume: the checkpoint holds its result), then
    :class:`hf_accum.AccumGRPOTrainer` on the prompt rows, then the GRPO stage's held-out line."""
    from datasets import Dataset

    from hf_accum import AccumGRPOTrainer
    from hf_accum.planning.schedule import BatchPlan
    from hf_accum.recipe.launch import check_engine
    from hf_accum.recipe.outputs import barrier, percent, saved_eval_before, say

    config = record.config
    before = None
    if config.grpo.warm_start_steps and resume is None:
        say(f"warm start: {config.grpo.warm_start_steps} SFT updates on the reference answers ...")
        model = warm_start(model, tokenizer, data, collator, args, config)
        before = evaluate(model, tokenizer, data, config, args, "after the warm start")
        say(f"held-out {METRIC} after the warm start (the GRPO stage's before): {percent(before)}")
    elif not config.grpo.warm_start_steps and config.data.eval_before:
        # No warm start (a model that already answers some right): the GRPO stage starts where the run does, so its
        # before is the run's before-training score, kept in the output directory (scored once, not again here).
        before = saved_eval_before(config)[1]
    frozen = [] if config.grpo.train_modules_to_save else freeze_modules_to_save(model)
    trainer = AccumGRPOTrainer(
        model=model, reward_funcs=resolve_rewards(config.grpo.reward_funcs, config.grpo.format_pattern),
        args=grpo_config(config, args), train_dataset=Dataset.from_list(data.prompts), processing_class=tokenizer,
        fused_logprobs=config.accumulation.fused_loss,
    )
    # TRL's "ref" copy of a fresh adapter is the base model, which the adapter disabled also is (with model.adapter and
    # grpo.beta > 0 it would not be: refused before loading, hf_accum.recipe.grpo_section).
    drop_reference_adapter(trainer)
    timer = _timed_generation(trainer)
    names = [reward_name(spec) for spec in config.grpo.reward_funcs]
    trainer.add_callback(_progress_callback_class()(record, timer, names))
    quiet_log_dicts(trainer)
    check_engine(trainer.accelerator, launch)
    trainer.train(resume_from_checkpoint=resume)
    for parameter in frozen:
        parameter.requires_grad_(True)
    barrier()
    if before is not None:
        after = evaluate(trainer.model, tokenizer, data, config, args, "after GRPO")
        data.scored["after training"] = after
        say(f"GRPO stage: held-out {METRIC} before {percent(before)} -> after {percent(after)}")
        # metrics.json: the run's eval_before is the base model's (or none); the GRPO stage's own before/after here.
        record.facts["grpo_stage"] = {"warm_start_steps": config.grpo.warm_start_steps, "before": before,
                                      "after": after}
        if line := per_task_line(before, after):
            say(line)
    return trainer.model, BatchPlan(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                    args.world_size)


def per_task_line(before: Any, after: Any) -> str | None:
    """``GRPO stage per task: copy 32% -> 40%, ...`` from two held-out results (None where either has no
    per-task scores: another process's None, or data without tasks)."""
    tasks = [(before or {}).get("per_task") or {}, (after or {}).get("per_task") or {}]
    shared = [task for task in tasks[0] if task in tasks[1]]
    if not shared:
        return None
    return "GRPO stage per task: " + ", ".join(
        f"{task} {100 * tasks[0][task]:.0f}% -> {100 * tasks[1][task]:.0f}%" for task in shared)


def evaluate_grpo(evaluate: Callable[..., Any], model: Any, tokenizer: Any, data: GRPOData, config: RecipeConfig,
                  args: Any, when: str = "") -> Any:
    """The recipe's held-out exact match; a result the GRPO engine already scored is not scored again."""
    if when in data.scored:
        return data.scored[when]
    return evaluate(model, tokenizer, data, config, args, when)


def grpo_objective(evaluate: Callable[..., Any], collator: Callable[..., Any], score: Callable[..., str]) -> Objective:
    """The GRPO entry of the recipe's objective table; ``evaluate``, ``collator`` and ``score``: the recipe's SFT ones
    (held-out exact match; the warm start's batches)."""
    engines = {"trainer": (partial(train_grpo_with_trainer, evaluate), None)}
    return Objective(METRIC, load_grpo_data, collator, partial(evaluate_grpo, evaluate), score, engines)
