"""Fine-tune a causal LM (LoRA, QLoRA or full) with exact gradient accumulation.

    accelerate launch recipes/finetune_llama.py                      # embedded CPU default
    accelerate launch recipes/finetune_llama.py --config recipes/configs/llama3_8b_lora.yaml \\
        --training.learning_rate 1e-4 training.max_steps=100         # YAML, then overrides
    torchrun --nproc_per_node 2 recipes/finetune_llama.py ...        # 2 CPU processes (gloo)

With no arguments it trains the embedded default (a tiny Llama, a word-level tokenizer and a
synthetic instruction dataset, all built in-process) and prints the held-out exact match before
and after. Outputs (adapter, resolved config, metrics JSON, loss/LR plot) go to training.output_dir.

This file is the training, top to bottom: config -> tokenizer and data -> model -> one of two
engines (the table ENGINES below) -> evaluation -> outputs. Copy it to make your own recipe; the
helpers it calls stay in the recipe kit, hf_accum.recipe (config, data, modeling, launch, held_out,
outputs).
"""

import sys
import time
from dataclasses import asdict

START = time.time()  # wall time counts the imports too

from hf_accum.recipe.command_line import announce_start, keys_request, lean_start  # noqa: E402

if __name__ == "__main__":
    announce_start(sys.argv[1:])  # the imports below take seconds, tens of them on a busy machine
lean_start(sys.argv[1:])  # before PEFT is imported: no bitsandbytes unless the run quantizes (hf_accum.startup)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import set_seed  # noqa: E402

from hf_accum import AccumTrainer, LoopConfig, train  # noqa: E402
from hf_accum.batching import PackingCollator, PaddingCollator  # noqa: E402
from hf_accum.control import NonFiniteLossError, TrainingStopped  # noqa: E402
from hf_accum.distributed import leave_process_group  # noqa: E402
from hf_accum.recipe.checks import load_recipe_config  # noqa: E402
from hf_accum.recipe.config import valid_keys  # noqa: E402
from hf_accum.planning.auto_ramp import describe_auto_plan, is_auto  # noqa: E402
from hf_accum.planning.schedule import BatchPlan  # noqa: E402
from hf_accum.recipe.data import load_tokenizer_and_data  # noqa: E402
from hf_accum.recipe.held_out import evaluate, score_before_training  # noqa: E402
from hf_accum.recipe.launch import (  # noqa: E402
    check_engine, check_launch, check_offload_optimizer, fsdp_training_arguments, launch_line, loop_accelerator,
    loop_fsdp_options, start_process_group,
)
from hf_accum.recipe.adapter_source import provenance as adapter_provenance  # noqa: E402
from hf_accum.recipe.modeling import build_model, trainable_summary  # noqa: E402
from hf_accum.recipe.preference import Objective, dpo_objective  # noqa: E402
from hf_accum.recipe.grpo import grpo_objective  # noqa: E402
from hf_accum.recipe.outputs import (  # noqa: E402
    RunRecord, barrier, check_output_dir, claim_output_dir, describe_trainable, disk_full_is_one_line, percent,
    probe_writable, quiet_third_party_warnings, run_cli, save_eval_before, save_outputs, say,
)
from hf_accum.recipe.progress import launcher_defaults_note, ticking  # noqa: E402
from hf_accum.recipe.resume import check_resume_fits, checkpoint_step, resume_checkpoint  # noqa: E402
from hf_accum.measure.peak_memory import describe as describe_peak_memory, largest_over_ranks, peak_memory  # noqa: E402
from hf_accum.checkpointing.run_lock import run_lock  # noqa: E402


# ----------------------------------------------------------------------------------------------
# The two engines. Each trains `model` and returns (model, batch plan); both hand every optimizer
# update (hf_accum.UpdateLog: its exact per-token loss, tokens, LR, grad norm, held-out loss when
# evaluated) to `record`, and report to the trackers of training.report_to.
# ----------------------------------------------------------------------------------------------


