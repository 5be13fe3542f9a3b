"""hf_accum: exact gradient accumulation for transformers / accelerate / peft.

The contract: the gradient applied at each optimizer update equals the gradient of the mean
loss over all prediction targets of that update (all micro-batches, all ranks), and the LR at
update n equals the big-batch run's LR at update n.
"""

import logging

# bitsandbytes' CPU backend tries to fetch an optional kernel from the Hub at import and logs a
# warning when it cannot (always, offline); it then uses its built-in kernel, which is correct.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from hf_accum.accumulation import WindowTally, WindowTotals, exact_mean_factor  # noqa: E402
from hf_accum.batching import PackingCollator, PaddingCollator  # noqa: E402
from hf_accum.fused_loss import linear_cross_entropy_sum  # noqa: E402
from hf_accum.loss import count_targets, infer_loss_kind, token_loss_sum  # noqa: E402
from hf_accum.loop import LoopConfig, TrainResult, UpdateLog, train  # noqa: E402
from hf_accum.schedule import BatchPlan, create_update_scheduler, plan_global_batch, planned_updates  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "BatchPlan",
    "LoopConfig",
    "PackingCollator",
    "PaddingCollator",
    "TrainResult",
    "UpdateLog",
    "WindowTally",
    "WindowTotals",
    "count_targets",
    "create_update_scheduler",
    "exact_mean_factor",
    "infer_loss_kind",
    "linear_cross_entropy_sum",
    "plan_global_batch",
    "planned_updates",
    "token_loss_sum",
    "train",
]


def __getattr__(name):
    # AccumTrainer imports transformers.Trainer (heavy); load it only when asked for.
    if name == "AccumTrainer":
        from hf_accum.trainer import AccumTrainer

        return AccumTrainer
    raise AttributeError(name)
