"""A real process for the auto ramp's kill + resume test: an auto-ramped loop run checkpointing every update.

``python tests/rampup_auto_resume_worker.py OUT [--kill-after-first-change | --resume]``: ``--kill-after-first-change``
SIGKILLs the process one update after the first batch change (its checkpoint written, the next window already
decided); ``--resume`` continues from the latest complete checkpoint in OUT. A run that completes writes
``OUT/final.pt`` (sequences, LRs and losses of every update, and the final weights).
"""

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import os
import signal
import sys

import torch
from torch.utils.data import DataLoader

from hf_accum import LoopConfig, train
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.records import UpdateLog
from hf_accum.testing import PAD, fresh_accelerator, random_rows, tiny_causal_lm
from hf_accum.testing.data import map_style

EAGER = {"margin": 0.5, "release": 0.25, "patience": 2, "min_updates": 2, "lr_rule": "seesaw"}


def main(out: str, flags: list[str]) -> None:
    accelerator = fresh_accelerator(8)
    torch.manual_seed(0)
    model = tiny_causal_lm()
    loader = DataLoader(map_style(random_rows(64, seed=41, prompt_masking=True)), batch_size=2, shuffle=True,
                        collate_fn=PaddingCollator(PAD))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loop = LoopConfig(num_train_epochs=2, lr_scheduler_type="cosine", warmup_ratio=0.1, disable_tqdm=True,
                      output_dir=out, save_steps=1, rampup_batch_size="auto", rampup_auto=EAGER)
    changed: list[int] = []

    def on_update(update: UpdateLog) -> None:
        if "--kill-after-first-change" in flags and changed and update.step == changed[0] + 1:
            os.kill(os.getpid(), signal.SIGKILL)  # its checkpoint is written: the resume starts after it
        if update.batch_change:
            changed.append(update.step)

    result = train(model, optimizer, loader, accelerator, loop, on_update=on_update,
                   resume_from_checkpoint=True if "--resume" in flags else None)
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    torch.save({"sequences": [u.sequences for u in result.updates],
                "learning_rates": [u.learning_rate for u in result.updates],
                "losses": [u.loss for u in result.updates], "weights": weights}, os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    leave_process_group()  # one process, no group: a no-op (every worker script ends so, tests/distributed)
