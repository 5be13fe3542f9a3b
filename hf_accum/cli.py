"""``hf-accum``: the command line.

* ``hf-accum plan``  -- split a global batch into micro-batch x accumulation x processes (nodes x
  processes per node), with the LR scaling rule stated, and refuse (naming the nearest valid
  values) when it does not divide.
* ``hf-accum check`` -- run a few accumulated updates of a model (the built-in tiny Llama, or a
  local model directory) under :class:`hf_accum.verify.BigBatchAuditor` and report, per update,
  how far the applied gradient is from the big-batch gradient -- for hf_accum's loop and for the
  naive ``loss / K`` loop side by side.
* ``hf-accum bench`` -- measure the accumulation trade-off (tokens/s and peak memory against the
  accumulation steps, table + PNG + JSON) and the DESIGN.md speed/memory targets, with ratios taken
  side by side in one run (:mod:`hf_accum.bench`; ``benchmarks/README.md`` explains each number).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from hf_accum.schedule import BatchPlan, plan_global_batch, scaled_learning_rate


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "config", None):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = unknown  # hf-accum plan --config: the recipe's own overrides (section.key=value)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except ValueError as error:
        print(f"hf-accum {args.command}: error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-accum", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")

    plan = commands.add_parser("plan", help="global batch -> micro-batch x accumulation x processes")
    plan.add_argument("--global-batch-size", type=int, help="sequences per optimizer update")
    plan.add_argument("--micro-batch-size", type=int, help="sequences per forward, per process")
    plan.add_argument("--config", help="take both from a recipe config (followed by the recipe's overrides, "
                      "section.key=value), as recipes/finetune_llama.py would resolve them")
    plan.add_argument("--num-processes", type=int, help="data-parallel processes over all nodes (default: "
                      "--nodes x --gpus-per-node, else 1)")
    plan.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    plan.add_argument("--gpus-per-node", type=int, help="processes (GPUs) per machine")
    plan.add_argument("--learning-rate", type=float, help="LR tuned at --base-batch-size, to rescale")
    plan.add_argument("--base-batch-size", type=int, help="global batch the LR was tuned at")
    plan.add_argument("--lr-scaling", choices=["linear", "sqrt", "none"], default="sqrt",
                      help="LR rule when the global batch changes (sqrt is the usual choice for Adam)")
    plan.set_defaults(run=_run_plan)

    check = commands.add_parser("check", help="verify accumulation == big batch on a model, update by update")
    check.add_argument("--model", default="tiny", help="'tiny' (built-in) or a local model directory")
    check.add_argument("--micro-batch-size", type=int, default=2)
    check.add_argument("--accumulation-steps", type=int, default=4)
    check.add_argument("--examples", type=int, default=22, help="synthetic rows of uneven length")
    check.add_argument("--tolerance", type=float, default=1e-8, help="max relative gradient error to pass")
    check.set_defaults(run=_run_check)

    _add_bench_parser(commands)
    return parser


def _add_bench_parser(commands) -> None:
    from hf_accum.bench import SECTIONS, BenchConfig

    d = BenchConfig()
    bench = commands.add_parser(
        "bench", help="tokens/s and peak memory vs accumulation steps, and the speed/memory targets",
        description="Measure the accumulation trade-off and the DESIGN.md targets; see benchmarks/README.md.",
    )
    bench.add_argument("--model", default=d.model, help="'tiny' (built-in, random init) or a local model directory")
    bench.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    bench.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype, help="weights dtype")
    bench.add_argument("--global-batch-size", type=int, default=d.global_batch_size, help="sequences per update")
    bench.add_argument("--accumulation-steps", type=int, nargs="+", default=list(d.accumulation_steps),
                       help="K values to sweep; each must divide the global batch")
    bench.add_argument("--updates", type=int, default=d.updates, help="timed updates per run")
    bench.add_argument("--repeats", type=int, default=d.repeats, help="sweep runs per K (median reported)")
    bench.add_argument("--min-length", type=int, default=d.min_length, help="shortest random row (tokens)")
    bench.add_argument("--max-length", type=int, default=d.max_length, help="longest random row (tokens)")
    bench.add_argument("--overhead-accumulation", type=int, default=d.overhead_accumulation,
                       help="K of the ours-vs-bare comparison")
    bench.add_argument("--overhead-repeats", type=int, default=d.overhead_repeats, help="interleaved pairs")
    bench.add_argument("--memory-micro-batch", type=int, default=d.memory_micro_batch)
    bench.add_argument("--memory-accumulation", type=int, default=d.memory_accumulation)
    bench.add_argument("--padding-micro-batch", type=int, default=d.padding_micro_batch,
                       help="padding section: sequences per micro-batch (padded rows, or one packed row)")
    bench.add_argument("--padding-accumulation", type=int, default=d.padding_accumulation,
                       help="padding section: accumulation steps")
    bench.add_argument("--padding-updates", type=int, default=d.padding_updates,
                       help="padding section: optimizer updates per Trainer run")
    bench.add_argument("--padding-repeats", type=int, default=d.padding_repeats,
                       help="padding section: interleaved (stock, packed, ours-padded) triples")
    bench.add_argument("--loss-vocab", type=int, default=d.loss_vocab)
    bench.add_argument("--loss-tokens", type=int, default=d.loss_tokens)
    bench.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                       help=f"sections to run (default: all of {', '.join(SECTIONS)})")
    bench.add_argument("--output-dir", default=d.output_dir, help="bench.json and accumulation_tradeoff.png go here")
    bench.add_argument("--seed", type=int, default=d.seed)
    bench.add_argument("--threads", type=int, default=d.threads,
                       help="torch CPU threads (default: torch's); 1 is steadier on a CPU shared with other jobs")
    bench.add_argument("--no-progress", action="store_true", help="no progress bars")
    bench.add_argument("--strict", action="store_true", help="exit 1 when a measured target FAILs")
    bench.set_defaults(run=_run_bench)


def _run_plan(args: argparse.Namespace) -> int:
    processes = _num_processes(args)
    plan = _recipe_plan(args, processes) if args.config else _explicit_plan(args, processes)
    print(plan.describe())
    if args.learning_rate is not None:
        base = args.base_batch_size or plan.global_batch_size
        lr = scaled_learning_rate(args.learning_rate, base, plan.global_batch_size, args.lr_scaling)
        print(f"learning rate {lr:.3e} ({args.lr_scaling} scaling from {args.learning_rate:.3e} at batch {base})")
    return 0


def _explicit_plan(args: argparse.Namespace, processes: int) -> BatchPlan:
    if args.global_batch_size is None or args.micro_batch_size is None:
        raise ValueError("give --global-batch-size and --micro-batch-size, or --config with a recipe config")
    return plan_global_batch(args.global_batch_size, args.micro_batch_size, processes, args.nodes)


def _recipe_plan(args: argparse.Namespace, processes: int) -> BatchPlan:
    """The recipe's batch arithmetic on ``processes``: its micro-batch, and its accumulation derived from
    ``global_batch_size`` (or given as ``training.gradient_accumulation_steps``)."""
    from hf_accum import config as C

    if args.global_batch_size is not None or args.micro_batch_size is not None:
        raise ValueError("--config takes the batch sizes from the recipe config; override them there "
                         "(global_batch_size=..., training.per_device_train_batch_size=...)")
    path, overrides = C.parse_overrides(["--config", args.config, *args.overrides])
    config = C.load_config(path, overrides)
    micro = config.training.get("per_device_train_batch_size", 8)
    if config.global_batch_size is not None:
        return plan_global_batch(config.global_batch_size, micro, processes, args.nodes)
    return BatchPlan(micro, config.training.get("gradient_accumulation_steps", 1), processes, args.nodes)


def _num_processes(args: argparse.Namespace) -> int:
    """All processes of all nodes, from --num-processes or --nodes x --gpus-per-node (both must agree)."""
    if args.gpus_per_node is None:
        return args.num_processes or 1
    if args.gpus_per_node < 1 or args.nodes < 1:
        raise ValueError(f"--nodes {args.nodes} --gpus-per-node {args.gpus_per_node}: both must be >= 1")
    total = args.nodes * args.gpus_per_node
    if args.num_processes is not None and args.num_processes != total:
        raise ValueError(
            f"--num-processes {args.num_processes} != --nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} "
            f"= {total}; give one or the other"
        )
    return total


def _run_check(args: argparse.Namespace) -> int:
    from hf_accum.testing.check import check_model  # heavy imports only for this command

    report = check_model(
        args.model, args.micro_batch_size, args.accumulation_steps, args.examples, tolerance=args.tolerance
    )
    print(report.table())
    print(report.verdict())
    return 0 if report.passed else 1


def _run_bench(args: argparse.Namespace) -> int:
    from hf_accum.bench import BenchConfig, run_bench

    config = BenchConfig(
        model=args.model, device=args.device, dtype=args.dtype, global_batch_size=args.global_batch_size,
        accumulation_steps=tuple(args.accumulation_steps), updates=args.updates, repeats=args.repeats,
        min_length=args.min_length, max_length=args.max_length, overhead_accumulation=args.overhead_accumulation,
        overhead_repeats=args.overhead_repeats, memory_micro_batch=args.memory_micro_batch,
        memory_accumulation=args.memory_accumulation, padding_micro_batch=args.padding_micro_batch,
        padding_accumulation=args.padding_accumulation, padding_updates=args.padding_updates,
        padding_repeats=args.padding_repeats, loss_vocab=args.loss_vocab, loss_tokens=args.loss_tokens,
        sections=tuple(dict.fromkeys(args.only)), output_dir=args.output_dir, seed=args.seed,
        threads=args.threads, disable_tqdm=args.no_progress,
    )
    report = run_bench(config)  # BenchError is a ValueError: main() prints it and exits 2
    return 1 if args.strict and report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
