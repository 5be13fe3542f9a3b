"""torchrun worker, the FSDP2 family (2 CPU processes, gloo): the loop engine under FSDP2 (``fully_shard`` through
Accelerate, :func:`hf_accum.fsdp.fsdp_accelerator`) and AccumTrainer under Trainer's own FSDP2
(``TrainingArguments(fsdp="full_shard")``), all in ONE launch as a job table (:mod:`hf_accum.testing.jobs`). Rank 0
writes ``{job: result}`` to ``argv[1]``; tests/distributed/test_fsdp.py and test_trainer_fsdp.py read their jobs
(conftest.py, ``fsdp_family``).

* exactness in float64 (full fine-tuning, LoRA, activation checkpointing): SGD (lr 6, no momentum) on a
  linear schedule, uneven lengths, prompt masking, rank 0 holding ~10x the tokens of rank 1, short last
  windows; every update's weight delta against the independently computed big-batch update
  (:mod:`hf_accum.testing.deltas`); gradient reduce-scatters counted per update;
* the naive loop (the model's mean loss per micro-batch, Accelerate's 1/K) under FSDP2: the negative control;
* clipping: FSDP2 and DDP runs with an active ``max_grad_norm`` log the same global norms and end with the
  same weights (a per-shard norm would differ);
* bf16 compute with fp32 master weights and fp32 gradient reduction against DDP's bf16 autocast run;
* ``trainer_*``: AccumTrainer given ``fsdp="full_shard"`` (full fine-tuning, LoRA; where Accelerate alone would
  silently train DDP), every update's delta against the big batch in float64; the stock Trainer given the same
  arguments (it runs DDP on CPU): the negative control; FSDP1 refused.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import logging
import os
import sys

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import gathered_state_dict, leave_process_group
from hf_accum.fsdp import fsdp2_plugin, fsdp_accelerator
from hf_accum.loop import LoopConfig, train
from hf_accum.planning.schedule import create_update_scheduler
from hf_accum.testing import PAD, big_batch_learning_rates, random_rows, tiny_causal_lm
from hf_accum.testing.deltas import DeltaRecorder, delta_errors
from hf_accum.testing.jobs import run_job_table
from hf_accum.testing.logs import CapturedLog

MICRO_BATCH, ACCUMULATION, EXAMPLES, EPOCHS = 2, 3, 28, 2
UPDATES = 6  # per epoch: windows of 3, 3 and 1 micro-batches per rank
LR = 6.0
LAYER = ["LlamaDecoderLayer"]


def examples() -> list[dict]:
    # Micro-batch j goes to rank j % 2: rows 4m, 4m+1 (40 tokens) to rank 0, rows 4m+2, 4m+3 (3-5 tokens) to rank 1.
    return random_rows(EXAMPLES, seed=11, prompt_masking=True, long_rows=lambda i: (i // MICRO_BATCH) % 2 == 0)


def reset_accelerate() -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def accelerator_for(engine: str, **plugin_options):
    reset_accelerate()
    if engine == "ddp":
        from accelerate import Accelerator

        mixed = plugin_options.pop("mixed_precision", "no")
        return Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION, mixed_precision=mixed)
    return fsdp_accelerator(fsdp2_plugin(LAYER, **plugin_options), ACCUMULATION, cpu=True)


def lora(model: torch.nn.Module, train_head: bool = False) -> torch.nn.Module:
    """LoRA on q/v; ``train_head``: the output layer trained too (PEFT ``modules_to_save``, its own FSDP unit)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                        modules_to_save=["lm_head"] if train_head else None)
    return get_peft_model(model, config).to(torch.float64)


