"""``hf-accum``: the command line.

* ``hf-accum plan``  -- split a global batch into micro-batch x accumulation x processes, with the
  LR scaling rule stated, and refuse (naming the nearest valid values) when it does not divide.
* ``hf-accum check`` -- run a few accumulated updates of a model (the built-in tiny Llama, or a
  local model directory) under :class:`hf_accum.verify.BigBatchAuditor` and report, per update,
  how far the applied gradient is from the big-batch gradient -- for hf_accum's loop and for the
  naive ``loss / K`` loop side by side.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from hf_accum.schedule import plan_global_batch, scaled_learning_rate


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
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
    plan.add_argument("--global-batch-size", type=int, required=True, help="sequences per optimizer update")
    plan.add_argument("--micro-batch-size", type=int, required=True, help="sequences per forward, per process")
    plan.add_argument("--num-processes", type=int, default=1, help="data-parallel processes (GPUs x nodes)")
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
    return parser


def _run_plan(args: argparse.Namespace) -> int:
    plan = plan_global_batch(args.global_batch_size, args.micro_batch_size, args.num_processes)
    print(plan.describe())
    if args.learning_rate is not None:
        base = args.base_batch_size or plan.global_batch_size
        lr = scaled_learning_rate(args.learning_rate, base, plan.global_batch_size, args.lr_scaling)
        print(f"learning rate {lr:.3e} ({args.lr_scaling} scaling from {args.learning_rate:.3e} at batch {base})")
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from hf_accum.checking import check_model  # heavy imports only for this command

    report = check_model(
        args.model, args.micro_batch_size, args.accumulation_steps, args.examples, tolerance=args.tolerance
    )
    print(report.table())
    print(report.verdict())
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
