"""The benchmark run: parse and validate the options, run the chosen sections in order, print their
tables and the summary, write ``bench.json`` (and the sweep's PNG)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from benchmarks.harness import Bench
from benchmarks.options import SECTIONS, BenchOptions, as_config, parse, validate
from benchmarks.report import BenchError, BenchReport, environment, summary_table, write_outputs


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks") -> int:
    """Exit status: 0 after a complete run, 1 with ``--strict`` when a target FAILs, 2 for a setting that
    cannot run (said in one line on stderr, nothing written)."""
    common, per_section = parse(argv, prog)
    try:
        report = run(common, per_section)
    except BenchError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 1 if common.strict and report.failed else 0


def run(common: BenchOptions, per_section: dict[str, Any], echo: Callable[[str], None] = print) -> BenchReport:
    validate(common, per_section)
    if common.threads is not None:
        torch.set_num_threads(common.threads)
    report = BenchReport(as_config(common, per_section), environment(common.device))
    env = report.environment
    echo(f"benchmarks: {', '.join(common.sections)} on {env['device']} ({env['device_name']}, {env['threads']} torch "
         f"threads, torch {env['torch']}, load average {env['load_average_1min']:.2f})")
    bench = Bench(common, echo)
    for name in common.sections:
        result = SECTIONS[name].measure(bench, per_section[name])
        report.results[name] = result
        echo(result.text())
    report.model = bench.loaded_model
    echo(summary_table(report))
    for path in write_outputs(report, Path(common.output_dir)):
        echo(f"wrote {path}")
    return report
