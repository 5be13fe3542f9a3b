"""Section ``fsdp_fused``: the fused loss under FSDP2 against the logits path, 2 CPU processes (gloo).

Under FSDP2 the fused loss runs inside the output layer's own forward, where FSDP2 has gathered it
(:mod:`hf_accum.fused.head`); before, it turned itself off under FSDP2 and the run took the logits path. Both
variants train the same Llama (``--fsdp-fused-vocab``, default 128256), the same rows and order through
:func:`hf_accum.train` under ``fully_shard`` (decoder layers and the head as units); each variant's peak is the
larger rank's c10 allocator peak during training (:mod:`benchmarks.fsdp_fused_worker`). Rounds alternate the
order. Target (issue "fused loss under FSDP2 and ZeRO-3"): peak memory fused / logits <= 0.5 at vocab >= 128256.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from transformers.hf_argparser import HfArg

from benchmarks.report import BenchError, SectionResult, mib, require_positive, summary_row, verdict
from benchmarks.workers import checkout_root

if TYPE_CHECKING:
    from benchmarks.harness import Bench
    from benchmarks.options import BenchOptions

LARGE_VOCAB = 128256
MEMORY_TARGET = 0.5


@dataclass
class Options:
    _argument_group_name = "fsdp_fused section"

    fsdp_fused_vocab: int = HfArg(default=LARGE_VOCAB, help="vocabulary of the Llama trained under FSDP2")
    fsdp_fused_hidden: int = HfArg(default=256, help="hidden size")
    fsdp_fused_layers: int = HfArg(default=2, help="decoder layers")
    fsdp_fused_length: int = HfArg(default=512, help="tokens per row (every position a target)")
    fsdp_fused_rounds: int = HfArg(default=2, help="rounds, each training both variants (order alternating)")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(fsdp_fused_vocab=options.fsdp_fused_vocab, fsdp_fused_hidden=options.fsdp_fused_hidden,
                     fsdp_fused_layers=options.fsdp_fused_layers, fsdp_fused_length=options.fsdp_fused_length,
                     fsdp_fused_rounds=options.fsdp_fused_rounds)
    if common.device != "cpu":
        raise BenchError("the fsdp_fused section runs 2 CPU processes (gloo); --device cuda is not measured here")
    if options.fsdp_fused_hidden % 4:
        raise BenchError(f"--fsdp-fused-hidden {options.fsdp_fused_hidden} must be a multiple of 4 (4 heads)")


@dataclass
class FsdpFusedResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("memory_ratio", "time_ratio")

    vocab: int
    hidden: int
    layers: int
    length: int
    world_size: int
    fused: list[dict]
    logits: list[dict]

    @property
    def memory_ratio(self) -> float:
        return statistics.median(f["peak_bytes"] / g["peak_bytes"] for f, g in zip(self.fused, self.logits))

    @property
    def time_ratio(self) -> float:
        return statistics.median(f["seconds_per_update"] / g["seconds_per_update"]
                                 for f, g in zip(self.fused, self.logits))

    def text(self) -> str:
        fused = statistics.median(run["peak_bytes"] for run in self.fused)
        logits = statistics.median(run["peak_bytes"] for run in self.logits)
        return (f"FSDP2, {self.world_size} CPU processes, Llama {self.layers} layers, hidden {self.hidden}, vocab "
                f"{self.vocab}, rows of {self.length} tokens\n"
                f"  peak memory (larger rank, median): fused {mib(fused)}, logits path {mib(logits)}, "
                f"fused / logits {self.memory_ratio:.3f}x\n"
                f"  time per update: fused / logits {self.time_ratio:.3f}x")

    def summary(self) -> list[dict]:
        if self.vocab < LARGE_VOCAB:
            return []
        passed = all(f["peak_bytes"] / g["peak_bytes"] <= MEMORY_TARGET for f, g in zip(self.fused, self.logits))
        return [summary_row(f"FSDP2 fused loss peak memory vs logits path (vocab {self.vocab})",
                            f"{self.memory_ratio:.3f}x", f"<= {MEMORY_TARGET}x", verdict(passed))]


def measure(bench: Bench, options: Options) -> FsdpFusedResult:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "fsdp_fused.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                   "-m", "benchmarks.fsdp_fused_worker", str(out),
                   *(str(v) for v in (options.fsdp_fused_vocab, options.fsdp_fused_hidden, options.fsdp_fused_layers,
                                      options.fsdp_fused_length, options.fsdp_fused_rounds))]
        finished = subprocess.run(command, cwd=checkout_root(), capture_output=True, text=True)
        if finished.returncode != 0 or not out.exists():
            raise BenchError(f"the FSDP2 worker failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")
        report = json.loads(out.read_text())
    return FsdpFusedResult(options.fsdp_fused_vocab, options.fsdp_fused_hidden, options.fsdp_fused_layers,
                           options.fsdp_fused_length, report["world_size"], report["fused"], report["logits"])