def train_with_loop(model, tokenizer, data, collator, args, record, resume, launch, loss_sum_fn=None):
    """hf_accum.train on Accelerate: accumulate() with a summed loss and one W/N rescale per update
    (under DeepSpeed: the window counted first, the loss scaled before backward). ``loss_sum_fn``: a
    (sum, count) loss other than the token loss (objective dpo: one per pair)."""
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    if is_auto(record.config.accumulation.rampup_batch_size):  # what the batch controller will do
        say(describe_auto_plan(record.config.accumulation.rampup_auto, BatchPlan(args.per_device_train_batch_size,
            args.gradient_accumulation_steps, args.world_size), len(data.train.examples), args.num_train_epochs))
    if launch.backend in ("deepspeed", "fsdp"):  # Accelerate on CPU would drop both: built for them
        accelerator = loop_accelerator(
            launch, args.gradient_accumulation_steps, args.max_grad_norm, precision, args.use_cpu,
            fsdp=loop_fsdp_options(args) if launch.backend == "fsdp" else None,
        )
    else:
        accelerator = Accelerator(
            gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=precision,
            cpu=args.use_cpu, log_with=args.report_to or None, project_dir=args.output_dir,  # report_to: trackers
        )
        check_engine(accelerator, launch)  # every process the launcher started, no fewer
    shuffle = torch.Generator().manual_seed(args.data_seed if args.data_seed is not None else args.seed)
    loader = DataLoader(
        data.train.examples, batch_size=args.per_device_train_batch_size, shuffle=True, generator=shuffle,
        collate_fn=collator, num_workers=args.dataloader_num_workers,
    )
    # A disjoint held-out shard per rank, not prepared (even_batches would repeat examples).
    held_out = data.held_out.examples[args.process_index :: args.world_size] if data.held_out else []
    eval_loader = DataLoader(held_out, batch_size=args.per_device_eval_batch_size, collate_fn=collator)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, weight_decay=args.weight_decay,
    )
    check_offload_optimizer(optimizer, launch)
    # Not the scheduler: the loop builds it over the planned number of *updates*.
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.init_trackers(args.run_name or "hf_accum", config=record.config.to_flat_dict())

    def on_update(update):
        record.record_update(update)  # metrics.json keeps every update; a line every logging_steps
        accelerator.log(update.tracked(), step=update.step)  # every update to the trackers

    # Checkpoints every save_steps updates into output_dir (and on SIGTERM/SIGUSR1); resume exactly.
    result = train(
        model, optimizer, loader, accelerator,
        LoopConfig.from_training_arguments(args, accumulation=record.config.accumulation), on_update=on_update,
        eval_dataloader=eval_loader, resume_from_checkpoint=resume, loss_sum_fn=loss_sum_fn,
    )
    for tracker in accelerator.trackers:  # not end_training(): it destroys the process group, and the
        tracker.finish()                  # ZeRO-3 save and the final barriers below still need it
    record.updates = result.as_dicts()  # a resumed run's result holds the updates before the checkpoint too
    record.noise_scale_advice = result.noise_scale_advice
    record.utilization = result.utilization  # model FLOPs per update, FLOP/s, MFU
    return accelerator.unwrap_model(model), result.batch_plan


def train_with_trainer(model, tokenizer, data, collator, args, record, resume, launch):
    """hf_accum.AccumTrainer: the standard Trainer API (its report_to, eval_strategy, save_strategy...),
    exact normalization inside."""
    trainer = AccumTrainer(
        model=model, args=args, train_dataset=data.train.examples, data_collator=collator, processing_class=tokenizer,
        eval_dataset=data.held_out.examples if data.held_out else None,
        accumulation=record.config.accumulation,  # the recipe's section is AccumTrainer's settings (hf_accum.settings)
    )
    check_engine(trainer.accelerator, launch)  # what was asked is what runs (DeepSpeed, processes)
    trainer.train(resume_from_checkpoint=resume)
    record.updates = [asdict(update) for update in trainer.updates]  # a resumed run's include the earlier ones
    record.noise_scale_advice = trainer.noise_scale_advice
    record.utilization = trainer.utilization
    barrier()
    return trainer.model, trainer.batch_plan


