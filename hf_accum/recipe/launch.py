"""Launch policy of the recipe: what the launcher and the config ask for, checked against what would
really run; DeepSpeed config files; the loop engine's Accelerator.

A run that asks for FSDP or DeepSpeed and silently gets something else (plain DDP, one process)
is found out on the cluster, by an out-of-memory error or by an effective batch W times too small.
The recipe therefore calls, in this order:

1. :func:`check_launch` -- before loading any model (then :func:`start_process_group` sets up the
   process group, and DeepSpeed's comm on it, before anything else can, and checks it spans every
   process): from the training section
   (``TrainingArguments`` fields: ``deepspeed``, ``fsdp``, ``use_cpu``, the batch arithmetic) and
   the launcher's environment, returns the :class:`Launch` that will run, or raises
   :class:`LaunchError` naming what was asked, what would run instead, and a command that works;
2. engine ``loop``: :func:`loop_accelerator` builds the ``Accelerator`` (under DeepSpeed with the
   config's ``"auto"`` values filled from the recipe, and around two Accelerate traps on CPU);
   :func:`check_offload_optimizer` before ``prepare`` (ZeRO-Offload swaps the optimizer);
   engine ``trainer`` passes ``training.deepspeed`` to ``TrainingArguments`` unchanged (under ZeRO-3
   transformers then partitions the model as it loads);
3. :func:`check_engine` -- once the ``Accelerator`` (``trainer.accelerator`` for the Trainer)
   exists: the distributed type and process count it really got (``loop_accelerator`` calls it).

Saving under ZeRO-3 (every rank gathers) and the node layout are library helpers:
:mod:`hf_accum.distributed`.

The DeepSpeed JSON files in ``recipes/deepspeed/`` leave the batch keys ``"auto"``: the recipe
states the batch arithmetic once and Trainer/Accelerate fill them in. :func:`load_deepspeed_config`
refuses a config that would contradict it (numbers that differ from the recipe's) or replace the
update-counted LR schedule (a ``"scheduler"`` section).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from hf_accum.distributed import num_nodes, skip_deepspeed_inference_comm_build
from hf_accum.errors import InputError

if TYPE_CHECKING:  # accelerate and transformers are imported where used (importing the recipe stays cheap)
    from accelerate import Accelerator
    from transformers import TrainingArguments

DEEPSPEED = "deepspeed"
FSDP = "fsdp"
DDP = "ddp"  # plain data parallel, one process included

ZERO3_CONFIG = "recipes/deepspeed/zero3.json"


class LaunchError(InputError):
    """The run would not be what the launcher or the config asked for; raised before any model is loaded."""


@dataclass(frozen=True)
class Launch:
    """What this run will use, once :func:`check_launch` has accepted it."""

    backend: str
    """``deepspeed``, ``fsdp`` or ``ddp`` (which includes a single process)."""
    source: str
    """Where the request came from (a config key or the launcher), for messages."""
    world_size: int
    num_nodes: int
    deepspeed_config: dict | None = None
    """The DeepSpeed config (``"auto"`` values still unfilled) when ``backend == 'deepspeed'``."""


# -- 1. before the model: what was asked vs what would run ---------------------------------------


def check_launch(training: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Launch:
    """The backend this run will really use; raises :class:`LaunchError` when it is not the one asked for.

    ``training``: the recipe's training section (``TrainingArguments`` field names) with the batch
    arithmetic resolved (``per_device_train_batch_size``, ``gradient_accumulation_steps``).
    ``environ``: the process environment (the launcher's trace), ``os.environ`` by default.
    """
    environ = os.environ if environ is None else environ
    _check_started_processes(environ)
    backend, source = requested_backend(training, environ)
    world_size = launched_world_size(environ) or 1
    if backend == FSDP:
        _check_fsdp_device(training, environ, source)
    ds_config = None
    if backend == DEEPSPEED:
        _check_deepspeed_installed(source)
        ds_config = load_deepspeed_config(_deepspeed_source(training, environ))
        check_deepspeed_batch(
            ds_config, micro_batch_size=int(training.get("per_device_train_batch_size", 8)),
            accumulation_steps=int(training.get("gradient_accumulation_steps", 1)), world_size=world_size,
            max_grad_norm=float(training.get("max_grad_norm", 1.0)),
        )
    return Launch(backend, source, world_size, num_nodes(environ), ds_config)


def requested_backend(training: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[str, str]:
    """``(backend, where it was asked)`` from the config and from ``accelerate launch``'s environment."""
    asked = []
    if training.get("deepspeed"):
        asked.append((DEEPSPEED, f"training.deepspeed={training['deepspeed']}"))
    elif _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        asked.append((DEEPSPEED, "accelerate launch (distributed_type: DEEPSPEED)"))
    if training.get("fsdp"):
        asked.append((FSDP, f"training.fsdp={training['fsdp']}"))
    elif _flag(environ, "ACCELERATE_USE_FSDP"):
        asked.append((FSDP, "accelerate launch (distributed_type: FSDP)"))
    if len(asked) > 1:
        raise LaunchError(
            f"both DeepSpeed ({asked[0][1]}) and FSDP ({asked[1][1]}) were asked for; they are two ways of "
            "sharding the same model: keep one"
        )
    return asked[0] if asked else (DDP, "the launcher")


def _check_started_processes(environ: Mapping[str, str]) -> None:
    """``accelerate launch --num_processes N`` without a multi-process launcher (``--cpu``, or no GPU
    and no ``--multi_gpu``) starts the script ONCE. The trace it leaves: its simple launcher always
    exports ``ACCELERATE_USE_CPU``, and exports ``MASTER_ADDR``/``MASTER_PORT`` only when more than
    one process or machine was asked -- but no world size, which every multi-process launcher sets
    (torchrun and Accelerate's launchers built on it: ``WORLD_SIZE``; mpirun: its own variable)."""
    from_simple_launcher = "ACCELERATE_USE_CPU" in environ and launched_world_size(environ) is None
    if from_simple_launcher and "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
        asked = _asked_process_count()
        raise LaunchError(
            f"accelerate launch was asked for {asked or 'several'} processes but started only this one (its "
            "--cpu / no-GPU launcher runs the script once): the run would train on 1 process with an effective "
            f"batch {asked or 'N'} times smaller than planned. Start the processes with torchrun: "
            f"torchrun --nproc_per_node {asked or 'N'} {_script()} ..."
        )


# The world-size variables Accelerate reads for CPU processes (accelerate.utils.get_cpu_distributed_information).
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_world_size(environ: Mapping[str, str]) -> int | None:
    """Processes the launcher started, as it announces them; None when no launcher announced any."""
    for name in _WORLD_SIZE_VARIABLES:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


def _asked_process_count() -> int | None:
    """``--num_processes N`` of the ``accelerate launch`` that started us, when its command line is
    readable (Linux); only used to make the message exact."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
            argv = handle.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    for index, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--num_processes=") else None
        if arg == "--num_processes" and index + 1 < len(argv):
            value = argv[index + 1]
        if value is not None and value.isdigit():
            return int(value)
    return None


def _check_fsdp_device(training: Mapping[str, Any], environ: Mapping[str, str], source: str) -> None:
    """FSDP2 on 2 or more processes, GPUs or CPU (on CPU the loop and AccumTrainer force Accelerate's FSDP
    type, which it would otherwise silently replace with DDP). One process would run unsharded; FSDP1 is
    refused (it segfaults gathering a full state dict on CPU)."""
    world_size = launched_world_size(environ) or 1
    if world_size < 2:
        raise LaunchError(
            f"FSDP was asked for ({source}) but only {world_size} process was started: Accelerate would train "
            f"unsharded (plain single-process), saying nothing. Start 2 or more: torchrun --nproc_per_node 2 "
            f"{_script()} ... training.fsdp=full_shard"
        )
    version = fsdp_version(training, environ)
    if version != 2:
        raise LaunchError(
            f"FSDP version {version} was asked for ({source}); allowed: 2 (training.fsdp_config.version=2, "
            "fsdp_version: 2 in the accelerate config): hf_accum runs FSDP2 only"
        )


def fsdp_version(training: Mapping[str, Any], environ: Mapping[str, str]) -> int:
    """The FSDP version asked for: ``training.fsdp_config`` (``version`` / ``fsdp_version``), else the
    ``accelerate launch`` config's ``fsdp_version`` (``FSDP_VERSION``), else 2."""
    fsdp_config = training.get("fsdp_config") or {}
    if isinstance(fsdp_config, Mapping):
        for key in ("version", "fsdp_version"):
            if key in fsdp_config:
                return int(fsdp_config[key])
    return int(environ.get("FSDP_VERSION", "2")) if _flag(environ, "ACCELERATE_USE_FSDP") else 2


def gpu_like_device_available() -> bool:
    """A device on which Accelerate's distributed types enable FSDP (its MULTI_* GPU-like types)."""
    import accelerate.utils as accelerate_utils

    probes = ("is_cuda_available", "is_xpu_available", "is_npu_available", "is_mlu_available",
              "is_musa_available", "is_sdaa_available", "is_hpu_available", "is_neuron_available")
    return any(getattr(accelerate_utils, name, lambda: False)() for name in probes)


def _check_deepspeed_installed(source: str) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise LaunchError(
            f"DeepSpeed was asked for ({source}) but is not installed, so the run could not shard anything. "
            "Install it: pip install 'hf_accum[deepspeed]' (or pip install deepspeed), or drop the DeepSpeed "
            "config to train with plain DDP"
        )


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def _script() -> str:
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "recipes/finetune_llama.py"
    return os.path.relpath(script) if os.path.isabs(script) else script


# -- DeepSpeed config files -----------------------------------------------------------------------

# DeepSpeed key -> the recipe's (TrainingArguments) name for the same number. "auto" takes the recipe's.
_BATCH_KEYS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x processes",
    "gradient_clipping": "max_grad_norm",
}


