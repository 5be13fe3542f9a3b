"""Section ``compile``: tokens/s of the loop with ``LoopConfig(compile=True)`` against the same loop eager.

SmolLM2-135M's dimensions (hidden 576, 9 heads / 3 kv heads, intermediate 1536, vocabulary 49152, tied head;
``--compile-layers`` of its 30 layers), random init from config, LoRA r=16 on every linear layer of the blocks,
micro-batches of 4 rows x 256 tokens. Per dtype, three models with the same weights run in interleaved rounds:
eager, compiled with a static length (``compile_dynamic=False``) and compiled with a dynamic length
(``compile_dynamic=True``: what variable lengths settle on). Each round times one :func:`hf_accum.loop.train` of
``--compile-updates`` updates per model, in rotating order; the reported ratios are per round (compiled / eager
tokens/s by the bench clock), with their median and ~95% interval. The first compiled run of each model holds
the compilation: its wall time minus the median steady run is the compile time (not in the rates).
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers.hf_argparser import HfArg

from benchmarks.harness import Bench, bench_scenario, loop_config, prepare_loop, timed
from benchmarks.report import SectionResult, median_interval, require_positive, summary_row
from hf_accum.batching import PaddingCollator
from hf_accum.testing import random_rows

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARMS = ("eager", "static", "dynamic")


@dataclass
class Options:
    _argument_group_name = "compile section"

    compile_layers: int = HfArg(default=8, help="decoder layers of the SmolLM2-135M-shaped model (the real one: 30)")
    compile_dtypes: list[str] = HfArg(default_factory=lambda: ["float32", "bfloat16"], help="weights dtypes measured")
    compile_updates: int = HfArg(default=2, help="optimizer updates per timed run")
    compile_accumulation: int = HfArg(default=2, help="micro-batches per update")
    compile_micro_batch: int = HfArg(default=4, help="rows per micro-batch")
    compile_length: int = HfArg(default=256, help="tokens per row")
    compile_lora_r: int = HfArg(default=16, help="LoRA rank")
    compile_repeats: int = HfArg(default=5, help="interleaved rounds (eager, static, dynamic) per dtype")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(compile_layers=options.compile_layers, compile_updates=options.compile_updates,
                     compile_accumulation=options.compile_accumulation, compile_micro_batch=options.compile_micro_batch,
                     compile_length=options.compile_length, compile_lora_r=options.compile_lora_r,
                     compile_repeats=options.compile_repeats)
    from benchmarks.report import BenchError

    bad = [dtype for dtype in options.compile_dtypes if dtype not in ("float32", "bfloat16")]
    if bad:
        raise BenchError(f"--compile-dtypes {bad[0]!r}; allowed: float32, bfloat16")


@dataclass
class DtypeResult:
    dtype: str
    tokens_per_run: int
    seconds: dict[str, list[float]]
    """Arm -> steady run times by the bench clock, one per round."""
    compile_seconds: dict[str, float]
    """Compiled arm -> wall seconds its first run took beyond its median steady run."""
    loads: list[float] = field(default_factory=list)
    """1-minute load average before each round."""

    def rate(self, arm: str) -> float:
        return self.tokens_per_run / statistics.median(self.seconds[arm])

    def ratios(self, arm: str) -> list[float]:
        return [eager / compiled for eager, compiled in zip(self.seconds["eager"], self.seconds[arm])]


@dataclass
class CompileResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ()

    model: str
    clock: str
    results: list[DtypeResult]

    def text(self) -> str:
        lines = [f"\ntorch.compile (LoopConfig(compile=True)), {self.model}; tokens/s by {self.clock} time:"]
        for result in self.results:
            lines.append(f"  {result.dtype}: eager {result.rate('eager'):.0f} tok/s; load average "
                         f"{min(result.loads):.1f}-{max(result.loads):.1f}")
            for arm in ARMS[1:]:
                ratios = result.ratios(arm)
                low, high = median_interval(ratios)
                lines.append(
                    f"    compiled {arm:7s} {result.rate(arm):.0f} tok/s: x{statistics.median(ratios):.3f} of eager "
                    f"(~95% interval {low:.3f}-{high:.3f}; per round {', '.join(f'{r:.3f}' for r in ratios)}); "
                    f"compile {result.compile_seconds[arm]:.0f} s wall")
        return "\n".join(lines)

    def summary(self) -> list[dict]:
        rows = []
        for result in self.results:
            ratios = result.ratios("static")
            low, high = median_interval(ratios)
            rows.append(summary_row(f"torch.compile: tokens/s compiled / eager ({result.dtype})",
                                    f"{statistics.median(ratios):.3f} (~95% interval {low:.3f}-{high:.3f})",
                                    "measured", "INFO"))
        return rows


def smollm2_lora(layers: int, dtype: torch.dtype, r: int, seed: int) -> torch.nn.Module:
    """SmolLM2-135M's shape with ``layers`` layers, random init, LoRA ``r`` on every block linear layer."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **SMOLLM2_135M)).to(dtype)
    lora = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LORA_TARGETS)
    return get_peft_model(model, lora)