class ReduceScatterCounter:
    """Counts gradient reduce-scatters (FSDP2 issues one per sharded unit per gradient sync, through
    ``dist.reduce_scatter_single`` in torch 2.13)."""

    NAME = "reduce_scatter_single"

    def __init__(self) -> None:
        self.calls = 0
        self.per_update: list[int] = []
        original = getattr(dist, self.NAME)

        def counting(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        setattr(dist, self.NAME, counting)
        self._original = original

    def close_update(self) -> None:
        self.per_update.append(self.calls)
        self.calls = 0

    def remove(self) -> None:
        setattr(dist, self.NAME, self._original)


def model_factory(kind: str):
    def build():
        model = tiny_causal_lm(seed=0, dtype=torch.float64)
        return lora(model, train_head=kind == "lora_head") if kind.startswith("lora") else model

    return build


def exact_run(kind: str = "full", naive: bool = False, checkpointing: bool = False, fused_loss: bool = True) -> dict:
    """SGD deltas vs the big batch (float64). ``kind``: full (trainable head), lora (frozen head), lora_head
    (LoRA + a trainable head through PEFT's modules_to_save)."""
    accelerator = accelerator_for("fsdp", activation_checkpointing=checkpointing)
    factory = model_factory(kind)
    model = factory()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = DeltaRecorder(PaddingCollator(PAD))
    recorder.watch(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.0)
    loader = DataLoader(examples(), batch_size=MICRO_BATCH, shuffle=False, collate_fn=recorder.collate)
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    counter = ReduceScatterCounter()
    fused_log = CapturedLog()

    def on_update(_update=None):
        counter.close_update()
        recorder.record_update(prepared)

    try:
        if naive:
            scheduler = create_update_scheduler(optimizer, len(loader) * EPOCHS, "linear")
            _naive_with_records(prepared, optimizer, loader, accelerator, scheduler, on_update)
            logged = []
        else:
            config = LoopConfig(num_train_epochs=EPOCHS, lr_scheduler_type="linear", max_grad_norm=0.0,
                                disable_tqdm=True, fused_loss=fused_loss)
            result = train(prepared, optimizer, loader, accelerator, config, on_update=on_update)
            logged = [u.learning_rate for u in result.updates]
    finally:
        counter.remove()
        fused_lines = fused_log.remove()
    expected = big_batch_learning_rates(LR, UPDATES, 0, "linear")
    errors = delta_errors(factory, initial, recorder, expected, pad_token_id=PAD) if dist.get_rank() == 0 else []
    sharded = [type(p).__name__ for p in prepared.parameters()]
    units = sum(type(m).__name__.startswith("FSDP") for m in prepared.modules())
    checkpointed = sum(type(m).__name__.endswith("CheckpointWrapper") for m in prepared.modules())
    return {"errors": errors, "logged_lrs": logged, "expected_lrs": expected, "updates": len(recorder.weights),
            "reduce_scatters": counter.per_update, "fsdp_units": units, "checkpointed_layers": checkpointed,
            "distributed_type": accelerator.distributed_type.value,
            "all_dtensor": all(name == "DTensor" for name in sharded), "fused_log": fused_lines,
            "head_trainable": any(p.requires_grad for p in accelerator.unwrap_model(prepared)
                                  .get_output_embeddings().parameters())}


def _naive_with_records(model, optimizer, loader, accelerator, scheduler, on_update) -> None:
    model.train()
    for _ in range(EPOCHS):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch, use_cache=False).loss)
                if accelerator.sync_gradients:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                    on_update()


def clipped_run(engine: str) -> dict:
    """AdamW with an active clip: the logged (global) norms and the final weights."""
    accelerator = accelerator_for(engine)
    model = tiny_causal_lm(seed=0, dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(examples(), batch_size=MICRO_BATCH, shuffle=False, collate_fn=PaddingCollator(PAD))
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(num_train_epochs=EPOCHS, max_grad_norm=0.05, disable_tqdm=True)
    result = train(prepared, optimizer, loader, accelerator, config)
    weights = gathered_state_dict(prepared) if engine == "fsdp" else {
        k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(prepared).state_dict().items()}
    return {"grad_norms": [u.grad_norm for u in result.updates], "weights": weights}


def bf16_run(engine: str) -> dict:
    """fp32 master weights, bf16 compute: FSDP2's MixedPrecisionPolicy (fp32 reduce) vs DDP's bf16 autocast."""
    accelerator = accelerator_for(engine, **({"param_dtype": torch.bfloat16} if engine == "fsdp"
                                             else {"mixed_precision": "bf16"}))
    model = tiny_causal_lm(seed=0, dtype=torch.float32)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(examples(), batch_size=MICRO_BATCH, shuffle=False, collate_fn=PaddingCollator(PAD))
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    result = train(prepared, optimizer, loader, accelerator, LoopConfig(num_train_epochs=EPOCHS, disable_tqdm=True))
    weights = gathered_state_dict(prepared) if engine == "fsdp" else {
        k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(prepared).state_dict().items()}
    grads_fp32 = all(p.dtype == torch.float32 for p in prepared.parameters())
    return {"losses": [u.loss for u in result.updates], "weights": weights, "initial": initial,
            "master_weights_fp32": grads_fp32}


def dpo_fused_run() -> dict:
    """DPOPairLoss (sigmoid + sft) with fused log-probs under FSDP2 -- read inside the gathered head's forward,
    recomputed in backward -- against the logits path of an unsharded copy, one micro-batch of 5 pairs (every rank
    the same pairs: FSDP2's rank-averaged gradient is that micro-batch's gradient)."""
    import copy

    from hf_accum.losses.preference import DPOPairLoss, collate_pairs
    from hf_accum.testing.dpo_reference import pair_features, with_reference_logps

    accelerator = accelerator_for("fsdp")
    model = tiny_causal_lm(seed=0, dtype=torch.float64)
    unsharded = copy.deepcopy(model)
    batch = collate_pairs(with_reference_logps(pair_features(5, seed=4), unsharded), pad_token_id=PAD)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    gradients, fused_forwards = [], 0
    sharded, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))  # FSDP2: both together
    for network, fused in ((sharded, True), (unsharded, False)):
        network.train()
        loss = DPOPairLoss(beta=0.5, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], fused=fused)
        outputs = loss.run_forward(network, dict(inputs), batch["labels"])
        sums, counts = loss(outputs, batch["labels"], batch)
        (sums / counts).sum().backward()
        fused_forwards += loss.fused.forwards if loss.fused is not None else 0
        gradients.append({name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
                          for name, p in network.named_parameters()})
    sharded_grads, reference = gradients
    errors = [float((sharded_grads[name] - grad).norm() / grad.norm()) for name, grad in reference.items()]
    return {"max_error": max(errors), "parameters": len(errors), "fused_forwards": fused_forwards,
            "all_dtensor": all(type(p).__name__ == "DTensor" for p in sharded.parameters())}