def load_deepspeed_config(source: str | Mapping[str, Any]) -> dict:
    """A DeepSpeed config (path to a JSON file, or a dict) checked for what hf_accum needs."""
    if isinstance(source, Mapping):
        config = json.loads(json.dumps(source))  # a private deep copy; "auto" values get filled in place later
        where = "the DeepSpeed config"
    else:
        where = f"DeepSpeed config {source}"
        try:
            with open(source) as handle:
                config = json.load(handle)
        except FileNotFoundError:
            raise LaunchError(f"{where}: no such file (ready ones: recipes/deepspeed/zero2.json, zero3.json, "
                              "zero3_offload.json)") from None
        except json.JSONDecodeError as error:
            raise LaunchError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise LaunchError(f"{where}: must be a JSON object, got {type(config).__name__}")
    zero = config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if stage not in (0, 1, 2, 3):
        raise LaunchError(f"{where}: zero_optimization.stage={stage!r}; allowed: 0, 1, 2, 3 (hf_accum ships 2 and 3)")
    if "scheduler" in config:
        raise LaunchError(
            f"{where} has a 'scheduler' section: DeepSpeed's scheduler would replace hf_accum's, whose horizon is "
            "counted in optimizer updates (the big batch's LR at every update). Remove it and set "
            "training.lr_scheduler_type / warmup instead"
        )
    return config


