"""Section ``loss``: the loss step at a large vocabulary.

:func:`hf_accum.losses.token_loss.token_loss_sum` (chunked) vs plain ``F.cross_entropy(logits.float())`` on one
row of bf16 logits; the largest single allocation tells whether the full fp32 logits were
materialized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from transformers.hf_argparser import HfArg

from benchmarks.harness import Bench, measure_memory
from benchmarks.report import BenchError, SectionResult, mib, require_positive, summary_row, verdict
from hf_accum.losses.token_loss import IGNORE_INDEX, aligned_targets, rows_per_chunk, token_loss_sum

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions


@dataclass
class Options:
    _argument_group_name = "loss section"

    loss_vocab: int = HfArg(default=32768, help="vocabulary of the random bf16 logits")
    loss_tokens: int = HfArg(default=8192, help="positions in the loss step; above loss.DEFAULT_CHUNK_BYTES of "
                                                "fp32 logits it runs in chunks")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(loss_vocab=options.loss_vocab)
    if options.loss_tokens < 2:
        raise BenchError(f"loss_tokens={options.loss_tokens} must be at least 2")


@dataclass
class LossResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ("ratio", "passed")

    vocab_size: int
    targets: int
    chunk_targets: int
    logits_dtype: str
    fp32_logits_bytes: int
    chunked_peak_bytes: int
    plain_peak_bytes: int
    chunked_largest_allocation: int | None
    plain_largest_allocation: int | None

    @property
    def ratio(self) -> float:
        return self.chunked_peak_bytes / self.plain_peak_bytes

    @property
    def passed(self) -> bool | None:
        """True when no single allocation of the chunked step is as large as the full fp32 logits."""
        if self.chunked_largest_allocation is None:
            return None
        return self.chunked_largest_allocation < self.fp32_logits_bytes

    def text(self) -> str:
        return (
            f"\nLoss step, {self.logits_dtype} logits, vocab {self.vocab_size}, {self.targets} targets (chunks of "
            f"{self.chunk_targets}); full fp32 logits would be {mib(self.fp32_logits_bytes)}\n"
            f"  token_loss_sum (chunked): peak extra {mib(self.chunked_peak_bytes)}, largest allocation "
            f"{_largest(self.chunked_largest_allocation)}\n"
            f"  F.cross_entropy(logits.float()): peak extra {mib(self.plain_peak_bytes)}, largest allocation "
            f"{_largest(self.plain_largest_allocation)}"
        )

    def summary(self) -> list[dict]:
        return [summary_row(
            f"loss step, vocab {self.vocab_size} x {self.targets} targets: no full fp32 logits",
            f"largest allocation {_largest(self.chunked_largest_allocation)} vs fp32 logits "
            f"{mib(self.fp32_logits_bytes)}; peak extra chunked/plain {self.ratio:.3f}",
            "largest < fp32 logits", verdict(self.passed),
        )]


def _largest(n: int | None) -> str:
    return "n/a" if n is None else mib(n)


def measure(bench: Bench, options: Options) -> LossResult:
    """Peak extra memory of the loss step (forward + backward) on one row of bf16 logits."""
    device = bench.device
    vocab, n = options.loss_vocab, options.loss_tokens
    generator = torch.Generator().manual_seed(bench.options.seed)
    labels = torch.randint(0, vocab, (1, n), generator=generator).to(device)
    logits = torch.randn(1, n, vocab, generator=generator, dtype=torch.bfloat16).to(device).requires_grad_()

    def chunked():
        return token_loss_sum(logits, labels)[0]

    def plain():
        # What a stock causal-LM loss does: upcast the whole logits tensor, then cross-entropy.
        targets = aligned_targets(labels).reshape(-1)
        return F.cross_entropy(logits.float().reshape(-1, vocab), targets, ignore_index=IGNORE_INDEX, reduction="sum")

    readings = {}
    with bench.progress(2, "loss memory") as bar:
        for name, fn in (("chunked", chunked), ("plain", plain)):
            with measure_memory(device) as reading:
                fn().backward()
                logits.grad = None  # freed inside the window: both variants allocate and free it alike
            readings[name] = reading
            bar.update(1)
    return LossResult(
        vocab, n - 1, rows_per_chunk(vocab, torch.bfloat16), "bfloat16", (n - 1) * vocab * 4,
        readings["chunked"].peak_bytes, readings["plain"].peak_bytes,
        readings["chunked"].largest_allocation, readings["plain"].largest_allocation,
    )