def run_once(model: torch.nn.Module, examples: list, options: Options, arm: str, device: torch.device) -> Any:
    """One timed :func:`hf_accum.loop.train` of ``model`` (compiled in place on its first compiled run)."""
    from hf_accum.loop import train

    scenario = bench_scenario(f"compile-{arm}", lambda: model, examples, PaddingCollator(0),
                              options.compile_micro_batch, options.compile_accumulation)
    if arm != "eager":
        scenario.loop_kwargs = {"compile": True, "compile_dynamic": arm == "dynamic"}
    prepared, optimizer, loader, accelerator = prepare_loop(scenario, device)
    config = loop_config(scenario)
    config.max_steps = options.compile_updates
    with timed(device) as timing:
        train(prepared, optimizer, loader, accelerator, config)
    return timing


def measure_dtype(bench: Bench, options: Options, dtype: str) -> DtypeResult:
    common = bench.options
    base = smollm2_lora(options.compile_layers, getattr(torch, dtype), options.compile_lora_r, common.seed)
    models = {arm: copy.deepcopy(base) if arm != "eager" else base for arm in ARMS}
    rows = options.compile_updates * options.compile_accumulation * options.compile_micro_batch
    examples = random_rows(rows, seed=common.seed + 5, min_len=options.compile_length, max_len=options.compile_length,
                           vocab_size=SMOLLM2_135M["vocab_size"], pad_token_id=0, lowest_id=0)
    first: dict[str, float] = {}
    for arm in ARMS:  # warm-up: the compiled arms compile here (wall time kept)
        start = time.perf_counter()
        run_once(models[arm], examples, options, arm, bench.device)
        first[arm] = time.perf_counter() - start
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    loads = []
    with bench.progress(options.compile_repeats, f"compile rounds ({dtype})") as bar:
        for round_ in range(options.compile_repeats):
            loads.append(_load())
            order = ARMS[round_ % 3:] + ARMS[:round_ % 3]  # rotating: a load drift favours no arm
            for arm in order:
                timing = run_once(models[arm], examples, options, arm, bench.device)
                seconds[arm].append(timing.on(bench.clock))
                walls[arm].append(timing.wall)
            bar.update(1)
    compile_seconds = {arm: first[arm] - statistics.median(walls[arm]) for arm in ARMS[1:]}
    tokens = rows * options.compile_length
    return DtypeResult(dtype, tokens, seconds, compile_seconds, loads)


def _load() -> float:
    import os

    return os.getloadavg()[0]


def measure(bench: Bench, options: Options) -> CompileResult:
    results = [measure_dtype(bench, options, dtype) for dtype in options.compile_dtypes]
    model = (f"SmolLM2-135M dimensions ({options.compile_layers} of 30 layers, random init), LoRA r="
             f"{options.compile_lora_r}, micro-batch {options.compile_micro_batch} x {options.compile_length}, "
             f"K={options.compile_accumulation}, {options.compile_updates} updates per run")
    return CompileResult(model, bench.clock, results)
