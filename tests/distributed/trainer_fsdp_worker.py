"""torchrun worker (2 CPU processes, gloo): ``AccumTrainer`` under ``Trainer``'s own FSDP2
(``TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2, ...})``), which on CPU runs through
:meth:`hf_accum.AccumTrainer.create_accelerator_and_postprocess` (Accelerate alone would train DDP).
All runs share one launch; rank 0 writes a JSON report to ``argv[1]``.

* exactness in float64 (full fine-tuning, LoRA): SGD (lr 6) on a linear schedule, prompt masking, rank 0
  holding ~10x the tokens of rank 1, windows of 3, 3 and 1 micro-batches; every update's weight delta
  against the independently computed big-batch update (:mod:`hf_accum.testing.deltas`);
* stock ``Trainer`` under the same FSDP2 (``average_tokens_across_devices=False``): the negative control.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, big_batch_learning_rates, random_rows, tiny_causal_lm
from hf_accum.testing.deltas import DeltaRecorder, delta_errors
from hf_accum.testing.logs import CapturedLog

MICRO_BATCH, ACCUMULATION, EXAMPLES, EPOCHS = 2, 3, 28, 2
UPDATES = 6  # windows of 3, 3 and 1 micro-batches per rank, 2 epochs
LR = 6.0


def examples() -> list[dict]:
    # Micro-batch j goes to rank j % 2: rows 4m, 4m+1 (40 tokens) to rank 0, rows 4m+2, 4m+3 (3-5 tokens) to rank 1.
    return random_rows(EXAMPLES, seed=11, prompt_masking=True, long_rows=lambda i: (i // MICRO_BATCH) % 2 == 0)


def model_factory(kind: str):
    def build():
        model = tiny_causal_lm(seed=0, dtype=torch.float64)
        if kind != "lora":
            return model
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return get_peft_model(model, config).to(torch.float64)

    return build


class _RecordUpdates(TrainerCallback):
    def __init__(self, recorder: DeltaRecorder) -> None:
        self.recorder = recorder
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        self.recorder.record_update(self.trainer.model)  # a collective: every rank


def fsdp_args(output_dir: str, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=output_dir, per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=ACCUMULATION,
        num_train_epochs=EPOCHS, learning_rate=LR, optim="sgd", weight_decay=0.0, lr_scheduler_type="linear",
        max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        remove_unused_columns=False, train_sampling_strategy="sequential", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, fsdp="full_shard",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    values.update(overrides)
    return TrainingArguments(**values)


def exact_run(out_dir: str, kind: str, trainer_cls=AccumTrainer, **overrides) -> dict:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    factory = model_factory(kind)
    model = factory()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = DeltaRecorder(PaddingCollator(PAD))
    recorder.watch(model)
    callback = _RecordUpdates(recorder)
    trainer = trainer_cls(model=model, args=fsdp_args(os.path.join(out_dir, kind), **overrides),
                          train_dataset=examples(), data_collator=recorder.collate, callbacks=[callback])
    callback.trainer = trainer
    trainer.train()
    expected = big_batch_learning_rates(LR, UPDATES, 0, "linear")
    errors = delta_errors(factory, initial, recorder, expected, pad_token_id=PAD) if dist.get_rank() == 0 else []
    return {"errors": errors, "updates": len(recorder.weights), "is_fsdp_enabled": trainer.is_fsdp_enabled,
            "distributed_type": trainer.accelerator.distributed_type.value,
            "all_dtensor": all(type(p).__name__ == "DTensor" for p in trainer.model.parameters())}


def refused_fsdp1(out_dir: str) -> str:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        AccumTrainer(model=tiny_causal_lm(), args=fsdp_args(out_dir, fsdp_config={"version": 1}),
                     train_dataset=examples(), data_collator=PaddingCollator(PAD))
    except Exception as error:  # noqa: BLE001 -- the message is the report
        return f"{type(error).__name__}: {error}"
    return ""


def main(report_path: str) -> None:
    logging.getLogger("transformers.trainer").setLevel(logging.WARNING)
    out_dir = os.path.dirname(report_path)
    report: dict = {"world_size": int(os.environ["WORLD_SIZE"])}
    log = CapturedLog()  # what the fused loss decided: inside the FSDP2-gathered head's forward
    report["full"] = exact_run(out_dir, "full")
    report["full_fused_log"] = log.remove()
    log = CapturedLog()
    report["lora"] = exact_run(out_dir, "lora")
    report["lora_fused_log"] = log.remove()
    report["stock"] = exact_run(out_dir, "stock_full", Trainer, average_tokens_across_devices=False)
    report["fsdp1"] = refused_fsdp1(os.path.join(out_dir, "fsdp1"))
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
