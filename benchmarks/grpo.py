"""Section ``grpo``: :class:`hf_accum.AccumGRPOTrainer` against TRL's own ``GRPOTrainer``, the loss step timed apart
from generation.

At each vocabulary in ``--grpo-vocab-sizes`` (49152, 262144), the Llama and LoRA of :mod:`benchmarks.dpo` (its
options' counterparts here) train one epoch over ``--grpo-prompts`` prompts x ``--grpo-generations`` completions,
``--grpo-micro-batch`` completions per micro-batch and ``--grpo-accumulation`` per update, ``loss_type`` dapo (TRL's
default), ``beta`` 0, the same ``GRPOConfig`` for both. Generation is replaced in both by the same fixed completions
(log-normal lengths, seeded; a CPU bench of sampling would time ``generate``, which neither trainer changes), so what
is timed is the loss step: the CPU time of ``training_step`` (the log-probs forward, the loss, backward) less the
replaced generation's. Memory: peak RSS increment during ``train``. Tokens: prompt + completion tokens the loss step
forwarded. Rounds, ratios and the table are :mod:`benchmarks.dpo`'s.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.hf_argparser import HfArg

from benchmarks.dpo import PairedResult, check_sizes, run_measured, run_rounds, settings, words
from benchmarks.report import require_positive
from benchmarks.sft import _Meter, _MeterCallback, llama_with_lora, word_tokenizer

if TYPE_CHECKING:
    from benchmarks.harness import Bench

VARIANTS = {"trl": "TRL GRPOTrainer", "accum": "AccumGRPOTrainer"}
LR = 1e-4


@dataclass
class Options:
    _argument_group_name = "grpo section"

    grpo_vocab_sizes: list[int] = HfArg(default_factory=lambda: [49152, 262144], help="vocabularies to measure at")
    grpo_prompts: int = HfArg(default=8, help="prompts: one epoch over them per run")
    grpo_generations: int = HfArg(default=4, help="completions per prompt (num_generations)")
    grpo_prompt_words: int = HfArg(default=32, help="median prompt length in tokens (log-normal)")
    grpo_answer_words: int = HfArg(default=48, help="median completion length in tokens (log-normal)")
    grpo_micro_batch: int = HfArg(default=4, help="completions per micro-batch (per_device_train_batch_size)")
    grpo_accumulation: int = HfArg(default=2, help="micro-batches per update (gradient_accumulation_steps)")
    grpo_rounds: int = HfArg(default=2, help="rounds: each trainer runs once per round, the order rotated")
    grpo_layers: int = HfArg(default=2, help="decoder layers of the Llama")
    grpo_hidden_size: int = HfArg(default=256, help="hidden size (intermediate 3x, 4 heads)")
    grpo_lora_r: int = HfArg(default=16, help="LoRA rank (q_proj, v_proj; alpha 2r)")
    grpo_quick: bool = HfArg(default=False, help="a tiny model, 4 prompts x 2 completions, one round: about a minute "
                                                 "or two on a 2-core CPU (the vocabularies kept)")


QUICK_PROMPTS = dict(prompts=4, generations=2, micro_batch=2)


def validate(common: Any, options: Options) -> None:
    check_sizes("grpo", options.grpo_vocab_sizes, options.grpo_hidden_size)
    require_positive(grpo_prompts=options.grpo_prompts, grpo_generations=options.grpo_generations,
                     grpo_prompt_words=options.grpo_prompt_words, grpo_answer_words=options.grpo_answer_words,
                     grpo_micro_batch=options.grpo_micro_batch, grpo_accumulation=options.grpo_accumulation,
                     grpo_rounds=options.grpo_rounds, grpo_layers=options.grpo_layers, grpo_lora_r=options.grpo_lora_r)


class _FixedCompletions:
    """``_generate_and_score_completions`` replaced: seeded prompts and completions of log-normal lengths (the same
    for both trainers), advantages of both signs; its own CPU time kept, to be taken off the loss step's."""

    def __init__(self, trainer: Any, spec: dict) -> None:
        self.trainer, self.spec, self.calls, self.seconds = trainer, spec, 0, 0.0

    def __call__(self, inputs: list[dict]) -> dict:
        started = time.process_time()
        rng = random.Random(1000 * self.spec["seed"] + self.calls)
        self.calls += 1
        tokenizer, n = self.trainer.processing_class, len(inputs)

        def ids(median: int) -> list[int]:
            return tokenizer(words(rng, self.spec["vocab_size"], median, self.spec["max_completion"]),
                             add_special_tokens=False)["input_ids"]

        prompts = [ids(self.spec["prompt_words"]) for _ in range(n)]
        completions = [ids(self.spec["answer_words"]) for _ in range(n)]
        prompt_ids, prompt_mask = _padded(prompts, tokenizer.pad_token_id, left=True)
        completion_ids, completion_mask = _padded(completions, tokenizer.pad_token_id, left=False)
        advantages = torch.tensor([rng.gauss(0.0, 1.0) for _ in range(n)])
        self.seconds += time.process_time() - started
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                "completion_mask": completion_mask, "advantages": advantages,
                "num_items_in_batch": completion_mask.sum()}


