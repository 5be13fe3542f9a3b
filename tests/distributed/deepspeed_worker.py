"""torchrun worker (2 CPU processes, DeepSpeed's CPU accelerator): DeepSpeed ZeRO-2 and ZeRO-3 under
both engines, all in one launch as a job table (:mod:`hf_accum.testing.jobs`; DeepSpeed's start-up dominates).
Rank 0 writes ``{job: {"result": ..., "fused_log": ...}}`` to ``argv[1]``; tests/distributed/conftest.py
(``deepspeed_report``) hands the tests each job's result.

* exactness: fp32 tiny Llama, SGD(lr 1, no momentum) on a linear schedule, uneven lengths, prompt
  masking, rank 0 holding ~10x the tokens of rank 1, short last windows; every update's weight
  delta against the independently computed big-batch update (:mod:`hf_accum.testing.deltas`);
  the naive loop (the model's mean loss per micro-batch) under ZeRO-2 as the negative control;
* saving: LoRA adapters after 10 AdamW updates under ZeRO-3 and under DDP, same config and seed,
  both engines (saved with :func:`hf_accum.distributed.save_pretrained`, and Trainer's own
  ``save_model`` for the Trainer under ZeRO-3).
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader
from transformers import TrainerCallback
from transformers.integrations import unset_hf_deepspeed_config

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import (
    gathered_state_dict,
    leave_process_group,
    save_pretrained,
    skip_deepspeed_inference_comm_build,
)
from hf_accum.loop import LoopConfig, train
from hf_accum.planning.schedule import create_update_scheduler
from hf_accum.recipe.launch import check_launch, loop_accelerator
from hf_accum.testing import PAD, Scenario, fresh_accelerator, training_args
from hf_accum.testing.cases.deepspeed_case import (
    ACCUMULATION,
    EPOCHS,
    LR,
    MICRO_BATCH,
    examples,
    fp32_model,
    lora_model,
)
from hf_accum.testing.deltas import DeltaRecorder, delta_errors
from hf_accum.testing.jobs import run_job_table
from hf_accum.testing.logs import CapturedLog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAVE_UPDATES = 10


def ds_config(stage: int | str):
    """recipes/deepspeed/zero{stage}.json; ``"3_offload"``: ZeRO-3 with CPU offload, stepping the torch
    optimizer itself (DeepSpeed would otherwise swap SGD for its CPU Adam)."""
    path = os.path.join(ROOT, "recipes", "deepspeed", f"zero{stage}.json")
    if stage != "3_offload":
        return path
    with open(path) as handle:
        return {**json.load(handle), "zero_force_ds_cpu_optimizer": False}


def reset_accelerate() -> None:
    """Each run builds its own Accelerator; DeepSpeed's traces (env flag, ZeRO-3 weakref) must not leak."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    unset_hf_deepspeed_config()


def training_section(stage: int | str | None, max_grad_norm: float) -> dict:
    section = {"per_device_train_batch_size": MICRO_BATCH, "gradient_accumulation_steps": ACCUMULATION,
               "max_grad_norm": max_grad_norm}
    if stage is not None:
        section["deepspeed"] = ds_config(stage)
    return section


def build_accelerator(stage: int | str | None, max_grad_norm: float):
    """The loop engine's Accelerator as the recipe builds it: check_launch -> loop_accelerator (-> check_engine)."""
    reset_accelerate()
    if stage is None:
        return fresh_accelerator(ACCUMULATION)
    launch = check_launch(training_section(stage, max_grad_norm))
    return loop_accelerator(launch, ACCUMULATION, max_grad_norm, use_cpu=True)


