"""The child processes of ``hf-accum plan --auto``: everything that needs torch, the recipe's config or the model.

Run by :mod:`hf_accum.recipe.plan_auto` as ``python -m hf_accum.recipe.plan_probe '<json spec>'``, so that the
planner itself stays a small process that never imports torch and never holds a model: it watches this process's
memory and stops it before the two together cross ``--memory-budget``. Two kinds of spec, answered as one JSON
line on stdout:

* ``{"resolve": {...}}`` -- read the recipe config (``argv``: its ``--config``/overrides argv) and answer what
  the planner needs: device, precision, row length, per-process batch, model name and the device's free memory;
  or ``{"error": "..."}`` for bad input (the planner exits 2 with that line).
* ``{"probe": {...}}`` -- build the recipe's model and run one measured training step at ``micro_batch`` rows of
  ``max_length`` tokens on ``device`` with ``precision``; answer ``{"tensor_peak", "rss_peak"}``. With
  ``rss_headroom`` (CPU budgets), once its imports are done the process caps its own further growth of private
  memory (``RLIMIT_DATA``) at that many bytes minus its resident size: an allocation beyond it fails, and the
  planner counts the size as over the budget even if it was not scheduled in time to stop this process.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

import torch

from hf_accum.measure.memory import default_budget, training_step_peak
from hf_accum.measure.peak_memory import peak_rss_bytes
from hf_accum.recipe.command_line import lean_start
from hf_accum.recipe.config import RecipeConfig
from hf_accum.recipe.plan_auto import per_process_batch


def resolve(spec: dict[str, Any]) -> dict[str, Any]:
    """The planner's inputs from the recipe config, every value checked (bad input raises ``ValueError``)."""
    from hf_accum.recipe import config as recipe_config
    from hf_accum.recipe import modeling

    path, overrides = recipe_config.parse_overrides(spec["argv"])
    config = recipe_config.load_config(path, overrides)
    max_length = spec.get("max_length") or config.data.max_length
    if max_length < 2:
        raise ValueError(f"--max-length {max_length}: needs at least 2 tokens (one prediction target)")
    per_process = _per_process_batch(spec.get("global_batch_size"), config, spec["processes"])
    modeling.check_model_section(config.model)  # a missing model: one line, before any probe starts
    cuda = torch.cuda.is_available() and not config.training.get("use_cpu")
    device = torch.device("cuda" if cuda else "cpu")
    training = config.training
    precision = "bf16" if training.get("bf16") else "fp16" if training.get("fp16") else "no"
    return {"device": device.type, "precision": precision, "max_length": max_length, "per_process": per_process,
            "model": config.model.name_or_path, "default_budget": default_budget(device),
            # what the run already does to save memory, so that the advice when nothing fits reads the config
            "lora": config.lora is not None, "quantized": config.quantization is not None,
            "checkpointing": bool(modeling.checkpointing_requested(dict(training)))}


def _per_process_batch(global_batch_size: int | None, config: RecipeConfig, processes: int) -> int:
    """Sequences per process per update: the target global batch over the processes (must divide)."""
    if global_batch_size is not None:
        global_batch = global_batch_size
    elif config.global_batch_size is not None:
        global_batch = config.global_batch_size
    else:
        t = config.training
        global_batch = t.get("per_device_train_batch_size", 8) * t.get("gradient_accumulation_steps", 1) * processes
    return per_process_batch(int(global_batch), processes)


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    from hf_accum.recipe import config as recipe_config
    from hf_accum.recipe import modeling

    if spec.get("rss_headroom") is not None:
        cap_own_growth(int(spec["rss_headroom"]))
    path, overrides = recipe_config.parse_overrides(spec["argv"])
    config = recipe_config.load_config(path, overrides)
    tokenizer = modeling.load_tokenizer(config.model.name_or_path, config.model.chat_template,
                                        config.model.trust_remote_code)
    device = torch.device(spec["device"])
    model = modeling.build_model(config, tokenizer, seed=0).to(device)
    tensor_peak = training_step_peak(model, device, spec["micro_batch"], spec["max_length"], spec["precision"])
    # The whole process, libraries and allocator caches included (VmHWM: this program's own high-water mark).
    return {"tensor_peak": tensor_peak, "rss_peak": peak_rss_bytes()}


def cap_own_growth(rss_headroom: int) -> None:
    """Allow this process's private memory to grow by at most what is left of ``rss_headroom`` after its present
    resident size: ``RLIMIT_DATA`` (virtual private writable memory, which every new heap page belongs to) is set
    to its present size plus that. Resident memory cannot grow by more than that without an allocation failing."""
    status = _status_kib()
    left = max(rss_headroom - status["VmRSS"] * 1024, 0)
    limit = status["VmData"] * 1024 + left
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _status_kib() -> dict[str, int]:
    with open("/proc/self/status") as status:
        fields = (line.split() for line in status if line.startswith(("VmRSS:", "VmData:")))
        return {parts[0].rstrip(":"): int(parts[1]) for parts in fields}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    lean_start(next(iter(spec.values())).get("argv", []))  # no bitsandbytes unless the recipe run would quantize
    if "resolve" in spec:
        try:
            answer = resolve(spec["resolve"])
        except ValueError as error:  # InputError, ConfigError, ModelError: the user's to fix
            answer = {"error": str(error)}
    else:
        answer = probe(spec["probe"])
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
