"""Section ``dpo``: :class:`hf_accum.AccumDPOTrainer` against TRL's own ``DPOTrainer``, side by side.

At each vocabulary in ``--dpo-vocab-sizes`` (49152 as SmolLM2, 262144 as Gemma 3), a Llama of ``--dpo-layers``
layers and hidden ``--dpo-hidden-size`` (untied head) with the same LoRA adapter (TRL adds it from
``peft_config``; the reference is the model with the adapter disabled) trains one epoch over ``--dpo-pairs``
preference pairs (log-normal prompt and answer lengths) with micro-batches of ``--dpo-micro-batch`` pairs and
``--dpo-accumulation`` per update: the same ``DPOConfig`` (sigmoid loss, fp32, no gradient checkpointing) for both.
Every run is its own process (:mod:`benchmarks.workers`); rounds rotate the order and every ratio is taken within a
round (median and min-max). Tokens/s = attended tokens of the policy's micro-batches / CPU time of ``train`` (one
thread), peak memory = peak RSS increment during ``train``; MFU = the policy's model FLOPs (forward and backward of
those tokens; the reference's no-grad forward is not counted, alike for both) / CPU time / the peak.

``--dpo-quick``: a model small enough for a 2-core CPU to run both vocabularies in about a minute or two.
:mod:`benchmarks.grpo` shares this module's run bookkeeping and table.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
from transformers.hf_argparser import HfArg

from benchmarks.report import BenchError, SectionResult, judge, median_interval, mib, percent, require_positive
from benchmarks.report import summary_row as _summary_row
from benchmarks.sft import RunResult, _Counting, _Meter, _MeterCallback, llama_with_lora, word_tokenizer
from benchmarks.workers import Workers
from hf_accum.measure.peak_flops import device_peak_flops

if TYPE_CHECKING:
    from benchmarks.harness import Bench
    from benchmarks.options import BenchOptions

VARIANTS = {"trl": "TRL DPOTrainer", "accum": "AccumDPOTrainer"}
TARGET_VOCAB, TARGET_SPEED, TARGET_MEMORY = 262144, 1.0, 0.6
QUICK = dict(layers=1, hidden_size=64, lora_r=4, pairs=4, micro_batch=2, accumulation=2, rounds=1, prompt_words=16,
             answer_words=12)
LR = 1e-4


@dataclass
class Options:
    _argument_group_name = "dpo section"

    dpo_vocab_sizes: list[int] = HfArg(default_factory=lambda: [49152, 262144],
                                       help="vocabularies to measure at (SmolLM2: 49152, Gemma 3: 262144)")
    dpo_pairs: int = HfArg(default=16, help="preference pairs: one epoch over them per run")
    dpo_prompt_words: int = HfArg(default=32, help="median prompt length in tokens (log-normal)")
    dpo_answer_words: int = HfArg(default=24, help="median chosen / rejected length in tokens (log-normal)")
    dpo_micro_batch: int = HfArg(default=2, help="pairs per micro-batch (per_device_train_batch_size)")
    dpo_accumulation: int = HfArg(default=2, help="micro-batches per update (gradient_accumulation_steps)")
    dpo_rounds: int = HfArg(default=2, help="rounds: each trainer runs once per round, the order rotated")
    dpo_layers: int = HfArg(default=2, help="decoder layers of the Llama")
    dpo_hidden_size: int = HfArg(default=256, help="hidden size (intermediate 3x, 4 heads)")
    dpo_lora_r: int = HfArg(default=16, help="LoRA rank (q_proj, v_proj; alpha 2r)")
    dpo_quick: bool = HfArg(default=False, help="a tiny model and 4 pairs, one round: about a minute or two on a "
                                                "2-core CPU (the vocabularies kept)")


def validate(common: BenchOptions, options: Options) -> None:
    check_sizes("dpo", options.dpo_vocab_sizes, options.dpo_hidden_size)
    require_positive(dpo_pairs=options.dpo_pairs, dpo_prompt_words=options.dpo_prompt_words,
                     dpo_answer_words=options.dpo_answer_words, dpo_micro_batch=options.dpo_micro_batch,
                     dpo_accumulation=options.dpo_accumulation, dpo_rounds=options.dpo_rounds,
                     dpo_layers=options.dpo_layers, dpo_lora_r=options.dpo_lora_r)


def check_sizes(section: str, vocab_sizes: list[int], hidden: int) -> None:
    bad = [v for v in vocab_sizes if v < 16]
    if bad or not vocab_sizes:
        raise BenchError(f"{section}_vocab_sizes {bad or '(none)'}: each must be at least 16")
    if hidden < 8 or hidden % 8:
        raise BenchError(f"{section}_hidden_size={hidden} must be a positive multiple of 8 (4 heads of an even size)")
    try:
        import peft  # noqa: F401
        import trl  # noqa: F401
    except ImportError as error:
        raise BenchError(f"the {section} section needs TRL and peft: pip install 'hf_accum[trl,qlora]' "
                         f"({error})") from None


def words(rng: random.Random, vocab_size: int, median: int, longest: int = 256) -> str:
    count = min(longest, max(1, round(rng.lognormvariate(math.log(median), 0.6))))
    return " ".join(f"w{rng.randrange(vocab_size - 3)}" for _ in range(count))


def preference_texts(spec: dict) -> list[dict]:
    rng = random.Random(spec["seed"])
    vocab = spec["vocab_size"]
    return [{"prompt": words(rng, vocab, spec["prompt_words"]), "chosen": " " + words(rng, vocab, spec["answer_words"]),
             "rejected": " " + words(rng, vocab, spec["answer_words"])} for _ in range(spec["pairs"])]


def _run_dpo(spec: dict, meter: _Meter, output_dir: str) -> _Counting:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from hf_accum import AccumDPOTrainer

    tokenizer = word_tokenizer(spec["vocab_size"])
    model, lora = llama_with_lora(tokenizer, spec["hidden_size"], spec["layers"], spec["seed"], spec["lora_r"],
                                  wrap=False)
    args = DPOConfig(
        output_dir=output_dir, per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["accumulation"], num_train_epochs=1, learning_rate=LR,
        lr_scheduler_type="linear", max_grad_norm=1.0, seed=spec["seed"], bf16=False, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, loss_type=["sigmoid"],
        activation_checkpointing=False, gradient_checkpointing=False, precompute_ref_log_probs=False,
    )
    cls = AccumDPOTrainer if spec["variant"] == "accum" else DPOTrainer
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(preference_texts(spec)),
                  processing_class=tokenizer, peft_config=lora)
    counting = _Counting(trainer.data_collator)
    trainer.data_collator = counting
    trainer.add_callback(_MeterCallback(meter))
    trainer.train()
    return counting


def run_here(**spec: Any) -> RunResult:
    """One DPO epoch with ``spec["variant"]``'s trainer, in this process."""
    return run_measured(spec, _run_dpo)