def grpo_fused_run() -> dict:
    """A GRPO-style loss on fused per-token log-probs and entropies under FSDP2 (what AccumGRPOTrainer computes:
    FusedLogProbs.token_logps with a temperature, read inside the gathered head's forward), against the same loss
    from an unsharded copy's full logits: per completion token ``-exp(logp - logp.detach()) * A + beta * KL(ref)
    - c * entropy``, summed over the completion tokens and divided by their count (dapo's unit), float64."""
    import copy

    from hf_accum.fused.logprobs import FusedLogProbs

    accelerator = accelerator_for("fsdp")
    model = tiny_causal_lm(seed=0, dtype=torch.float64)
    unsharded = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(7)
    vocab = unsharded.config.vocab_size
    ids = torch.randint(3, vocab, (4, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded prompt
    targets = torch.full_like(ids, -100)
    targets[:, 5:-1] = ids[:, 6:]  # the completion: tokens 6.. are the targets of positions 5..
    targets[2, 9:] = -100  # a shorter completion
    advantages = torch.randn(4, 1, generator=generator, dtype=torch.float64)
    reference = torch.randn(4, 12, generator=generator, dtype=torch.float64) * 0.1 - 3.0
    temperature, beta, entropy_coef = 0.7, 0.04, 0.01
    is_target = targets.ne(-100)

    def loss_of(logps: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
        ratio = torch.exp(logps - logps.detach())
        kl = torch.exp(reference - logps) - (reference - logps) - 1
        per_token = -ratio * advantages + beta * kl - entropy_coef * entropies
        return per_token.masked_fill(~is_target, 0).sum() / is_target.sum()

    inputs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    sharded, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))  # FSDP2: both together
    fused = FusedLogProbs()
    sharded.train()
    result = fused.token_logps(sharded, dict(inputs), targets, temperature=temperature, entropy=True)
    assert result is not None and result.entropies is not None
    loss_of(result.logps, result.entropies).backward()
    unsharded.train()
    log_p = (unsharded(**inputs).logits / temperature).log_softmax(-1)
    logps = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    loss_of(logps, -(log_p.exp() * log_p).sum(-1)).backward()
    errors = []
    for p, q in zip(sharded.parameters(), unsharded.parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errors.append(float((grad.detach() - q.grad).norm() / q.grad.norm()))
    return {"max_error": max(errors), "parameters": len(errors), "fused_forwards": fused.forwards,
            "all_dtensor": all(type(p).__name__ == "DTensor" for p in sharded.parameters())}


def weight_difference(a: dict, b: dict) -> float:
    """max |a - b| / max |b| over every tensor both hold."""
    return max(float((a[k].double() - b[k].double()).abs().max()) / max(float(b[k].double().abs().max()), 1e-30)
               for k in b if k in a)


def movement_difference(run: dict, reference: dict) -> float:
    """|delta_run - delta_ref| / |delta_ref| over all weights: how far the bf16 runs' updates differ."""
    diff = norm = 0.0
    for name, start in reference["initial"].items():
        expected = reference["weights"][name].double() - start.double()
        diff += float((run["weights"][name].double() - start.double() - expected).pow(2).sum())
        norm += float(expected.pow(2).sum())
    return (diff / norm) ** 0.5


# -- AccumTrainer under Trainer's own FSDP2 ----------------------------------------------------------------


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
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": LAYER},
    )
    values.update(overrides)
    return TrainingArguments(**values)


def trainer_exact_run(out_dir: str, kind: str, trainer_cls=AccumTrainer, **overrides) -> dict:
    """SGD deltas vs the big batch (float64) of a Trainer given ``fsdp="full_shard"``; ``kind``: full or lora."""
    reset_accelerate()
    factory = model_factory(kind)
    model = factory()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = DeltaRecorder(PaddingCollator(PAD))
    recorder.watch(model)
    callback = _RecordUpdates(recorder)
    fused_log = CapturedLog()  # what the fused loss decided: inside the FSDP2-gathered head's forward
    try:
        trainer = trainer_cls(model=model, args=fsdp_args(os.path.join(out_dir, kind), **overrides),
                              train_dataset=examples(), data_collator=recorder.collate, callbacks=[callback])
        callback.trainer = trainer
        trainer.train()
    finally:
        fused_lines = fused_log.remove()
    expected = big_batch_learning_rates(LR, UPDATES, 0, "linear")
    errors = delta_errors(factory, initial, recorder, expected, pad_token_id=PAD) if dist.get_rank() == 0 else []
    return {"errors": errors, "updates": len(recorder.weights), "is_fsdp_enabled": trainer.is_fsdp_enabled,
            "distributed_type": trainer.accelerator.distributed_type.value, "fused_log": fused_lines,
            "all_dtensor": all(type(p).__name__ == "DTensor" for p in trainer.model.parameters())}


def refused_fsdp1(out_dir: str) -> str:
    reset_accelerate()
    try:
        AccumTrainer(model=tiny_causal_lm(), args=fsdp_args(out_dir, fsdp_config={"version": 1}),
                     train_dataset=examples(), data_collator=PaddingCollator(PAD))
    except Exception as error:  # noqa: BLE001 -- the message is the report
        return f"{type(error).__name__}: {error}"
    return ""


# -- the job table ----------------------------------------------------------------------------------------


def clip(out_dir: str) -> dict:
    clip_ddp, clip_fsdp = clipped_run("ddp"), clipped_run("fsdp")
    return {"ddp_norms": clip_ddp["grad_norms"], "fsdp_norms": clip_fsdp["grad_norms"],
            "weight_difference": weight_difference(clip_fsdp["weights"], clip_ddp["weights"])}


def bf16(out_dir: str) -> dict:
    bf16_ddp, bf16_fsdp = bf16_run("ddp"), bf16_run("fsdp")
    return {"ddp_losses": bf16_ddp["losses"], "fsdp_losses": bf16_fsdp["losses"],
            "movement_difference": movement_difference(bf16_fsdp, bf16_ddp),
            "master_weights_fp32": bf16_fsdp["master_weights_fp32"]}


JOBS = {
    "full": lambda out_dir: exact_run("full"),
    "lora": lambda out_dir: exact_run("lora"),
    "lora_head": lambda out_dir: exact_run("lora_head"),
    "logits_path": lambda out_dir: exact_run("full", fused_loss=False),
    "dpo_fused_logprobs": lambda out_dir: dpo_fused_run(),
    "grpo_fused_logprobs": lambda out_dir: grpo_fused_run(),
    "checkpointing": lambda out_dir: exact_run("full", checkpointing=True),
    "naive": lambda out_dir: exact_run("full", naive=True),
    "clip": clip,
    "bf16": bf16,
    # Trainer's own FSDP2 (``TrainingArguments(fsdp="full_shard")``); the stock Trainer given the same arguments
    # runs DDP on CPU (``average_tokens_across_devices=False``): the negative control.
    "trainer_full": lambda out_dir: trainer_exact_run(out_dir, "full"),
    "trainer_lora": lambda out_dir: trainer_exact_run(out_dir, "lora"),
    "trainer_stock": lambda out_dir: trainer_exact_run(out_dir, "full", Trainer, average_tokens_across_devices=False),
    "trainer_fsdp1": refused_fsdp1,
}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("transformers.trainer").setLevel(logging.WARNING)
    dist.init_process_group("gloo")
    run_job_table(JOBS, sys.argv[1])
    leave_process_group()  # a no-op after run_job_table, which left the group