def check_deepspeed_batch(
    config: Mapping[str, Any], micro_batch_size: int, accumulation_steps: int, world_size: int, max_grad_norm: float
) -> None:
    """Numbers in the DeepSpeed config must be the recipe's (``"auto"`` always is): the batch arithmetic
    is stated once. Accelerate would otherwise let a numeric ``gradient_accumulation_steps`` win silently."""
    recipe = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "train_batch_size": micro_batch_size * accumulation_steps * world_size,
        "gradient_clipping": max_grad_norm,
    }
    for key, ours in recipe.items():
        value = config.get(key, "auto")
        if value != "auto" and float(value) != float(ours):
            raise LaunchError(
                f"DeepSpeed config {key}={value} but the recipe has {_BATCH_KEYS[key]} = {ours}; set it to \"auto\" "
                "(filled from the recipe) or change the recipe"
            )


def _deepspeed_source(training: Mapping[str, Any], environ: Mapping[str, str]) -> str | Mapping[str, Any]:
    if training.get("deepspeed"):
        return training["deepspeed"]
    path = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path == "none":
        raise LaunchError(
            "accelerate launch asked for DeepSpeed without deepspeed_config_file: point the launcher config's "
            "deepspeed_config.deepspeed_config_file at a JSON (recipes/deepspeed/zero2.json, zero3.json, "
            "zero3_offload.json) or set training.deepspeed"
        )
    return path


