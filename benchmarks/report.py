"""What every section shares to report its numbers: statistics of interleaved ratios, verdicts,
the section-result interface, the summary table and the files written.

A section's result is a :class:`SectionResult`: it prints itself (:meth:`~SectionResult.text`), says
which targets it measured (:meth:`~SectionResult.summary`), serializes itself for ``bench.json``
(:meth:`~SectionResult.as_dict`) and may write extra files (:meth:`~SectionResult.write`, e.g. the
sweep's PNG).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import torch

MiB = 2**20

MEMORY_MEANING = {
    "cpu": "parameter bytes + peak bytes held by tensors allocated during 2 updates "
           "(torch.profiler memory events of the c10 CPU allocator; no caching, no Python objects)",
    "cuda": "parameter bytes + (torch.cuda.max_memory_allocated - memory_allocated when 2 updates start)",
}


class BenchError(ValueError):
    """A benchmark setting that cannot be run; raised before anything is measured or written."""


def require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise BenchError(f"{name}={value} must be at least 1")


def mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def percent(value: float | None) -> str:
    """An MFU (or any fraction) as ``12.3%``; ``n/a`` when unknown."""
    return "n/a" if value is None else f"{value:.1%}"


def median_mfu(values: Iterable[float | None]) -> float | None:
    """The median of the known MFUs among ``values`` (one per run); None when none is known."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def mfu_meaning(peaks: Iterable[str], time: str = "wall") -> str:
    """The line under a table with an MFU column: what it divides (``peaks``: each run's
    :meth:`hf_accum.measure.peak_flops.PeakFlops.describe`, printed once each)."""
    return f"MFU: model FLOPs (hf_accum.measure.utilization) / {time} time / {', '.join(sorted(set(peaks))) or 'no peak'}"


# ----------------------------------------------------------------------------------------------
# Statistics of interleaved ratios
# ----------------------------------------------------------------------------------------------


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """Distribution-free ~95% confidence interval of the median (order statistics, normal
    approximation of the binomial): no assumption about how other jobs disturb the timings.
    With 5 values or fewer it is their min..max."""
    ordered = sorted(values)
    n = len(ordered)
    half = 0.98 * math.sqrt(n)  # 1.96 * sqrt(n) / 2
    low = max(0, math.floor(n / 2 - half) - 1)
    high = min(n - 1, math.ceil(n / 2 + 1 + half) - 1)
    return ordered[low], ordered[high]


def judge(interval: tuple[float, float], target: float, at_least: bool = True) -> bool | None:
    """True/False when the whole ~95% interval of the median is on one side of ``target``
    (``>= target`` when ``at_least``, else ``<= target``); None (inconclusive) when the machine's
    noise is larger than the margin."""
    low, high = interval
    if at_least:
        return True if low >= target else False if high < target else None
    return True if high <= target else False if low > target else None


def verdict(passed: bool | None, unknown: str = "UNMEASURED") -> str:
    return unknown if passed is None else ("PASS" if passed else "FAIL")


def summary_row(target: str, measured: str, threshold: str, verdict_text: str) -> dict:
    """One line of the summary: what was measured, the value, the threshold and the verdict."""
    return dict(target=target, measured=measured, threshold=threshold, verdict=verdict_text)


# ----------------------------------------------------------------------------------------------
# Section results and the report
# ----------------------------------------------------------------------------------------------


@dataclass
class SectionResult:
    """Base of every section's result (a dataclass holding the measured numbers)."""

    DERIVED: ClassVar[tuple[str, ...]] = ()
    """Properties written to bench.json next to the dataclass fields."""

    def text(self) -> str:
        raise NotImplementedError

    def summary(self) -> list[dict]:
        """One :func:`summary_row` per target this section measured (none by default)."""
        return []

    def as_dict(self) -> dict:
        return {**asdict(self), **{name: getattr(self, name) for name in self.DERIVED}}

    def write(self, output_dir: Path) -> list[Path]:
        """Files besides bench.json (none by default)."""
        return []


@dataclass
class BenchReport:
    options: dict
    """Every option of the run (common and per-section), as parsed."""
    environment: dict
    model: str = ""
    results: dict[str, SectionResult] = field(default_factory=dict)

    def summary(self) -> list[dict]:
        return [row for result in self.results.values() for row in result.summary()]

    @property
    def failed(self) -> bool:
        return any(row["verdict"] == "FAIL" for row in self.summary())

    def as_dict(self) -> dict:
        return dict(
            config=self.options, environment=self.environment, model=self.model,
            memory_measured=MEMORY_MEANING[self.environment["device"]],
            sections={name: result.as_dict() for name, result in self.results.items()},
            summary=self.summary(),
        )


def environment(device: str) -> dict[str, Any]:
    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    return dict(
        device=device, device_name=name, torch=torch.__version__, threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(), python=platform.python_version(),
        load_average_1min=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    )


def summary_table(report: BenchReport) -> str:
    rows = report.summary()
    if not rows:
        return "\nSummary: no target measured"
    width = max(len(r["target"]) for r in rows)
    lines = ["\nSummary (one line per target measured; benchmarks/README.md states each target)"]
    for r in rows:
        lines.append(f"  {r['target']:<{width}}  {r['verdict']:<12} {r['measured']}  [target {r['threshold']}]")
    return "\n".join(lines)


def write_outputs(report: BenchReport, output_dir: Path) -> list[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / "bench.json"
    json_path.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    paths = [json_path]
    for result in report.results.values():
        paths.extend(result.write(output_dir))
    return paths
