"""Section ``sft``: supervised fine-tuning with LoRA, every front-end an SFT user picks between.

At each vocabulary in ``--sft-vocab-sizes`` (32000 as Llama 2 / Mistral, 128256 as Llama 3), a Llama of
``--sft-layers`` layers and hidden ``--sft-hidden-size`` with a LoRA adapter (``--sft-lora-r``) trains one
epoch over ``--sft-rows`` prompt/completion rows of long-tailed length (loss on the completion only), with
micro-batches of ``--sft-micro-batch`` rows and ``--sft-accumulation`` micro-batches per update, through:

* stock ``transformers.Trainer`` (rows padded to the longest of each micro-batch), and
  :class:`hf_accum.AccumTrainer` with the same batching;
* TRL's ``SFTTrainer`` with ``padding_free=True`` and with ``packing=True`` (its default strategy, ``bfd``), and
  :class:`hf_accum.AccumSFTTrainer` with each of the two. Packing puts ``--sft-packing-rows`` (1) packed rows
  of ``--sft-packing-length`` tokens (default: the longest example, so nothing is truncated) in a micro-batch:
  a micro-batch then holds no more positions than the padded micro-batch holding the longest example, and
  the memory comparison with the padded front-ends is one on the same data. (TRL's default, 4 rows of 1024
  tokens, puts a 48-row epoch in one micro-batch and a 96-row one in two: fewer than one update's K, and
  3-4x the positions of any padded micro-batch.)
* the loop, :func:`hf_accum.train` with :class:`hf_accum.PackingCollator` (a micro-batch's rows in one row).

Every run is its own process (:mod:`benchmarks.workers`), so its peak memory is its own: the peak resident
set size during ``train`` minus the resident size when training started (CUDA: the peak allocation
increment). Real tokens/s = non-pad tokens the model saw / seconds of ``train`` (CPU: process CPU time of the
one-thread run, which counts the work done and not the time other jobs held the cores). Rounds rotate the
order of the front-ends; every ratio is taken within a round and reported as its median and min-max.
The path each hf_accum front-end took for the loss (``fused``: no ``(tokens x vocab)`` logits; ``logits``)
is read from hf_accum's own log line, so the table says what the library actually did.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
from transformers import TrainerCallback
from transformers.hf_argparser import HfArg

from benchmarks.harness import Bench, LossPathLog, synchronize
from benchmarks.report import (
    BenchError, SectionResult, judge, median_interval, mib, percent, require_positive, summary_row,
)
from benchmarks.workers import Workers, peak_memory, reset_peak
from hf_accum.measure.peak_flops import device_peak_flops

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

# name: what the table calls it
VARIANTS = {
    "trainer": "stock Trainer, padded",
    "trl_padding_free": "TRL SFTTrainer, padding_free=True",
    "trl_packing": "TRL SFTTrainer, packing=True",
    "accum_trainer": "AccumTrainer, padded",
    "accum_sft_padding_free": "AccumSFTTrainer, padding_free=True",
    "accum_sft_packing": "AccumSFTTrainer, packing=True",
    "loop_packing": "hf_accum.train + PackingCollator",
}
HF_ACCUM_VARIANTS = ("accum_trainer", "accum_sft_padding_free", "accum_sft_packing", "loop_packing")
# The baselines every row is divided by: stock Trainer, and TRL in the mode an SFT user would otherwise pick.
BASELINES = {"trainer": "stock Trainer", "trl_padding_free": "TRL padding-free", "trl_packing": "TRL packing"}
# Targets (ours, baseline, tokens/s at least, memory at most).
TARGETS = (
    ("accum_sft_padding_free", "trl_padding_free", 1.5, 0.5),
    ("accum_sft_packing", "trl_packing", 1.5, 0.5),
    ("accum_sft_padding_free", "accum_trainer", None, 1.0),
    ("accum_sft_packing", "accum_trainer", None, 1.0),
)
JUDGED_FROM_VOCAB = 32000
"""Below this vocabulary (the test's tiny runs) the targets are not judged: the loss step is not what they are about."""
LR = 1e-4


@dataclass
class Options:
    _argument_group_name = "sft section"

    sft_vocab_sizes: list[int] = HfArg(default_factory=lambda: [32000, 128256],
                                       help="vocabularies to measure at (Llama 2 / Mistral: 32000, Llama 3: 128256)")
    sft_rows: int = HfArg(default=96, help="prompt/completion rows: one epoch over them per run")
    sft_prompt_words: int = HfArg(default=24, help="median prompt length in tokens (log-normal: long-tailed)")
    sft_completion_words: int = HfArg(default=16, help="median completion length in tokens (log-normal)")
    sft_max_words: int = HfArg(default=384, help="longest prompt or completion in tokens (the tail's cut)")
    sft_micro_batch: int = HfArg(default=4, help="rows per micro-batch (per_device_train_batch_size)")
    sft_accumulation: int = HfArg(default=4, help="micro-batches per update (gradient_accumulation_steps)")
    sft_packing_rows: int = HfArg(default=1, help="packed rows per micro-batch of the packing front-ends "
                                                  "(their per_device_train_batch_size)")
    sft_packing_length: int = HfArg(default=0, help="tokens per packed row (TRL's max_length) for the packing "
                                                    "front-ends; 0: the longest example, so nothing is truncated")
    sft_rounds: int = HfArg(default=3, help="rounds: every front-end runs once per round, in its own process, "
                                            "the order rotated between rounds")
    sft_layers: int = HfArg(default=4, help="decoder layers of the Llama")
    sft_hidden_size: int = HfArg(default=256, help="hidden size of the Llama (intermediate 3x, 4 heads)")
    sft_lora_r: int = HfArg(default=16, help="LoRA rank (q_proj, v_proj; alpha 2r)")
    sft_gradient_checkpointing: bool = HfArg(
        default=False, help="gradient checkpointing in every front-end (off by default in all of them, although "
                            "TRL's SFTConfig defaults to it, so that every row computes the same thing)")
    sft_variants: list[str] = HfArg(default_factory=lambda: list(VARIANTS), metadata={"choices": list(VARIANTS)},
                                    help="front-ends to run (ratios need their baseline in the list)")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(
        sft_rows=options.sft_rows, sft_prompt_words=options.sft_prompt_words,
        sft_completion_words=options.sft_completion_words, sft_max_words=options.sft_max_words,
        sft_micro_batch=options.sft_micro_batch, sft_accumulation=options.sft_accumulation,
        sft_packing_rows=options.sft_packing_rows,
        sft_rounds=options.sft_rounds, sft_layers=options.sft_layers, sft_lora_r=options.sft_lora_r,
    )
    smallest = len(SPECIAL_TOKENS) + 2
    bad = [v for v in options.sft_vocab_sizes if v < smallest]
    if bad or not options.sft_vocab_sizes:
        raise BenchError(f"sft_vocab_sizes {bad or '(none)'}: each must be at least {smallest}")
    if options.sft_hidden_size < 8 or options.sft_hidden_size % 8:
        raise BenchError(f"sft_hidden_size={options.sft_hidden_size} must be a positive multiple of 8 "
                         "(4 attention heads of an even size)")
    if options.sft_packing_length < 0 or options.sft_packing_length > MAX_LENGTH:
        raise BenchError(f"sft_packing_length={options.sft_packing_length}: must be 0 (the longest example) or "
                         f"1..{MAX_LENGTH} tokens")
    if 2 * options.sft_max_words + 1 > MAX_LENGTH:
        raise BenchError(f"sft_max_words={options.sft_max_words}: a row (prompt + completion + EOS) must fit "
                         f"TRL's max_length of {MAX_LENGTH} tokens; at most {(MAX_LENGTH - 1) // 2}")
    _refuse_truncating_packing(common, options)
    try:
        import peft  # noqa: F401
        import trl  # noqa: F401
    except ImportError as error:
        raise BenchError(f"the sft section needs TRL and peft: pip install 'hf_accum[trl,qlora]' ({error})") from None
    if common.device == "cpu" and not Path("/proc/self/clear_refs").exists():
        raise BenchError("the sft section measures peak RSS through /proc/self/clear_refs (Linux); "
                         "run it on Linux or with --device cuda")


def _refuse_truncating_packing(common: BenchOptions, options: Options) -> None:
    """A packed row shorter than the longest example would make TRL's ``bfd`` packing drop that example's
    tail: the packing front-ends would train on less data than the others and still be judged."""
    if not options.sft_packing_length:
        return
    for vocab_size in options.sft_vocab_sizes:
        longest = longest_example(sft_texts(options.sft_rows, vocab_size, common.seed, options.sft_prompt_words,
                                            options.sft_completion_words, options.sft_max_words))
        if options.sft_packing_length < longest:
            raise BenchError(f"sft_packing_length={options.sft_packing_length} is shorter than the longest example "
                             f"({longest} tokens at vocab {vocab_size}): packing would truncate it; use 0 (the "
                             f"longest example) or at least {longest}")


# ----------------------------------------------------------------------------------------------
# The data and the model, built the same way in every run (same seed: same rows, same weights)
# ----------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|end|>"]
MAX_LENGTH = 1024  # TRL's default max_length; every row fits, so nothing is truncated anywhere


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly ``vocab_size`` ids: the special tokens, then words ``w0, w1, ...``.
    Built here (not downloaded): a real vocabulary's size is what the loss step costs, not its words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": len(SPECIAL_TOKENS) + i for i in range(vocab_size - len(SPECIAL_TOKENS))})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>")


def sft_texts(n: int, vocab_size: int, seed: int, prompt_words: int, completion_words: int,
              max_words: int) -> list[dict]:
    """``n`` rows ``{"prompt", "completion"}`` of random words; lengths log-normal around the medians given
    (sigma 1: a few rows are 5-10x the median, as in real SFT data), cut at ``max_words``. Completions start
    with a space: TRL tokenizes prompt + completion as one string."""
    rng = random.Random(seed)
    words = vocab_size - len(SPECIAL_TOKENS)

    def text(median: int) -> str:
        count = min(max_words, max(1, round(rng.lognormvariate(math.log(median), 1.0))))
        return " ".join(f"w{rng.randrange(words)}" for _ in range(count))

    return [{"prompt": text(prompt_words), "completion": " " + text(completion_words)} for _ in range(n)]


def tokenized(rows: list[dict], tokenizer) -> list[dict]:
    """What TRL makes of a prompt/completion row (prompt + completion + EOS; loss on the completion and EOS),
    for the front-ends that take tokenized rows (``prompt_length`` masks the prompt in hf_accum's collators)."""
    out = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        out.append({"input_ids": prompt + completion + [tokenizer.eos_token_id], "prompt_length": len(prompt)})
    return out


def llama_with_lora(tokenizer, hidden: int, layers: int, seed: int, lora_r: int, wrap: bool):
    """A randomly initialised Llama (untied head, as Llama 2/3) and the LoRA config; ``wrap``: the peft model
    (TRL wraps it itself from ``peft_config``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_LENGTH * 4,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    torch.manual_seed(seed + 1)  # the adapter's init, the same whoever wraps the model
    return (get_peft_model(model, lora) if wrap else model), lora


# ----------------------------------------------------------------------------------------------
# One run, in its own process
# ----------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    seconds: float
    """Seconds of ``train`` by the section's clock (process CPU time on CPU, wall on CUDA)."""
    wall: float
    peak_bytes: int
    real_tokens: int
    """Non-pad tokens the model was given."""
    positions: int
    """Positions computed, pad included."""
    targets: int
    """Positions with a loss target."""
    path: str
    """hf_accum front-ends: 'fused' or 'logits' (from hf_accum's log); '-' for the others."""
    flops: float = 0.0
    """Model FLOPs of the epoch (:mod:`hf_accum.measure.utilization`: the same for every front-end on the same rows)."""
    mfu: float | None = None
    """``flops / seconds`` over the peak of ``peak`` (None: no peak known)."""
    peak: str = ""


class _Counting:
    """Wraps a data collator; counts real tokens, positions and targets of what it hands the model."""

    def __init__(self, collate: Callable):
        self.collate = collate
        self.real = self.positions = self.targets = self.squared_lengths = 0

    def __call__(self, examples):
        from hf_accum.accumulation import squared_sequence_lengths

        batch = self.collate(examples)
        self.squared_lengths += int(squared_sequence_lengths(batch))  # attention's share of the model FLOPs
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        self.positions += ids.numel()
        self.real += int(mask.sum()) if mask is not None else ids.numel()  # padding-free: every position is real
        labels = batch.get("labels")
        if labels is not None:
            self.targets += int((labels[..., 1:] != -100).sum())  # causal LM: the first position predicts nothing
        return batch


class _Meter:
    """Clocks and peak memory of one ``train`` (started and stopped by the front-end's runner)."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        synchronize(self.device)
        self.base = reset_peak(self.device)
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        synchronize(self.device)
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        self.peak = peak_memory(self.device) - self.base


class _MeterCallback(TrainerCallback):
    def __init__(self, meter: _Meter):
        self.meter = meter

    def on_train_begin(self, *_args, **_kwargs):
        self.meter.start()

    def on_train_end(self, *_args, **_kwargs):
        self.meter.stop()


def _common_args(spec: dict, output_dir: str) -> dict:
    """The TrainingArguments every Trainer-based front-end shares (SFTConfig takes the same)."""
    return dict(
        output_dir=output_dir, per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["accumulation"], num_train_epochs=1, learning_rate=LR,
        lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.0, seed=spec["seed"],
        gradient_checkpointing=spec["gradient_checkpointing"], bf16=False, report_to="none", save_strategy="no",
        use_cpu=spec["device"] == "cpu", disable_tqdm=True, dataloader_num_workers=0,
    )


def _run_trainer(spec: dict, meter: _Meter, output_dir: str, accum: bool) -> _Counting:
    from transformers import Trainer, TrainingArguments

    from hf_accum import AccumTrainer, PaddingCollator

    tokenizer = word_tokenizer(spec["vocab_size"])
    model, _ = llama_with_lora(tokenizer, spec["hidden_size"], spec["layers"], spec["seed"], spec["lora_r"], wrap=True)
    rows = tokenized(_texts(spec), tokenizer)
    counting = _Counting(PaddingCollator(tokenizer.pad_token_id))
    args = TrainingArguments(**_common_args(spec, output_dir), remove_unused_columns=False)  # keep prompt_length
    trainer = (AccumTrainer if accum else Trainer)(model=model, args=args, train_dataset=rows, data_collator=counting)
    trainer.add_callback(_MeterCallback(meter))
    trainer.train()
    return counting


def _run_sft(spec: dict, meter: _Meter, output_dir: str, accum: bool, mode: str) -> _Counting:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_accum import AccumSFTTrainer

    tokenizer = word_tokenizer(spec["vocab_size"])
    model, lora = llama_with_lora(tokenizer, spec["hidden_size"], spec["layers"], spec["seed"], spec["lora_r"],
                                  wrap=False)
    texts = _texts(spec)
    common = _common_args(spec, output_dir)
    if mode == "packing":
        common["per_device_train_batch_size"] = spec["packing_rows"]
        max_length = spec["packing_length"] or longest_example(texts)
    else:
        max_length = None  # TRL refuses max_length with padding_free alone (it cannot enforce it); every row fits
    args = SFTConfig(**common, max_length=max_length, **{mode: True})
    cls = AccumSFTTrainer if accum else SFTTrainer
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(texts), processing_class=tokenizer,
                  peft_config=lora)
    counting = _Counting(trainer.data_collator)
    trainer.data_collator = counting  # read when the train dataloader is built, inside train()
    trainer.add_callback(_MeterCallback(meter))
    trainer.train()
    return counting


def _run_loop(spec: dict, meter: _Meter, output_dir: str) -> _Counting:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from hf_accum import LoopConfig, PackingCollator, train

    tokenizer = word_tokenizer(spec["vocab_size"])
    model, _ = llama_with_lora(tokenizer, spec["hidden_size"], spec["layers"], spec["seed"], spec["lora_r"], wrap=True)
    if spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable()
    counting = _Counting(PackingCollator())
    accelerator = Accelerator(cpu=spec["device"] == "cpu", gradient_accumulation_steps=spec["accumulation"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    # A shuffled order, as the Trainers' default sampler gives.
    loader = DataLoader(tokenized(_texts(spec), tokenizer), batch_size=spec["micro_batch"], shuffle=True,
                        generator=torch.Generator().manual_seed(spec["seed"]), collate_fn=counting)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(num_train_epochs=1, lr_scheduler_type="linear", max_grad_norm=1.0, disable_tqdm=True)
    meter.start()
    train(model, optimizer, loader, accelerator, config)
    meter.stop()
    return counting


RUNNERS: dict[str, Callable[[dict, _Meter, str], _Counting]] = {
    "trainer": lambda *a: _run_trainer(*a, accum=False),
    "accum_trainer": lambda *a: _run_trainer(*a, accum=True),
    "trl_padding_free": lambda *a: _run_sft(*a, accum=False, mode="padding_free"),
    "trl_packing": lambda *a: _run_sft(*a, accum=False, mode="packing"),
    "accum_sft_padding_free": lambda *a: _run_sft(*a, accum=True, mode="padding_free"),
    "accum_sft_packing": lambda *a: _run_sft(*a, accum=True, mode="packing"),
    "loop_packing": _run_loop,
}


def longest_example(rows: list[dict]) -> int:
    """Tokens of the longest row (prompt + completion + EOS): the packed row length when none is given, so that
    TRL's ``bfd`` packing truncates nothing. The word-level tokenizer gives one token per word."""
    return max(len(row["prompt"].split()) + len(row["completion"].split()) + 1 for row in rows)


def _texts(spec: dict) -> list[dict]:
    return sft_texts(spec["rows"], spec["vocab_size"], spec["seed"], spec["prompt_words"], spec["completion_words"],
                     spec["max_words"])


def run_here(**spec: Any) -> RunResult:
    """Build the tokenizer, model and rows of ``spec`` and train one epoch with its front-end, in this process."""
    import warnings

    if spec["threads"] is not None:
        torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")  # the child's output goes to a log nobody reads unless it fails
    device = torch.device(spec["device"])
    meter = _Meter(device)
    with tempfile.TemporaryDirectory(prefix="hf_accum_bench_") as tmp, LossPathLog.watching() as path_log:
        counting = RUNNERS[spec["variant"]](spec, meter, tmp)
    seconds = meter.cpu if device.type == "cpu" else meter.wall
    path = path_log.path if spec["variant"] in HF_ACCUM_VARIANTS else "-"
    flops, peak = _model_flops(spec, counting), device_peak_flops(device, torch.float32)
    return RunResult(seconds, meter.wall, meter.peak, counting.real, counting.positions, counting.targets, path,
                     flops, flops / seconds / peak.flops if peak.flops and seconds > 0 else None, peak.describe())


def _model_flops(spec: dict, counting: _Counting) -> float:
    """The epoch's model FLOPs, from the model's shapes (built on the meta device: no memory, no time)."""
    from hf_accum.measure.utilization import ModelFlops

    with torch.device("meta"):
        model, _ = llama_with_lora(word_tokenizer(spec["vocab_size"]), spec["hidden_size"], spec["layers"],
                                   spec["seed"], spec["lora_r"], wrap=True)
    return ModelFlops.of(model).update_flops(counting.real, counting.targets, counting.squared_lengths)


# ----------------------------------------------------------------------------------------------
# The section: rounds of runs, ratios within a round
# ----------------------------------------------------------------------------------------------


@dataclass
class SftRow:
    vocab_size: int
    runs: dict[str, list[RunResult]]
    """Per front-end, one run per round."""

    def rates(self, name: str) -> list[float]:
        return [r.real_tokens / r.seconds for r in self.runs[name]]

    def ratios(self, name: str, baseline: str, what: str) -> list[float] | None:
        """Per round: ``name`` / ``baseline`` real tokens/s (``what='speed'``) or peak memory; None when either
        did not run."""
        if name not in self.runs or baseline not in self.runs:
            return None
        if what == "speed":
            return [a / b for a, b in zip(self.rates(name), self.rates(baseline))]
        return [a.peak_bytes / b.peak_bytes for a, b in zip(self.runs[name], self.runs[baseline])]

    def path(self, name: str) -> str:
        return "/".join(sorted({r.path for r in self.runs[name]}))

    def median_mfu(self, name: str) -> float | None:
        measured = [r.mfu for r in self.runs[name] if r.mfu is not None]
        return statistics.median(measured) if measured else None


@dataclass
class SftResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("ratios",)

    model: str
    data: str
    device: str
    clock: str
    rounds: int
    rows: list[SftRow] = field(default_factory=list)

    @property
    def ratios(self) -> dict:
        """{vocab: {front-end: {baseline: {"tokens_per_s": [...], "memory": [...]}}}} (per-round ratios)."""
        out = {}
        for row in self.rows:
            out[str(row.vocab_size)] = {
                name: {base: {"tokens_per_s": row.ratios(name, base, "speed"),
                              "memory": row.ratios(name, base, "memory")}
                       for base in BASELINES if base in row.runs}
                for name in row.runs
            }
        return out

    def text(self) -> str:
        memory = "peak RSS increment" if self.device == "cpu" else "peak CUDA allocation increment"
        lines = [
            f"\nSFT with LoRA: {self.model}; {self.data}",
            f"  real tokens/s by {self.clock} time, memory = {memory} during train(); each run in its own process; "
            f"ratios: median (min-max) over {self.rounds} rounds, taken within a round",
        ]
        for row in self.rows:
            lines += self._table(row)
        peaks = {r.peak for row in self.rows for runs in row.runs.values() for r in runs if r.peak}
        lines += [f"  MFU: model FLOPs (hf_accum.measure.utilization) / {self.clock} time / {', '.join(sorted(peaks))}"]
        return "\n".join(lines)

    def _table(self, row: SftRow) -> list[str]:
        bases = [b for b in BASELINES if b in row.runs]
        head = "".join(f" {'/ ' + BASELINES[b]:>22}" for b in bases)
        first = next(iter(row.runs.values()))[0]
        lines = [f"  vocab {row.vocab_size} ({first.real_tokens} real tokens, {first.targets} targets per epoch):"]
        seen = {name: runs[0].real_tokens for name, runs in row.runs.items()}
        if len(set(seen.values())) > 1:  # a front-end dropped or truncated rows: say so next to its rate
            lines.append(f"    real tokens differ between front-ends: {seen}")
        for what, unit in (("speed", "real tokens/s"), ("memory", "peak memory")):
            mfu_head = f" {'MFU':>6}" if what == "speed" else ""
            lines.append(f"    {'front-end':<36} {'path':<7} {unit:>14}{mfu_head}{head}")
            for name, runs in row.runs.items():
                mfu = f" {percent(row.median_mfu(name)):>6}"
                value = (f"{statistics.median(row.rates(name)):14.0f}{mfu}" if what == "speed"
                         else f"{mib(int(statistics.median(r.peak_bytes for r in runs))):>14}")
                cells = "".join(f" {_spread(row.ratios(name, b, what)):>22}" for b in bases)
                lines.append(f"    {VARIANTS[name]:<36} {row.path(name):<7} {value}{cells}")
        return lines

    def summary(self) -> list[dict]:
        out = []
        for row in self.rows:
            for ours, base, speed, memory in TARGETS:
                if ours not in row.runs or base not in row.runs:
                    continue
                checks, measured, thresholds = [], [], []
                if speed is not None:
                    ratios = row.ratios(ours, base, "speed")
                    checks.append(judge(median_interval(ratios), speed))
                    measured.append(f"tokens/s {_spread(ratios)}")
                    thresholds.append(f"tokens/s >= {speed:.2f}")
                ratios = row.ratios(ours, base, "memory")
                checks.append(judge(median_interval(ratios), memory, at_least=False))
                measured.append(f"memory {_spread(ratios)}")
                measured.append(f"MFU {percent(row.median_mfu(ours))} vs {percent(row.median_mfu(base))}")
                thresholds.append(f"memory <= {memory:.2f}")
                judged = row.vocab_size >= JUDGED_FROM_VOCAB
                out.append(summary_row(f"sft vocab {row.vocab_size}: {VARIANTS[ours]} / {VARIANTS[base]}",
                                       ", ".join(measured), ", ".join(thresholds),
                                       _verdict(checks) if judged else "n/a (small)"))
        return out


def _spread(ratios: list[float] | None) -> str:
    if ratios is None:
        return "-"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _verdict(checks: list[bool | None]) -> str:
    if any(c is False for c in checks):
        return "FAIL"
    return "PASS" if all(checks) else "INCONCLUSIVE"


def _spec(common: BenchOptions, options: Options, variant: str, vocab_size: int) -> dict:
    return dict(
        variant=variant, vocab_size=vocab_size, rows=options.sft_rows, prompt_words=options.sft_prompt_words,
        completion_words=options.sft_completion_words, max_words=options.sft_max_words,
        micro_batch=options.sft_micro_batch, accumulation=options.sft_accumulation, hidden_size=options.sft_hidden_size,
        packing_rows=options.sft_packing_rows, packing_length=options.sft_packing_length,
        layers=options.sft_layers, lora_r=options.sft_lora_r, gradient_checkpointing=options.sft_gradient_checkpointing,
        seed=common.seed, device=common.device, threads=common.threads,
    )


def measure(bench: Bench, options: Options) -> SftResult:
    common = bench.options
    names = list(dict.fromkeys(options.sft_variants))
    result = SftResult(
        f"Llama ({options.sft_layers} layers, hidden {options.sft_hidden_size}, untied head), fp32, LoRA r="
        f"{options.sft_lora_r} on q/v" + (", gradient checkpointing" if options.sft_gradient_checkpointing else ""),
        f"{options.sft_rows} prompt/completion rows (log-normal lengths, medians {options.sft_prompt_words}/"
        f"{options.sft_completion_words} tokens, at most {options.sft_max_words} each; loss on the completion), "
        f"micro-batch {options.sft_micro_batch} x K={options.sft_accumulation}, one epoch; packing: "
        f"{options.sft_packing_rows} packed row(s) of "
        f"{f'{options.sft_packing_length} tokens' if options.sft_packing_length else 'the longest example'} "
        "per micro-batch",
        common.device, bench.clock, options.sft_rounds,
    )
    workers = Workers(common.threads, preload=["benchmarks.sft", "trl", "peft"])
    try:
        with bench.progress(len(options.sft_vocab_sizes) * options.sft_rounds * len(names), "sft runs") as bar:
            for vocab_size in options.sft_vocab_sizes:
                runs: dict[str, list[RunResult]] = {name: [] for name in names}
                for round_index in range(options.sft_rounds):
                    shift = round_index % len(names)  # rotate: no front-end keeps a fixed place in the order
                    for name in names[shift:] + names[:shift]:
                        spec = _spec(common, options, name, vocab_size)
                        what = f"sft run {name} at vocab {vocab_size}"
                        measured = workers.call("benchmarks.sft:run_here", spec, what)
                        runs[name].append(RunResult(**measured))
                        bar.update(1)
                result.rows.append(SftRow(vocab_size, runs))
    finally:
        workers.close()
    return result