# -- 2. the loop engine's Accelerator ---------------------------------------------------------------


def loop_accelerator(
    launch: Launch, accumulation_steps: int, max_grad_norm: float, mixed_precision: str = "no", use_cpu: bool = False,
    fsdp: Mapping[str, Any] | None = None,
) -> Accelerator:
    """The ``Accelerator`` of the loop engine for ``launch``, checked with :func:`check_engine`.

    Under DeepSpeed it carries a ``DeepSpeedPlugin`` whose ``"auto"`` values take the recipe's
    accumulation steps and clipping (Accelerate would otherwise clip at 1.0 whatever
    ``max_grad_norm`` says). Two traps of Accelerate 1.15 on a machine without GPU are avoided the
    way ``TrainingArguments(use_cpu=True, deepspeed=...)`` avoids them: ``Accelerator(cpu=True)``
    drops DeepSpeed, and without ``cpu`` Accelerate counts 1 process whatever torchrun started.
    So the process group is set up first as multi-CPU (``PartialState(cpu=True)``: gloo, the real
    world size), then the Accelerator is built without ``cpu`` and DeepSpeed runs on its CPU
    accelerator.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    kwargs: dict[str, Any] = {"gradient_accumulation_steps": accumulation_steps, "mixed_precision": mixed_precision}
    if launch.backend == FSDP:
        accelerator = _fsdp_loop_accelerator(accumulation_steps, mixed_precision, use_cpu, fsdp or {})
    elif launch.backend != DEEPSPEED:
        accelerator = Accelerator(cpu=use_cpu, **kwargs)
    else:
        if use_cpu or not gpu_like_device_available():
            PartialState(cpu=True)
        plugin = DeepSpeedPlugin(
            hf_ds_config=json.loads(json.dumps(launch.deepspeed_config)),  # filled in place: keep ours unfilled
            gradient_accumulation_steps=accumulation_steps,
            gradient_clipping=max_grad_norm,
        )
        accelerator = Accelerator(deepspeed_plugin=plugin, **kwargs)
    check_engine(accelerator, launch)
    return accelerator


def fsdp_training_arguments(training: Mapping[str, Any], launch: Launch) -> dict[str, Any]:
    """``fsdp`` / ``fsdp_config`` for ``TrainingArguments`` under FSDP (asked by the config or by ``accelerate
    launch``): :func:`fsdp_request`, the layer classes the accelerate config names, activation checkpointing
    through FSDP's plugin."""
    if launch.backend != FSDP:
        return {}
    from hf_accum.recipe.modeling import checkpointing_requested

    request = fsdp_request({**training, "fsdp": training.get("fsdp") or True})
    fsdp_config = request["fsdp_config"]
    layers = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    if layers and "transformer_layer_cls_to_wrap" not in fsdp_config:
        fsdp_config["transformer_layer_cls_to_wrap"] = layers.split(",")
    fsdp_config["activation_checkpointing"] = checkpointing_requested(dict(training))
    return request


# transformers' legacy ``fsdp`` string options, as its ``_apply_legacy_fsdp_to_config`` moves them to FSDP2's config.
_FSDP_OPTIONS = {"full_shard": ("reshard_after_forward", True), "shard_grad_op": ("reshard_after_forward", False),
                 "offload": ("cpu_offload", True), "auto_wrap": None}


