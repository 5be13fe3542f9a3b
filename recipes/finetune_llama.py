"""Fine-tune a causal LM (LoRA, QLoRA or full) with exact gradient accumulation.

    accelerate launch recipes/finetune_llama.py                      # embedded CPU default
    accelerate launch recipes/finetune_llama.py --config recipes/configs/llama3_8b_lora.yaml \\
        --training.learning_rate 1e-4 training.max_steps=100         # YAML, then overrides
    torchrun --nproc_per_node 2 recipes/finetune_llama.py ...        # 2 CPU processes (gloo)

With no arguments it trains the embedded default (a tiny Llama, a word-level tokenizer and a
synthetic instruction dataset, all built in-process) and prints the held-out exact match
before and after. Outputs (adapter, resolved config, metrics JSON, loss/LR plot) go to
training.output_dir. The logic lives in hf_accum.recipe; this file is the order of the steps.
"""

import time

from hf_accum import recipe as R


def run(argv):
    times = {"start": time.time()}
    # 1. Config: defaults < YAML < command line; typed and validated before anything is loaded.
    config = R.prepare_config(argv)
    args = R.training_arguments(config)
    R.say("resolved config:\n" + config.to_yaml())
    R.warn_unused_training_keys(config)
    R.set_seed(args.seed)

    # 2. Tokenizer and data: chat template applied, loss on the answer only, truncation counted.
    tokenizer, data = R.load_tokenizer_and_data(config)

    # 3. Model: LoRA targets checked on a weightless skeleton, then weights, LoRA/QLoRA, checkpointing.
    R.check_model_fits_config(config, tokenizer)
    model = R.build_model(config, tokenizer)
    trainable = R.describe_trainable(model)

    # 4. Held-out metric, training with exact accumulation, metric again.
    before = R.evaluate(model, tokenizer, data, config)
    R.say(f"held-out exact match before training: {R.percent(before)}")
    R.say("batch plan: " + R.batch_plan(args).describe())
    engine = R.train_loop if config.engine == "loop" else R.train_trainer
    times["train_start"] = time.time()
    result = engine(model, tokenizer, data, config, args)
    times["train"] = time.time() - times["train_start"]
    after = R.evaluate(result.model, tokenizer, data, config)

    # 5. Outputs: adapter (or model), tokenizer, resolved config, metrics JSON, loss/LR plot.
    metrics = R.summarize_run(config, result, data, before, after, trainable, times)
    out = R.save_outputs(config, result.model, tokenizer, metrics)
    R.say(f"{len(result.updates)} updates logged in {times['train']:.0f}s; wall time {metrics['wall_seconds']:.0f}s")
    R.say(f"held-out exact match: before {R.percent(before)} -> after {R.percent(after)}  (outputs in {out})")
    R.barrier()
    return metrics


if __name__ == "__main__":
    raise SystemExit(R.run_cli(run))