def engine_facts(accelerator) -> dict:
    engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return {
        "distributed_type": str(accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
        "zero_stage": engine.engine.zero_optimization_stage() if engine is not None else None,
        "engine_accumulation_steps": engine.engine.gradient_accumulation_steps() if engine is not None else None,
        "offload": _offload_devices(engine.engine) if engine is not None else None,
    }


def _offload_devices(engine) -> list[str]:
    return [str(getattr(config, "device", "none")).split(".")[-1]
            for config in (engine.zero_offload_param(), engine.zero_offload_optimizer())]


class AppliedLRs:
    """The LR of each update, read where it is applied: in the torch optimizer's own ``step`` (ZeRO calls
    it on its flat fp32 partitions, once per parameter group)."""

    def __init__(self) -> None:
        self.per_update: list[list[float]] = []
        self._pending: list[float] = []

    def hook(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(lambda opt, a, k: self._pending.append(float(opt.param_groups[0]["lr"])))

    def close_update(self) -> None:
        self.per_update.append(self._pending)
        self._pending = []


# -- exactness: weight deltas of SGD lr 1 -----------------------------------------------------------


def exact_loop(stage: int | str, naive: bool = False, schedule: str = "linear", fused_loss: bool = True,
               **windows) -> dict:
    """``windows``: ``rampup_batch_size`` / ``tokens_per_update`` for planned windows (LoopConfig fields).
    ``schedule="constant"`` keeps every weight delta large: a decayed LR's tiny delta is measured in fp32 with
    a relative error growing as the LR shrinks (the LR horizon of planned windows is tested in the loop's tests)."""
    accelerator = build_accelerator(stage, max_grad_norm=0.0)
    model = fp32_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = DeltaRecorder(PaddingCollator(PAD))
    recorder.watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
    rates = AppliedLRs()
    rates.hook(optimizer)
    loader = DataLoader(examples(), batch_size=MICRO_BATCH, shuffle=False, collate_fn=recorder.collate)
    engine, prepared_optimizer, loader = accelerator.prepare(model, optimizer, loader)
    schedulers = []

    def scheduler_factory(opt, total):
        schedulers.append(create_update_scheduler(opt, total, schedule))
        return schedulers[-1]

    def on_update(_update=None):
        rates.close_update()
        recorder.record_update(model)

    if naive:
        scheduler_steps = naive_ds_loop(engine, loader, accelerator, scheduler_factory, prepared_optimizer, on_update)
        logged = []
    else:
        config = LoopConfig(num_train_epochs=EPOCHS, lr_scheduler_type="linear", max_grad_norm=0.0, disable_tqdm=True,
                            fused_loss=fused_loss, **windows)
        result = train(engine, prepared_optimizer, loader, accelerator, config, lr_scheduler=scheduler_factory,
                       on_update=on_update)
        scheduler_steps = schedulers[0].last_epoch
        logged = [u.learning_rate for u in result.updates]
    horizon = len(logged) if windows else EPOCHS * 3  # planned windows: the horizon is the updates planned
    return report_deltas(recorder, initial, rates, scheduler_steps, logged, engine_facts(accelerator), horizon,
                         schedule)


def naive_ds_loop(engine, loader, accelerator, scheduler_factory, optimizer, on_update) -> int:
    """The textbook loop: the model's mean loss per micro-batch, DeepSpeed's own 1/K, no token count."""
    scheduler = scheduler_factory(optimizer, EPOCHS * 3)
    engine.train()
    for _ in range(EPOCHS):
        for batch in loader:
            with accelerator.accumulate(engine):
                accelerator.backward(engine(**batch, use_cache=False).loss)
                if accelerator.sync_gradients:
                    scheduler.step()
                    on_update()
    return scheduler.last_epoch


def loop_window_without_targets(stage: int) -> dict:
    """The first window (3 micro-batches on each rank) has every label masked: the loop must skip it
    whole under DeepSpeed -- no engine step, no scheduler step, weights untouched."""
    accelerator = build_accelerator(stage, max_grad_norm=0.0)
    rows = examples()
    for row in rows[: MICRO_BATCH * ACCUMULATION * 2]:
        row["prompt_length"] = len(row["input_ids"])
    model = fp32_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
    loader = DataLoader(rows, batch_size=MICRO_BATCH, shuffle=False, collate_fn=PaddingCollator(PAD))
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    schedulers = []

    def scheduler_factory(opt, total):
        schedulers.append(create_update_scheduler(opt, total, "linear"))
        return schedulers[-1]

    moved = []

    def on_update(update):
        weights = gathered_state_dict(model)
        moved.append(max(float((weights[k] - initial[k]).abs().max()) for k in initial))

    config = LoopConfig(num_train_epochs=1, lr_scheduler_type="linear", max_grad_norm=0.0, disable_tqdm=True)
    result = train(engine, optimizer, loader, accelerator, config, lr_scheduler=scheduler_factory, on_update=on_update)
    return {"applied": [u.applied for u in result.updates], "targets": [u.targets for u in result.updates],
            "skip_reasons": [u.skip_reason for u in result.updates], "moved": moved,
            "scheduler_steps": schedulers[0].last_epoch}


class RecordUpdates(TrainerCallback):
    """Hooks the torch optimizer DeepSpeed steps (Trainer builds it under DeepSpeed) and records every update."""

    def __init__(self, recorder: DeltaRecorder):
        self.recorder = recorder
        self.rates = AppliedLRs()

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        while not isinstance(optimizer, torch.optim.SGD):  # Accelerate's wrapper -> ZeRO's -> torch's
            optimizer = optimizer.optimizer
        self.rates.hook(optimizer)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.rates.close_update()
        self.recorder.record_update(model)


def exact_trainer(stage: int) -> dict:
    reset_accelerate()
    model = fp32_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = DeltaRecorder(PaddingCollator(PAD))
    recorder.watch(model)
    callback = RecordUpdates(recorder)
    scenario = Scenario("zero", fp32_model, examples(), recorder.collate, micro_batch=MICRO_BATCH,
                        accumulation=ACCUMULATION, epochs=EPOCHS, lr=LR, scheduler="linear")
    out = os.path.join(OUT_DIR, f"trainer_zero{stage}")
    # Under DeepSpeed, Trainer builds the optimizer itself (optim="sgd": torch SGD, momentum 0).
    args = training_args(scenario, out, deepspeed=ds_config(stage), max_grad_norm=0.0, optim="sgd")
    trainer = AccumTrainer(model=model, args=args, train_dataset=scenario.examples, data_collator=recorder.collate,
                           callbacks=[callback])
    trainer.train()
    scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
    report = report_deltas(recorder, initial, callback.rates, scheduler.last_epoch, [],
                           engine_facts(trainer.accelerator))
    report["plan"] = trainer.batch_plan.describe()
    return report


def report_deltas(recorder, initial, rates: AppliedLRs, scheduler_steps, logged_lrs, facts,
                  horizon: int = EPOCHS * 3, schedule: str = "linear") -> dict:
    errors = delta_errors(fp32_model, initial, recorder, expected_lrs(len(recorder.weights), horizon, schedule)) \
        if is_main() else []
    return {"errors": errors, "applied_lrs": rates.per_update, "logged_lrs": logged_lrs,
            "scheduler_steps": scheduler_steps, "updates": len(rates.per_update),
            "targets": [sum(int((b["labels"][:, 1:] != -100).sum()) for b in w) for w in recorder.windows], **facts}


def expected_lrs(updates: int, horizon: int = EPOCHS * 3, schedule: str = "linear") -> list[float]:
    from hf_accum.testing import big_batch_learning_rates

    return big_batch_learning_rates(LR, horizon, 0, schedule)[:updates]


# -- saving: ZeRO-3 adapter == DDP adapter -------------------------------------------------------------


def saved_loop_adapter(stage: int | None) -> str:
    accelerator = build_accelerator(stage, max_grad_norm=1.0)
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    loader = DataLoader(examples(), batch_size=MICRO_BATCH, shuffle=False, collate_fn=PaddingCollator(PAD))
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(max_steps=SAVE_UPDATES, lr_scheduler_type="linear", max_grad_norm=1.0, disable_tqdm=True)
    result = train(engine, optimizer, loader, accelerator, config)
    assert len(result.updates) == SAVE_UPDATES
    directory = os.path.join(OUT_DIR, f"loop_{backend_name(stage)}_adapter")
    save_pretrained(accelerator.unwrap_model(engine), directory, accelerator.is_main_process)
    dist.barrier()
    return directory


def saved_trainer_adapters(stage: int | None) -> dict[str, str]:
    reset_accelerate()
    model = lora_model()
    scenario = Scenario("save", lora_model, examples(), PaddingCollator(PAD), micro_batch=MICRO_BATCH,
                        accumulation=ACCUMULATION, max_steps=SAVE_UPDATES, lr=1e-2, scheduler="linear",
                        max_grad_norm=1.0)
    out = os.path.join(OUT_DIR, f"trainer_{backend_name(stage)}")
    extra = {"deepspeed": ds_config(stage)} if stage is not None else {"ddp_find_unused_parameters": False}
    args = training_args(scenario, out, weight_decay=0.01, **extra)
    trainer = AccumTrainer(model=model, args=args, train_dataset=scenario.examples, data_collator=scenario.collator)
    trainer.train()
    assert trainer.state.global_step == SAVE_UPDATES
    saved = {"ours": os.path.join(out, "adapter")}
    save_pretrained(trainer.model, saved["ours"], trainer.accelerator.is_main_process)
    if stage is not None:
        saved["trainer_save_model"] = os.path.join(out, "save_model")
        trainer.save_model(saved["trainer_save_model"])
    dist.barrier()
    return saved


def backend_name(stage: int | None) -> str:
    return "ddp" if stage is None else f"zero{stage}"


def is_main() -> bool:
    return dist.get_rank() == 0


def with_fused_log(job: Callable[[], Any]) -> Callable[[str], dict]:
    """A job of the table: its result and what the fused loss decided in it."""

    def run(out_dir: str) -> dict:
        log = CapturedLog()
        try:
            result = job()
        finally:
            fused_log = log.remove()
        return {"result": result, "fused_log": fused_log}

    return run


JOBS = {name: with_fused_log(job) for name, job in {
    # DDP first: the DeepSpeed runs leave process-wide state behind (reset_accelerate undoes Accelerate's).
    "save_loop_ddp": lambda: saved_loop_adapter(None),
    "save_trainer_ddp": lambda: saved_trainer_adapters(None),
    "loop_zero2": lambda: exact_loop(2),
    "loop_zero3": lambda: exact_loop(3),
    "loop_zero3_offload": lambda: exact_loop("3_offload"),
    "loop_zero3_logits": lambda: exact_loop(3, fused_loss=False),
    "naive_loop_zero2": lambda: exact_loop(2, naive=True),
    "loop_zero2_window_without_targets": lambda: loop_window_without_targets(2),
    # Planned windows (tests/distributed/test_deepspeed_windows.py): ramp 4 -> 8 -> 12 sequences, and a token budget.
    "loop_zero2_rampup": lambda: exact_loop(2, schedule="constant", rampup_batch_size=[4, 4, 16]),
    "loop_zero3_tokens": lambda: exact_loop(3, schedule="constant", tokens_per_update=150),
    "trainer_zero2": lambda: exact_trainer(2),
    "trainer_zero3": lambda: exact_trainer(3),
    "save_loop_zero3": lambda: saved_loop_adapter(3),
    "save_trainer_zero3": lambda: saved_trainer_adapters(3),
}.items()}

OUT_DIR = "."

if __name__ == "__main__":
    skip_deepspeed_inference_comm_build()  # as the recipe does: training never uses the op it would compile
    OUT_DIR = os.path.dirname(os.path.abspath(sys.argv[1]))
    only = set(sys.argv[2:])  # run a subset while debugging: names of the jobs
    run_job_table({name: job for name, job in JOBS.items() if not only or name in only}, sys.argv[1])
    leave_process_group()  # a no-op after run_job_table, which left the group