def fsdp_request(training: Mapping[str, Any]) -> dict[str, Any]:
    """``{"fsdp": True, "fsdp_config": {...}}``, the form transformers 5.23 takes without its deprecation warning
    ("Passing `fsdp` as a string is deprecated"), from ``training.fsdp`` (true, or options such as
    ``full_shard`` / ``"shard_grad_op offload"``) and ``training.fsdp_config``; ``{}`` when FSDP is not asked."""
    fsdp = training.get("fsdp")
    if not fsdp:
        return {}
    fsdp_config = training.get("fsdp_config") or {}
    if isinstance(fsdp_config, str):  # a JSON file, as TrainingArguments reads it
        try:
            with open(fsdp_config) as handle:
                fsdp_config = json.load(handle)
        except (OSError, ValueError) as error:
            raise LaunchError(f"training.fsdp_config={fsdp_config!r}: not a readable JSON file ({error})") from None
    fsdp_config = {"version": 2, **fsdp_config}
    for option in fsdp.split() if isinstance(fsdp, str) else fsdp if isinstance(fsdp, list) else []:
        if option not in _FSDP_OPTIONS:
            raise LaunchError(f"training.fsdp={fsdp!r}: unknown option {option!r}; allowed: true, or "
                              f"{', '.join(_FSDP_OPTIONS)}")
        default = _FSDP_OPTIONS[option]
        if default is not None:
            fsdp_config.setdefault(*default)
    return {"fsdp": True, "fsdp_config": fsdp_config}


def launch_line(args: TrainingArguments, launch: Launch) -> str:
    """``8 per device x 2 accumulation x 2 processes, FSDP2 full_shard``: the batch arithmetic and what shards."""
    processes = f"{launch.world_size} process{'es' if launch.world_size != 1 else ''}"
    line = (f"{args.per_device_train_batch_size} per device x {args.gradient_accumulation_steps} accumulation x "
            f"{processes}")
    if launch.backend == FSDP:
        assert isinstance(args.fsdp_config, dict)  # with fsdp set, TrainingArguments loads it into a dict
        resharded = args.fsdp_config.get("reshard_after_forward", True)
        return f"{line}, FSDP2 {'full_shard' if resharded else 'shard_grad_op'}"
    if launch.backend == DEEPSPEED:
        assert launch.deepspeed_config is not None  # set with the deepspeed backend
        return f"{line}, DeepSpeed ZeRO-{launch.deepspeed_config['zero_optimization']['stage']}"
    return line


def loop_fsdp_options(args: TrainingArguments) -> dict[str, Any]:
    """What :func:`loop_accelerator` needs from ``TrainingArguments`` built with :func:`fsdp_training_arguments`."""
    config = args.fsdp_config or {}
    assert isinstance(config, dict)  # with fsdp set, TrainingArguments loads fsdp_config into a dict
    return {"layers": config.get("transformer_layer_cls_to_wrap"),
            "activation_checkpointing": bool(config.get("activation_checkpointing"))}


def _fsdp_loop_accelerator(accumulation_steps: int, mixed_precision: str, use_cpu: bool,
                           fsdp: Mapping[str, Any]) -> Accelerator:
    """FSDP2 through :func:`hf_accum.fsdp.fsdp_accelerator` (forced on CPU, refused rather than DDP).

    ``fsdp``: ``layers`` (class names to shard by: the model's ``_no_split_modules``) and
    ``activation_checkpointing``. bf16 becomes FSDP2's ``param_dtype`` with fp32 master weights and fp32
    gradient reduction, not an autocast: the precision exact accumulation needs."""
    from hf_accum.fsdp import fsdp2_plugin, fsdp_accelerator

    if mixed_precision == "fp16":
        raise LaunchError("training.fp16 with FSDP is not supported by the loop engine; allowed: training.bf16")
    plugin = fsdp2_plugin(fsdp.get("layers"), param_dtype=torch.bfloat16 if mixed_precision == "bf16" else None,
                          activation_checkpointing=bool(fsdp.get("activation_checkpointing")))
    return fsdp_accelerator(plugin, accumulation_steps, cpu=use_cpu or not gpu_like_device_available())


