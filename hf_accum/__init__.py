"""hf_accum: exact gradient accumulation for transformers / accelerate / peft.

The contract: the gradient applied at each optimizer update equals the gradient of the mean
loss over all prediction targets of that update (all micro-batches, all ranks), and the LR at
update n equals the big-batch run's LR at update n.
"""

import logging

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

from hf_accum.accumulation import WindowTally, WindowTotals, exact_mean_factor  # noqa: E402
from hf_accum.batching import PackingCollator, PaddingCollator  # noqa: E402
from hf_accum.checkpoint import latest_complete_checkpoint  # noqa: E402
from hf_accum.control import (  # noqa: E402
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    NonFiniteLossError,
    TrainingControl,
    TrainingStopped,
)
from hf_accum.fused_loss import linear_cross_entropy_sum  # noqa: E402
from hf_accum.loop import LoopConfig, TrainResult, UpdateLog, train  # noqa: E402
from hf_accum.loss import count_targets, infer_loss_kind, token_loss_sum  # noqa: E402
from hf_accum.schedule import BatchPlan, create_update_scheduler, plan_global_batch, planned_updates  # noqa: E402

__version__ = "0.1.0"

__all__ = [
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


def __getattr__(name):
    # The trainers import transformers.Trainer (heavy) and TRL (optional); load them only when asked for.
    if name == "AccumTrainer":
        from hf_accum.trainer import AccumTrainer

        return AccumTrainer
    if name == "AccumSFTTrainer":
        from hf_accum.sft import AccumSFTTrainer

        return AccumSFTTrainer
    raise AttributeError(name)
