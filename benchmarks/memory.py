"""Section ``memory``: peak memory of one update of K micro-batches of size b vs one micro-batch of
size b (target: ratio <= 1.05)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from transformers.hf_argparser import HfArg

from benchmarks.harness import MEMORY_UPDATES, Bench, token_rows, training_memory
from benchmarks.report import SectionResult, mib, require_positive, summary_row, verdict

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

TARGET = 1.05  # K micro-batches of b vs one micro-batch of b: "within 5%"


@dataclass
class Options:
    _argument_group_name = "memory section"

    memory_micro_batch: int = HfArg(default=2, help="b: rows per micro-batch (each of --max-length tokens)")
    memory_accumulation: int = HfArg(default=8, help="K micro-batches per update, compared with K=1")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(memory_micro_batch=options.memory_micro_batch, memory_accumulation=options.memory_accumulation)


@dataclass
class MemoryResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("ratio", "passed", "excess_in_gradients")

    micro_batch: int
    accumulation_steps: int
    sequence_length: int
    single_bytes: int
    accumulated_bytes: int
    gradient_bytes: int
    """Bytes of one full set of gradients in the weights' dtype (what accumulation must keep)."""

    @property
    def ratio(self) -> float:
        return self.accumulated_bytes / self.single_bytes

    @property
    def excess_in_gradients(self) -> float:
        """(accumulated - single) in units of ``gradient_bytes``."""
        return (self.accumulated_bytes - self.single_bytes) / self.gradient_bytes

    @property
    def passed(self) -> bool:
        return self.ratio <= TARGET

    def text(self) -> str:
        return (
            f"\nMemory of accumulation ({self.sequence_length}-token rows, peak over {MEMORY_UPDATES} updates): "
            f"{self.accumulation_steps} micro-batches of {self.micro_batch} per update: "
            f"{mib(self.accumulated_bytes)}; one micro-batch of {self.micro_batch} per update: "
            f"{mib(self.single_bytes)}; ratio {self.ratio:.3f}\n  excess "
            f"{mib(self.accumulated_bytes - self.single_bytes)} = {self.excess_in_gradients:.2f} x the gradient "
            f"bytes ({mib(self.gradient_bytes)}): the window's gradients stay allocated through every later "
            f"forward, while a lone micro-batch (zero_grad(set_to_none=True)) has none during its forward"
        )

    def summary(self) -> list[dict]:
        return [summary_row(
            f"memory: {self.accumulation_steps} micro-batches of {self.micro_batch} vs 1 of {self.micro_batch}",
            f"{self.ratio:.3f} ({mib(self.accumulated_bytes)} vs {mib(self.single_bytes)}; excess = "
            f"{self.excess_in_gradients:.2f} x gradient bytes)",
            f"<= {TARGET:.2f}", verdict(self.passed),
        )]


def measure(bench: Bench, options: Options) -> MemoryResult:
    """One update of K micro-batches of b rows vs one update of one micro-batch of b rows.

    Every row has ``max_length`` tokens so that all micro-batches have the same shape: the
    comparison then isolates what accumulating costs, not what a longer row costs.
    """
    common, work = bench.options, bench.workload
    b, k = options.memory_micro_batch, options.memory_accumulation
    rows = token_rows(work, MEMORY_UPDATES * b * k, common.seed + 2, common.max_length, common.max_length)
    with bench.progress(2, "memory runs") as bar:
        single = training_memory(work, rows[: MEMORY_UPDATES * b], b, 1)
        bar.update(1)
        accumulated = training_memory(work, rows, b, k)
        bar.update(1)
    gradient_bytes = sum(p.numel() * p.element_size() for p in work.model.parameters() if p.requires_grad)
    return MemoryResult(b, k, common.max_length, single.peak_bytes, accumulated.peak_bytes, gradient_bytes)