# TrainingArguments fields the loop engine reads: LoopConfig's own, plus what train_with_loop uses.
LOOP_READS = LoopConfig.training_argument_names() | {
    "output_dir", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "seed", "data_seed", "bf16", "fp16", "use_cpu",
    "dataloader_num_workers", "logging_steps", "per_device_eval_batch_size", "report_to", "run_name",
    "activation_checkpointing", "gradient_checkpointing", "deepspeed", "resume_from_checkpoint", "fsdp", "fsdp_config",
}
# engine name -> (train function, the TrainingArguments fields it honours; None: all of them).
ENGINES = {
    "loop": (train_with_loop, LOOP_READS),
    "trainer": (train_with_trainer, None),
}


def data_facts(data) -> dict:
    held_out = len(data.held_out.examples) if data.held_out else 0
    return {"format": data.format, "train_examples": len(data.train.examples), "truncated": data.train.truncated,
            "dropped": data.train.dropped, "train_targets": data.train.targets, "held_out_examples": held_out,
            "eval_examples": len(data.eval_rows)}


def sft_collator(config, tokenizer):
    """Padding-free packing (one row per micro-batch, position_ids restarting per sequence) or right padding;
    both keep the loss on the answers only."""
    return PackingCollator() if config.data.packing else PaddingCollator(tokenizer.pad_token_id)


# objective -> what its steps do: data, collator, held-out metric, engines (DPO's: hf_accum.recipe.preference).
OBJECTIVES = {
    "sft": Objective("exact match", load_tokenizer_and_data, sft_collator, evaluate, percent, ENGINES),
    "dpo": dpo_objective(train_with_loop, LOOP_READS),
    "grpo": grpo_objective(evaluate, sft_collator, percent),  # trainer engine only: hf_accum.recipe.grpo
}


def main(argv):
    if (section := keys_request(argv)) is not None:  # --keys [SECTION]: the keys a config may set, one a line
        print("\n".join(valid_keys(section)))
        return None
    # 1. Config: built-in defaults < YAML < command line; typed and validated, nothing loaded yet.
    config = load_recipe_config(argv, engines=ENGINES, objectives=OBJECTIVES)
    # One run per output directory: its lock (rank 0 takes it for every rank) before anything there is read
    # or written, held to the end; a full disk ends in one line naming the last good checkpoint.
    out = config.training["output_dir"]
    probe_writable(out)  # a file in the way or a read-only place: one line, and nothing created
    with run_lock(out, "training.output_dir"), disk_full_is_one_line(out):
        return run(config)


def run(config):
    launch, args, state, resume = start(config)
    objective = OBJECTIVES[config.objective]
    train_engine = objective.engines[config.engine][0]
    record = RunRecord(config, started=START)
    announce_config(config, objective.engines[config.engine][1])

    # 2. Tokenizer and data: the format detected from the columns, chat template applied, labels -100
    #    outside the answers, a held-out split (given, or carved off), every bad row refused.
    set_seed(args.seed)
    say(f"reading {config.data.dataset} with the tokenizer of {config.model.name_or_path} ...")
    with ticking("reading data"):  # a GGUF tokenizer alone parses the whole file's metadata (seconds to a minute)
        tokenizer, data = objective.load_data(config.model, config.data)  # DPO: prompt/chosen/rejected pairs
    for line in data.report:
        say(line)
    collator = objective.collator(config, tokenizer)  # DPO: chosen rows, then rejected rows

    # 3. Model: LoRA targets checked on a weightless skeleton, then weights, LoRA/QLoRA, checkpointing.
    started_from = adapter_provenance(config)  # model.adapter: the run this one continues (None: a fresh adapter)
    say(f"loading model {config.model.name_or_path}"
        + (f", adapter from {started_from['adapter']}" if started_from else "") + " ...")
    with ticking("loading model"):
        model = build_model(config, tokenizer, seed=args.seed, model_checkpointing=launch.backend != "fsdp")
    record.facts["trainable"] = trainable_summary(model)
    record.facts["started_from"] = started_from
    say(describe_trainable(record.facts["trainable"]))

    # 4. Held-out metric (before training: once per output directory), training with exact accumulation, again.
    before = score_before_training(objective, model, tokenizer, data, config, args, resuming=state == "resume")
    claim_output_dir(config)  # from here on, the directory is this run's (a re-run may resume it)
    if config.data.eval_before:
        save_eval_before(config, before)  # a resumed run reads it back instead of scoring the base model again
    record.resumed_at = checkpoint_step(resume)  # the updates before it were trained by an earlier process
    train_start = time.time()
    model, plan = train_engine(model, tokenizer, data, collator, args, record, resume, launch)
    train_seconds = time.time() - train_start
    after = objective.evaluate(model, tokenizer, data, config, args, "after training")

    # 5. Outputs: adapter (or model) + tokenizer, loss/LR plot, metrics.json (written last: finished).
    peak = largest_over_ranks(peak_memory(args.device))  # every rank: a collective
    record.add_result(plan, eval_before=before, eval_after=after, train_seconds=train_seconds, data=data_facts(data),
                      peak_memory=peak)
    out = save_outputs(record, model, tokenizer)
    unit = {"dpo": "pairs", "grpo": "completion tokens"}.get(config.objective, "tokens")  # what targets count
    say(f"{record.trained_line(train_seconds, unit)}; wall time {record.wall_seconds:.0f} s "
        f"(from process start); {describe_peak_memory(peak)}")
    say(record.utilization_line())  # model FLOPs per update, achieved FLOP/s, MFU against the device's peak
    say(f"held-out {objective.metric}: before {objective.score(before)} -> after {objective.score(after)}  "
        f"(outputs in {out})")
    if record.noise_scale_advice:
        say(record.noise_scale_advice)  # accumulation.noise_scale: the measured critical batch vs this run's
    leave_process_group()
    return record.metrics()