def _padded(rows: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


class _LossStepClock:
    """Wraps ``training_step``: its CPU time (less the replaced generation's) and the tokens it forwarded."""

    def __init__(self, trainer: Any, generation: _FixedCompletions) -> None:
        self.trainer, self.generation, self.inner = trainer, generation, trainer.training_step
        self.seconds = 0.0
        self.real = self.positions = self.targets = self.squared_lengths = 0
        trainer.training_step = self

    def __call__(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        generated_before, started = self.generation.seconds, time.process_time()
        loss = self.inner(model, inputs, num_items_in_batch)
        self.seconds += time.process_time() - started - (self.generation.seconds - generated_before)
        return loss

    def count(self, inputs: dict) -> None:
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        self.real += int(mask.sum())
        self.positions += mask.numel()
        self.targets += int(inputs["completion_mask"].sum())
        self.squared_lengths += int((mask.sum(1) ** 2).sum())


def _run_grpo(spec: dict, meter: _Meter, output_dir: str) -> _LossStepClock:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from hf_accum import AccumGRPOTrainer

    tokenizer = word_tokenizer(spec["vocab_size"])
    model, lora = llama_with_lora(tokenizer, spec["hidden_size"], spec["layers"], spec["seed"], spec["lora_r"],
                                  wrap=False)
    args = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=spec["micro_batch"], num_generations=spec["generations"],
        gradient_accumulation_steps=spec["accumulation"], steps_per_generation=spec["accumulation"],
        max_completion_length=spec["max_completion"], learning_rate=LR, num_train_epochs=1, max_grad_norm=1.0,
        seed=spec["seed"], bf16=False, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        logging_steps=1000, loss_type="dapo", beta=0.0, shuffle_dataset=False,
    )
    cls = AccumGRPOTrainer if spec["variant"] == "accum" else GRPOTrainer
    trainer = cls(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                  train_dataset=Dataset.from_list([{"prompt": f"w{i}"} for i in range(spec["prompts"])]),
                  processing_class=tokenizer, peft_config=lora)
    generation = _FixedCompletions(trainer, spec)
    trainer._generate_and_score_completions = generation
    clock = _LossStepClock(trainer, generation)
    original_compute_loss = trainer.compute_loss

    def counted_compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if model.training:
            clock.count(inputs)
        return original_compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = counted_compute_loss
    trainer.add_callback(_MeterCallback(meter))
    trainer.train()
    return clock


def run_here(**spec: Any) -> Any:
    """One GRPO epoch with ``spec["variant"]``'s trainer, in this process (the loss step's clock)."""
    return run_measured(spec, _run_grpo)  # type: ignore[arg-type]  # the clock counts like _Counting


def measure(bench: Bench, options: Options) -> PairedResult:
    s = settings(options, "grpo", ("layers", "hidden_size", "lora_r", "prompts", "generations", "micro_batch",
                                   "accumulation", "rounds", "prompt_words", "answer_words"))
    if options.grpo_quick:
        s.update(QUICK_PROMPTS)
    common = bench.options
    result = PairedResult(
        "grpo", f"Llama ({s['layers']} layers, hidden {s['hidden_size']}, untied head), fp32, LoRA r={s['lora_r']} "
        "on q/v, loss_type dapo, beta 0",
        f"{s['prompts']} prompts x {s['generations']} fixed completions (median prompt {s['prompt_words']} / "
        f"completion {s['answer_words']} tokens), micro-batch {s['micro_batch']} x K={s['accumulation']}; timed: "
        "training_step less generation", bench.clock + " (the loss step)", s["rounds"], [], dict(VARIANTS))

    def spec(variant: str, vocab_size: int) -> dict:
        return dict(s, variant=variant, vocab_size=vocab_size, seed=common.seed, threads=common.threads,
                    max_completion=4 * s["answer_words"])

    return run_rounds(bench, result, "benchmarks.grpo:run_here", spec, options.grpo_vocab_sizes, s["rounds"],
                      ["benchmarks.grpo", "trl", "peft"])
