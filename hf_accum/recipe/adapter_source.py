"""``model.adapter``: a run that starts from a previous run's LoRA adapter (SFT -> DPO -> GRPO).

This module owns, before anything loads:

* finding the adapter: ``model.adapter`` names a finished run's output directory (its ``adapter/``) or an adapter
  directory itself (``adapter_config.json`` + weights); an adapter directory inside a run directory is traced back
  to that run;
* the check that it was trained on THIS run's base model: the source run's resolved ``model.name_or_path`` (else
  the adapter's ``base_model_name_or_path``) against this run's. The embedded ``hf_accum:tiny-llama`` is rebuilt
  from ``training.seed`` and ``model.config_overrides`` (its adapter names no base on disk), so for it those must
  match too, and its adapter is accepted only with its run directory;
* the LoRA settings: an adapter's shape and scale (``r``, ``lora_alpha``, target modules ...) are its own, so the
  ``lora`` section takes them from its ``adapter_config.json`` (named in a note); a command-line ``lora.*`` that
  says otherwise is refused;
* DPO's reference: the starting policy (the loaded adapter on), as TRL takes it for a pretrained adapter; the
  loop engine keeps the adapter on for its reference pass (:func:`hf_accum.recipe.reference.reference_mode`), the
  trainer engine scores it with TRL's frozen copy of the adapter ("ref") in AccumDPOTrainer's precompute pass, on
  any number of processes;
* its provenance for ``metrics.json`` (:func:`provenance`).

Every refusal is one line naming ``model.adapter`` and both sides (:class:`AdapterSourceError`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import yaml

from hf_accum.errors import InputError
from hf_accum.recipe.config import RESOLVED_CONFIG_NAME, RecipeConfig

ADAPTER_CONFIG = "adapter_config.json"
RUN_ADAPTER_DIR = "adapter"  # hf_accum.recipe.outputs.ADAPTER_DIR (not imported: outputs imports the config kit)
RUN_MODEL_DIR = "model"
RUN_CONFIG = RESOLVED_CONFIG_NAME
TINY_MODEL = "hf_accum:tiny-llama"
# The adapter_config.json keys that define the adapter's shape and scale: the lora section takes them from it.
ADAPTER_LORA_KEYS = ("r", "lora_alpha", "target_modules", "modules_to_save", "use_rslora", "use_dora", "bias",
                     "lora_dropout")


class AdapterSourceError(InputError):
    """``model.adapter`` names no adapter, or one made for another base model."""


@dataclass(frozen=True)
class AdapterSource:
    """A found adapter: its directory, its saved LoRA config, and the run that trained it (when known)."""

    adapter_dir: str
    lora: dict[str, Any]
    run_dir: str | None
    run_model: dict[str, Any] | None  # the source run's resolved model section
    run_seed: Any  # the source run's training.seed (the embedded tiny model's weights come from it)

    @property
    def base_model(self) -> Any:
        """The base model the adapter was trained on, as the source run named it (else as the adapter does)."""
        if self.run_model is not None:
            return self.run_model.get("name_or_path")
        return self.lora.get("base_model_name_or_path")


def find_adapter(given: str) -> AdapterSource:
    """The adapter ``model.adapter=given`` names, or one line saying why there is none."""
    path = os.path.abspath(os.path.expanduser(given))
    if not os.path.isdir(path):
        raise AdapterSourceError(f"model.adapter={given!r}: no such directory (cwd: {os.getcwd()})")
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        parent = os.path.dirname(path)
        run_dir = parent if os.path.isfile(os.path.join(parent, RUN_CONFIG)) else None
        return _source(path, run_dir)
    if os.path.isfile(os.path.join(path, RUN_ADAPTER_DIR, ADAPTER_CONFIG)):
        return _source(os.path.join(path, RUN_ADAPTER_DIR), path if os.path.isfile(os.path.join(path, RUN_CONFIG))
                       else None)
    if os.path.isdir(os.path.join(path, RUN_MODEL_DIR)):
        why = "a run that trained the full model (model/, lora: null): point model.name_or_path at its model/ instead"
    elif os.path.isfile(os.path.join(path, RUN_CONFIG)):
        why = "a recipe run with no adapter/ yet (not finished: finish it with the same command)"
    else:
        why = f"neither a recipe run's output directory nor an adapter directory ({ADAPTER_CONFIG})"
    raise AdapterSourceError(f"model.adapter={given!r}: {why}")


def _source(adapter_dir: str, run_dir: str | None) -> AdapterSource:
    with open(os.path.join(adapter_dir, ADAPTER_CONFIG)) as handle:
        lora = json.load(handle)
    run_model, run_seed = None, None
    if run_dir is not None:
        with open(os.path.join(run_dir, RUN_CONFIG)) as handle:
            saved = yaml.safe_load(handle) or {}
        run_model = saved.get("model") or {}
        run_seed = (saved.get("training") or {}).get("seed", 42)  # TrainingArguments' default when unset
    return AdapterSource(adapter_dir, lora, run_dir, run_model, run_seed)


def check_adapter(config: RecipeConfig) -> AdapterSource | None:
    """``model.adapter``'s check (part of the model section's): found, made for this base model, LoRA on; the
    ``lora`` section then holds the adapter's own settings (``config.lora`` replaced, a note says which)."""
    given = config.model.adapter
    if given is None:
        return None
    source = find_adapter(given)
    if config.lora is None:
        raise AdapterSourceError(f"model.adapter={given!r} is a LoRA adapter, but lora is null (full fine-tuning): "
                                 "remove lora=null to train the adapter")
    _require_same_base(given, source, config)
    _adopt_lora_settings(given, source, config)
    return source