def start(config):
    """1b. Launch: what was asked checked against what would run, the TrainingArguments, the process group, and the
    checkpoint this run resumes (None: a fresh start)."""
    launch = check_launch(config.training)  # no silent fallback (FSDP on CPU, fewer processes...)
    given, out = config.training.get("resume_from_checkpoint"), config.training["output_dir"]
    state = check_output_dir(config, resume=bool(given))  # another run's directory, a finished run: refused
    # Activation checkpointing is set up on the model below (before PEFT wraps it): not by Trainer again.
    # The loop engine builds its own DeepSpeed Accelerator (train_with_loop): TrainingArguments must not.
    # Under FSDP, activation checkpointing goes through FSDP's plugin (fsdp_config), not the model.
    args = config.training_arguments(activation_checkpointing=False, gradient_checkpointing=None,
                                     resume_from_checkpoint=None,
                                     deepspeed=config.training.get("deepspeed") if config.engine == "trainer" else None,
                                     **fsdp_training_arguments(config.training, launch))
    start_process_group(args, launch)  # before any model load (a quantized one, ZeRO-3's zero.Init)
    say(f"engine {config.engine}: {launch_line(args, launch)}")
    precision = ("bf16 mixed precision, training.bf16" if args.bf16 else "fp16 mixed precision, training.fp16"
                 if args.fp16 else f"no mixed precision, weights in {config.model.dtype}")
    if note := launcher_defaults_note(precision):
        say(note)  # after accelerate launch's own warning that it used defaults (it prints before this process)
    resume = resume_checkpoint(given, out, state)  # None: a fresh start; rank 0 verifies, every rank decides alike
    check_resume_fits(resume, args, deepspeed=launch.backend == "deepspeed")  # batch arithmetic, engine files
    return launch, args, state, resume


def announce_config(config, honoured):
    """The resolved config, the notes its validation left, and the training keys this engine ignores
    (``honoured``: the ``TrainingArguments`` fields it reads; None: all)."""
    say("resolved config:\n" + config.to_yaml())
    for note in config.notes:
        say(f"note: {note}")
    if honoured is not None and set(config.training) - honoured:
        say(f"note: engine {config.engine!r} ignores training.{', training.'.join(sorted(set(config.training) - honoured))}")


if __name__ == "__main__":
    quiet_third_party_warnings()
    # Every bad input (config, data, model, launch, a checkpoint that does not fit) is an InputError: exit 2.
    raise SystemExit(run_cli(main, stopped=(TrainingStopped, NonFiniteLossError)))
