"""hf_accum: exact gradient accumulation for transformers / accelerate / peft.

The contract: the gradient applied at each optimizer update equals the gradient of the mean
loss over all prediction targets of that update (all micro-batches, all ranks), and the LR at
update n equals the big-batch run's LR at update n.
"""

import logging
from types import ModuleType
from typing import Any

# bitsandbytes' CPU backend tries to fetch an optional kernel from the Hub at import and logs a
# warning when it cannot (always, offline); it then uses its built-in kernel, which is correct.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _library_logger() -> None:
    """hf_accum's own lines (the effective batch, the LR horizon, skipped updates) are shown at INFO
    by default, on stderr, without touching the root logger (``HF_ACCUM_LOG_LEVEL`` changes it)."""
    import os

    library = logging.getLogger("hf_accum")
    if not library.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hf_accum] %(message)s"))
        library.addHandler(handler)
        library.setLevel(os.environ.get("HF_ACCUM_LOG_LEVEL", "INFO").upper())
        library.propagate = False


_library_logger()

# Every public name is imported on first use (PEP 562): `import hf_accum` and `hf-accum plan` stay light
# (no torch, transformers or accelerate for arithmetic); `from hf_accum import train` imports the loop.
_LAZY = {
    "WindowTally": "accumulation", "WindowTotals": "accumulation", "exact_mean_factor": "accumulation",
    "PackingCollator": "batching", "PaddingCollator": "batching",
    "latest_complete_checkpoint": "checkpointing.checkpoint",
    "EXIT_INTERRUPTED": "control", "EXIT_PREEMPTED": "control", "NonFiniteLossError": "control",
    "TrainingControl": "control", "TrainingStopped": "control",
    "linear_cross_entropy_sum": "fused.loss",
    "count_targets": "losses.token_loss", "infer_loss_kind": "losses.token_loss", "token_loss_sum": "losses.token_loss",
    "LoopConfig": "loop", "TrainResult": "loop", "UpdateLog": "loop", "train": "loop",
    "AccumulationSettings": "settings",
    "BatchPlan": "planning.schedule", "create_update_scheduler": "planning.schedule", "plan_global_batch":
    "planning.schedule", "planned_updates": "planning.schedule",
    # The trainers import transformers.Trainer (heavy) and TRL (optional).
    "AccumTrainer": "trainer", "AccumSFTTrainer": "trainer.sft", "AccumDPOTrainer": "trainer.dpo",
    "DPOPairLoss": "losses.preference", "collate_pairs": "losses.preference", "AccumGRPOTrainer": "trainer.grpo",
    "AccumRewardTrainer": "trainer.reward",
}
# Front-ends refused by name, with the reason (docs/normalization.md): importing one raises it.
_REFUSED = {
    "AccumKTOTrainer": (
        "hf_accum provides no AccumKTOTrainer: TRL's KTOTrainer estimates its KL baseline per micro-batch (a "
        "batch-level statistic, detached and clamped, from mismatched completions of that micro-batch), so no "
        "big-batch loss exists for gradient accumulation to reproduce exactly; use AccumDPOTrainer on pairs, or "
        "trl.KTOTrainer with one micro-batch per update (gradient_accumulation_steps=1, one process)"
    ),
}

__version__ = "0.1.0"

__all__ = [
    "AccumulationSettings",
    "DPOPairLoss",
    "EXIT_INTERRUPTED",
    "EXIT_PREEMPTED",
    "BatchPlan",
    "LoopConfig",
    "NonFiniteLossError",
    "PackingCollator",
    "PaddingCollator",
    "TrainResult",
    "TrainingControl",
    "TrainingStopped",
    "UpdateLog",
    "WindowTally",
    "WindowTotals",
    "collate_pairs",
    "count_targets",
    "create_update_scheduler",
    "exact_mean_factor",
    "infer_loss_kind",
    "latest_complete_checkpoint",
    "linear_cross_entropy_sum",
    "plan_global_batch",
    "planned_updates",
    "token_loss_sum",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in _REFUSED:
        from hf_accum.errors import NotProvided

        raise NotProvided(_REFUSED[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_accum' has no attribute {name!r}")
    value = getattr(_defining_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def _defining_module(key: str) -> ModuleType:
    """The module ``key`` of :data:`_LAZY` names, imported by a static statement (so the import-graph tests and
    type checkers see every edge; no import by computed name)."""
    match key:
        case "accumulation":
            from hf_accum import accumulation
            return accumulation
        case "batching":
            from hf_accum import batching
            return batching
        case "control":
            from hf_accum import control
            return control
        case "loop":
            from hf_accum import loop
            return loop
        case "trainer":
            from hf_accum import trainer
            return trainer
        case "checkpointing.checkpoint":
            from hf_accum.checkpointing import checkpoint
            return checkpoint
        case "fused.loss":
            from hf_accum.fused import loss
            return loss
        case "losses.token_loss":
            from hf_accum.losses import token_loss
            return token_loss
        case "losses.preference":
            from hf_accum.losses import preference
            return preference
        case "planning.schedule":
            from hf_accum.planning import schedule
            return schedule
        case "settings":
            from hf_accum import settings
            return settings
    return _trl_drop_in(key)


def _trl_drop_in(key: str) -> ModuleType:
    """The TRL drop-ins' modules (they import TRL, an optional extra), by static imports."""
    match key:
        case "trainer.sft":
            from hf_accum.trainer import sft
            return sft
        case "trainer.dpo":
            from hf_accum.trainer import dpo
            return dpo
        case "trainer.grpo":
            from hf_accum.trainer import grpo
            return grpo
        case "trainer.reward":
            from hf_accum.trainer import reward
            return reward
    raise AssertionError(f"_LAZY names {key!r}, which _defining_module does not import")