def run_measured(spec: dict, runner: Callable[[dict, _Meter, str], _Counting]) -> RunResult:
    """``runner`` in this process, metered: CPU seconds (or the runner's own loss-step clock), peak RSS, MFU."""
    import warnings

    if spec["threads"] is not None:
        torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")
    meter = _Meter(torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="hf_accum_bench_") as tmp:
        counting = runner(spec, meter, tmp)
    seconds = getattr(counting, "seconds", None) or meter.cpu
    targets = getattr(counting, "targets", 0)
    flops = _model_flops(spec, counting.real, targets, counting.squared_lengths)
    peak = device_peak_flops(torch.device("cpu"), torch.float32)
    return RunResult(seconds, meter.wall, meter.peak, counting.real, counting.positions, targets, spec["variant"],
                     flops, flops / seconds / peak.flops if peak.flops and seconds > 0 else None, peak.describe())


def _model_flops(spec: dict, real: int, targets: int, squared_lengths: int) -> float:
    from hf_accum.measure.utilization import ModelFlops

    with torch.device("meta"):
        model, _ = llama_with_lora(word_tokenizer(spec["vocab_size"]), spec["hidden_size"], spec["layers"],
                                   spec["seed"], spec["lora_r"], wrap=True)
    return ModelFlops.of(model).update_flops(real, targets or real, squared_lengths)


# ----------------------------------------------------------------------------------------------
# Rounds, ratios, the table (shared with benchmarks.grpo)
# ----------------------------------------------------------------------------------------------


@dataclass
class PairedRow:
    vocab_size: int
    runs: dict[str, list[RunResult]]

    def rates(self, name: str) -> list[float]:
        return [r.real_tokens / r.seconds for r in self.runs[name]]

    def ratios(self, what: str) -> list[float]:
        """Per round, ours / TRL's: tokens/s (``speed``) or peak memory."""
        if what == "speed":
            return [a / b for a, b in zip(self.rates("accum"), self.rates("trl"))]
        return [a.peak_bytes / max(b.peak_bytes, 1) for a, b in zip(self.runs["accum"], self.runs["trl"])]

    def mfu(self, name: str) -> float | None:
        known = [r.mfu for r in self.runs[name] if r.mfu is not None]
        return statistics.median(known) if known else None


