"""What can be asked of the benchmarks: the sections (one table) and every option, written once.

Each option is a dataclass field with its help text; :class:`transformers.HfArgumentParser` turns the
fields into command-line flags (``--global-batch-size`` and ``--global_batch_size`` alike; lists take
several values; ``Literal`` fields and ``choices`` metadata list the allowed values; a bool field is
a flag). The options every section shares are :class:`BenchOptions`; each section module owns the
options only it reads (its ``Options`` dataclass, shown as its own group in ``--help``).

Adding a section: write ``benchmarks/<name>.py`` with ``Options`` (a dataclass, may be empty),
``validate(bench_options, options)`` (raise :class:`~benchmarks.report.BenchError`) and
``measure(bench, options) -> SectionResult``, then add it to :data:`SECTIONS`.
"""

from __future__ import annotations

import sys

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from transformers import HfArgumentParser
from transformers.hf_argparser import HfArg

from benchmarks import (
    dpo, fsdp_fused, grpo, loss, loss_limit, memory, noise_scale, overhead, padding, rampup_auto, real_model, sft, softcap, sweep, token_budget,
    vocab,
)
from benchmarks import compile as torch_compile
from benchmarks.report import BenchError, require_positive

SECTIONS = {
    "sweep": sweep,
    "overhead": overhead,
    "noise_scale": noise_scale,
    "memory": memory,
    "padding": padding,
    "loss": loss,
    "vocab": vocab,
    "softcap": softcap,
    "sft": sft,
    "dpo": dpo,
    "grpo": grpo,
    "token_budget": token_budget,
    "fsdp_fused": fsdp_fused,
    "rampup-auto": rampup_auto,
    "real-model": real_model,
    "compile": torch_compile,
    "loss-limit": loss_limit,
}
OPT_IN = ("real-model",)
"""Sections run only when named with --only (real pretrained models: minutes, packages of their own)."""


@dataclass
class BenchOptions:
    """Options every section shares."""

    _argument_group_name = "common options"

    model: str = HfArg(default="tiny", help="'tiny' (a Llama built from config, random init) or a local model "
                                            "directory (sweep, overhead, memory, padding)")
    device: Literal["cpu", "cuda"] = HfArg(default="cpu", help="where to run")
    dtype: Literal["float32", "bfloat16"] = HfArg(
        default="float32", help="weights dtype (bf16 weights use the loop's fp32 gradient accumulation)")
    global_batch_size: int = HfArg(default=16, help="sequences per optimizer update (sweep, overhead)")
    updates: int = HfArg(default=2, help="timed optimizer updates per run (sweep, overhead)")
    min_length: int = HfArg(default=16, help="shortest random row in tokens (sweep, overhead, padding)")
    max_length: int = HfArg(default=256, help="longest random row in tokens (sweep, overhead, padding; every "
                                              "row of the memory section has this length)")
    sections: list[str] = HfArg(
        default_factory=lambda: [name for name in SECTIONS if name not in OPT_IN], aliases=["--only"],
        metadata={"choices": list(SECTIONS), "metavar": "SECTION"},
        help=f"sections to run (default: all but {', '.join(OPT_IN)}, which run only when named)")
    output_dir: str = HfArg(default="bench_out", help="bench.json (and the sweep's PNG) go here")
    seed: int = HfArg(default=0, help="seed of the weights and the random rows")
    threads: int | None = HfArg(
        default=None, help="torch CPU threads (default: torch's); 1 is far steadier on a CPU shared with other "
                           "jobs: a busy core stalls every multi-threaded op at its barrier")
    no_progress: bool = HfArg(default=False, help="no progress bars")
    strict: bool = HfArg(default=False, help="exit 1 when a measured target FAILs")


def parse(argv: Sequence[str] | None, prog: str) -> tuple[BenchOptions, dict[str, Any]]:
    """(common options, {section: its options}) from the command line; argparse errors exit 2."""
    parser = HfArgumentParser(
        [BenchOptions, *(section.Options for section in SECTIONS.values())], prog=prog,
        description="Speed and memory of exact gradient accumulation, measured side by side "
                    "(benchmarks/README.md explains every number).",
    )
    common, *per_section, unknown = parser.parse_args_into_dataclasses(
        args=_split_section_lists(argv), look_for_args_file=False, return_remaining_strings=True)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    common.sections = list(dict.fromkeys(common.sections))  # --only loss loss runs it once
    return common, dict(zip(SECTIONS, per_section))


def _split_section_lists(argv: Sequence[str] | None) -> list[str]:
    """``--only dpo,grpo`` as ``--only dpo grpo``: the values after ``--only`` / ``--sections`` split at commas
    (each name is still checked against the sections by argparse)."""
    args = list(sys.argv[1:] if argv is None else argv)
    split: list[str] = []
    in_sections = False
    for arg in args:
        if arg.startswith("-"):
            in_sections = arg in ("--only", "--sections")
            split.append(arg)
        elif in_sections:
            split += [name for name in arg.split(",") if name]
        else:
            split.append(arg)
    return split


def validate(common: BenchOptions, per_section: dict[str, Any]) -> None:
    """Raise :class:`BenchError` naming the valid values for anything that cannot run, before
    anything is measured or written."""
    require_positive(global_batch_size=common.global_batch_size, updates=common.updates)
    if not 2 <= common.min_length <= common.max_length:
        raise BenchError(f"need 2 <= min_length <= max_length, got {common.min_length} and {common.max_length}")
    if common.threads is not None and common.threads < 1:
        raise BenchError(f"threads={common.threads} must be at least 1")
    if common.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("device='cuda' but torch.cuda.is_available() is False; use --device cpu")
    if common.model != "tiny" and not Path(common.model).is_dir():
        raise BenchError(f"model={common.model!r} is neither 'tiny' nor a local model directory")
    if Path(common.output_dir).exists() and not Path(common.output_dir).is_dir():
        raise BenchError(f"output_dir={common.output_dir!r} exists and is not a directory")
    for name in common.sections:
        SECTIONS[name].validate(common, per_section[name])


def as_config(common: BenchOptions, per_section: dict[str, Any]) -> dict:
    """Every option of the run, flat, as written to bench.json."""
    values = asdict(common)
    for options in per_section.values():
        values.update(asdict(options))
    return values