def _require_same_base(given: str, source: AdapterSource, config: RecipeConfig) -> None:
    model = config.model
    base, seed = source.base_model, config.training.seed
    where = f"model.adapter={given!r} was trained on"
    if model.name_or_path == TINY_MODEL and source.run_model is None:
        raise AdapterSourceError(f"{where} {base or 'an unnamed base model'!r}, which this run cannot check against "
                                 f"model.name_or_path={TINY_MODEL!r} (rebuilt from training.seed): give the run "
                                 "directory that saved it")
    if not _same_model(base, model.name_or_path):
        raise AdapterSourceError(f"{where} {base!r}, but this run's model.name_or_path={model.name_or_path!r}: "
                                 "set model.name_or_path to the adapter's base model")
    if model.name_or_path == TINY_MODEL and source.run_model is not None:
        overrides = source.run_model.get("config_overrides") or {}
        if source.run_seed != seed or overrides != dict(model.config_overrides):
            raise AdapterSourceError(
                f"{where} {TINY_MODEL} built with training.seed={source.run_seed}, config_overrides={overrides}, but "
                f"this run builds it with training.seed={seed}, config_overrides={dict(model.config_overrides)}: "
                "another random base; set the same values")


def _same_model(saved: Any, current: str) -> bool:
    """The same model name, or the same local directory however it is written."""
    if not saved:
        return False
    if saved == current:
        return True
    return os.path.exists(str(saved)) and os.path.exists(current) and os.path.samefile(str(saved), current)


def _adopt_lora_settings(given: str, source: AdapterSource, config: RecipeConfig) -> None:
    assert config.lora is not None  # checked by the caller
    adopted = {key: source.lora[key] for key in ADAPTER_LORA_KEYS if key in source.lora}
    effective = config.lora_config()  # the section's values over peft's defaults
    changed = []
    for key, value in adopted.items():
        current = getattr(effective, key, None)
        if _same_setting(current, value):
            continue
        if config.layer_rank(f"lora.{key}") == 2:  # the command line asked for something else
            raise AdapterSourceError(f"lora.{key}={config.lora.get(key)!r} (command line) conflicts with "
                                     f"model.adapter={given!r}, whose {ADAPTER_CONFIG} has {key}={value!r}: a loaded "
                                     f"adapter keeps its own settings; drop lora.{key}")
        changed.append(f"lora.{key}={value!r}")
    config.lora = {**config.lora, **adopted}
    if changed:
        config.notes.append(f"model.adapter={given!r}: the lora section takes the adapter's own settings from its "
                            f"{ADAPTER_CONFIG}: {', '.join(changed)}")


def _same_setting(current: Any, saved: Any) -> bool:
    """Equal, reading a list of module names as a set (PEFT saves them sorted)."""
    if isinstance(current, (list, tuple, set)) and isinstance(saved, (list, tuple, set)):
        return sorted(current) == sorted(saved)
    return bool(current == saved)


def provenance(config: RecipeConfig) -> dict[str, Any] | None:
    """What ``metrics.json`` records of the run this one started from (None: a fresh adapter or full model)."""
    if config.model.adapter is None:
        return None
    source = find_adapter(config.model.adapter)
    return {"adapter": source.adapter_dir, "run": source.run_dir, "base_model": source.base_model,
            "base_seed": source.run_seed if source.base_model == TINY_MODEL else None}