def start_process_group(args: TrainingArguments, launch: Launch) -> None:
    """Set up the process group as ``TrainingArguments`` does (gloo with ``use_cpu``), before any model loads; check
    that it spans every process the launcher started; under DeepSpeed, start DeepSpeed's comm on it.

    Accelerate keeps one shared state per process, made by whoever asks first. A quantized load
    (``from_pretrained(device_map=...)``) asks with default arguments, which on a machine without GPU yields ONE
    process whatever torchrun started -- every rank would then train alone, silently. And with a ZeRO-3 config
    alive (trainer engine) transformers builds the model inside ``deepspeed.zero.Init``, which reads the world
    size from DeepSpeed's comm: left uninitialized it counts 1 process and refuses the batch arithmetic.
    """
    from accelerate import PartialState

    if launch.backend == DEEPSPEED:  # before Accelerate's state starts DeepSpeed's comm (its inference-only op)
        skip_deepspeed_inference_comm_build()
    args.device  # noqa: B018 -- TrainingArguments creates the process group on first use
    processes = PartialState().num_processes
    if processes != launch.world_size:
        hint = ("this machine has no GPU, and without training.use_cpu=true Accelerate counts one process: add it"
                if not gpu_like_device_available() else "check the launcher's environment (WORLD_SIZE, RANK)")
        raise LaunchError(
            f"the launcher started {launch.world_size} processes but the process group holds {processes}; {hint}"
        )
    if launch.backend == DEEPSPEED:
        import deepspeed

        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        deepspeed.init_distributed(dist_backend=backend)  # wraps the existing group


def check_offload_optimizer(optimizer: torch.optim.Optimizer, launch: Launch) -> None:
    """ZeRO-Offload steps on the CPU with DeepSpeed's own optimizers: Accelerate swaps a torch optimizer
    for ``DeepSpeedCPUAdam`` (``DeepSpeedCPUAdagrad`` for Adagrad) keeping only its lr and weight decay
    -- an SGD becomes Adam, other betas/eps become (0.9, 0.999)/1e-8, without a word. Refuse those."""
    config = launch.deepspeed_config or {}
    offload = config.get("zero_optimization", {}).get("offload_optimizer") or {}
    if launch.backend != DEEPSPEED or offload.get("device", "none") == "none":
        return
    if not config.get("zero_force_ds_cpu_optimizer", True):
        return  # the torch optimizer itself runs on the CPU
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.Adagrad):
        return
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        defaults = optimizer.defaults
        if tuple(defaults["betas"]) == (0.9, 0.999) and defaults["eps"] == 1e-8 and not defaults.get("amsgrad"):
            return
        change = f"betas={tuple(defaults['betas'])}, eps={defaults['eps']} by DeepSpeedCPUAdam's (0.9, 0.999), 1e-8"
    else:
        change = f"{name} by DeepSpeedCPUAdam"
    raise LaunchError(
        f"ZeRO-Offload ({launch.source}) would replace {change} (Accelerate keeps only lr and weight_decay). "
        "Use AdamW with the default betas/eps, or set \"zero_force_ds_cpu_optimizer\": false in the DeepSpeed "
        "config to step this optimizer itself on the CPU (slower)"
    )


# -- 3. after the Accelerator exists: what it really got ------------------------------------------


def check_engine(accelerator: Any, launch: Launch) -> None:
    """Compare the ``Accelerator`` (``trainer.accelerator`` for the Trainer) with the accepted launch."""
    from accelerate.utils import DistributedType

    expected = {DEEPSPEED: DistributedType.DEEPSPEED, FSDP: DistributedType.FSDP}.get(launch.backend)
    actual = accelerator.distributed_type
    if expected is not None and actual != expected:
        raise LaunchError(
            f"{launch.backend} was asked for ({launch.source}) but the Accelerator runs {actual.value}; "
            + ("for the loop engine build it with hf_accum.recipe.launch.loop_accelerator (Accelerate drops "
               "DeepSpeed when cpu=True)" if launch.backend == DEEPSPEED
               else "build it with hf_accum.fsdp.fsdp_accelerator")
        )
    if accelerator.num_processes != launch.world_size:
        raise LaunchError(
            f"the launcher started {launch.world_size} processes but the Accelerator sees {accelerator.num_processes}"
        )