@dataclass
class PairedResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("ratios",)

    section: str
    model: str
    data: str
    clock: str
    rounds: int
    load_average: list[float]
    variants: dict[str, str]
    rows: list[PairedRow] = field(default_factory=list)

    @property
    def ratios(self) -> dict:
        return {str(row.vocab_size): {"tokens_per_s": row.ratios("speed"), "memory": row.ratios("memory")}
                for row in self.rows}

    def text(self) -> str:
        lines = [f"\n{self.section}: {self.model}; {self.data}",
                 f"  tokens/s by {self.clock}; memory = peak RSS increment; each run its own process; ratios ours / "
                 f"TRL's within a round, median (min-max) over {self.rounds} round(s); load average "
                 f"{', '.join(f'{v:.1f}' for v in self.load_average)} (a shared machine: ratios, not absolutes)"]
        for row in self.rows:
            lines.append(f"  vocab {row.vocab_size}:")
            for name, runs in row.runs.items():
                lines.append(f"    {self.variants[name]:<28} {statistics.median(row.rates(name)):10.0f} tokens/s  "
                             f"MFU {percent(row.mfu(name)):>6}  peak "
                             f"{mib(int(statistics.median(r.peak_bytes for r in runs))):>12}")
            lines.append(f"    ours / TRL: tokens/s {spread(row.ratios('speed'))}, memory {spread(row.ratios('memory'))}")
        peaks = sorted({r.peak for row in self.rows for runs in row.runs.values() for r in runs if r.peak})
        lines.append(f"  MFU: model FLOPs (hf_accum.measure.utilization) / {self.clock} / {', '.join(peaks) or 'no peak'}")
        return "\n".join(lines)

    def summary(self) -> list[dict]:
        out = []
        for row in self.rows:
            speed, memory = row.ratios("speed"), row.ratios("memory")
            checks = [judge(median_interval(speed), TARGET_SPEED),
                      judge(median_interval(memory), TARGET_MEMORY, at_least=False)]
            measured = (f"tokens/s {spread(speed)}, memory {spread(memory)}, MFU {percent(row.mfu('accum'))} vs "
                        f"{percent(row.mfu('trl'))}")
            judged = row.vocab_size >= TARGET_VOCAB
            verdict = ("FAIL" if False in checks else "PASS" if all(checks) else "INCONCLUSIVE") if judged else "n/a"
            out.append(_summary_row(f"{self.section} vocab {row.vocab_size}: {self.variants['accum']} / "
                                    f"{self.variants['trl']}", measured,
                                    f"tokens/s >= {TARGET_SPEED:.1f}, memory <= {TARGET_MEMORY:.1f} (at "
                                    f"{TARGET_VOCAB})", verdict))
        return out


def spread(ratios: list[float]) -> str:
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def run_rounds(bench: Bench, result: PairedResult, call: str, specs: Callable[[str, int], dict],
               vocab_sizes: list[int], rounds: int, preload: list[str]) -> PairedResult:
    """Every vocabulary, ``rounds`` rounds of both trainers (order rotated), each run in its own process."""
    names = list(result.variants)
    workers = Workers(bench.options.threads, preload=preload)
    try:
        with bench.progress(len(vocab_sizes) * rounds * len(names), f"{result.section} runs") as bar:
            for vocab_size in vocab_sizes:
                runs: dict[str, list[RunResult]] = {name: [] for name in names}
                for index in range(rounds):
                    shift = index % len(names)
                    for name in names[shift:] + names[:shift]:
                        measured = workers.call(call, specs(name, vocab_size), f"{call} {name} at vocab {vocab_size}")
                        runs[name].append(RunResult(**measured))
                        bar.update(1)
                result.rows.append(PairedRow(vocab_size, runs))
    finally:
        workers.close()
    result.load_average = list(os.getloadavg())
    return result


def settings(options: Any, prefix: str, names: tuple[str, ...]) -> dict:
    """The section's options by short name, ``--<prefix>-quick`` replacing the sizes by :data:`QUICK`'s."""
    values = {name: getattr(options, f"{prefix}_{name}") for name in names}
    if getattr(options, f"{prefix}_quick"):
        values.update({k: v for k, v in QUICK.items() if k in values})
    return values


def measure(bench: Bench, options: Options) -> PairedResult:
    s = settings(options, "dpo", ("layers", "hidden_size", "lora_r", "pairs", "micro_batch", "accumulation",
                                  "rounds", "prompt_words", "answer_words"))
    common = bench.options
    result = PairedResult(
        "dpo", f"Llama ({s['layers']} layers, hidden {s['hidden_size']}, untied head), fp32, LoRA r={s['lora_r']} "
        "on q/v, sigmoid loss, reference = adapter disabled",
        f"{s['pairs']} pairs (median prompt {s['prompt_words']} / answers {s['answer_words']} tokens), micro-batch "
        f"{s['micro_batch']} pairs x K={s['accumulation']}, one epoch", bench.clock, s["rounds"], [], dict(VARIANTS))

    def spec(variant: str, vocab_size: int) -> dict:
        return dict(s, variant=variant, vocab_size=vocab_size, seed=common.seed, threads=common.threads)

    return run_rounds(bench, result, "benchmarks.dpo:run_here", spec, options.dpo_vocab_sizes, s["rounds"],
                      ["benchmarks.dpo", "trl", "peft"])
