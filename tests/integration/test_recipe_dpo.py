"""``objective: dpo`` in the recipe: preference formats and their refusals, the pair encoding's label mask, the
``dpo`` section's refusals (exit 2 before any model loads), the reference log-probs (adapter disabled, cached,
reused, invalidated), and both engines end to end on the embedded preference task."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from hf_accum.losses.token_loss import IGNORE_INDEX
from hf_accum.recipe import checks, embedded
from hf_accum.recipe import config as recipe_config
from hf_accum.recipe.data import DataError
from hf_accum.recipe.data.preference import labelled, load_preference_data
from hf_accum.recipe.data.splits import load_splits
from hf_accum.recipe.testing import ROOT, read_metrics, recipe_arguments, run_main


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def data_section(path, **values):
    return recipe_config.DataSection(dataset=str(path), eval_fraction=0.0, **values)


def load_pairs(path, **values):
    return load_preference_data(recipe_config.ModelSection(), data_section(path, **values))


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# -- formats -------------------------------------------------------------------------------------------------------


def test_the_preference_formats_are_detected_strings_messages_and_an_implicit_prompt(tmp_path):
    explicit = [{"prompt": "say hi", "chosen": "hi", "rejected": "bye"}]
    conversational = [{"prompt": [user("say hi")], "chosen": [assistant("hi")], "rejected": [assistant("bye")]}]
    implicit = [{"chosen": [user("say hi"), assistant("hi")], "rejected": [user("say hi"), assistant("bye")]}]
    for name, rows, fmt in (("e", explicit, "preference"), ("c", conversational, "preference"),
                            ("i", implicit, "preference_implicit")):
        splits = load_splits(data_section(write_rows(tmp_path / f"{name}.jsonl", rows)), formats=("preference",
                                                                                                  "preference_implicit"))
        assert splits.format.name == fmt
        (example,) = splits.train
        assert example.messages == [user("say hi"), assistant("hi")] and example.rejected == assistant("bye")


def test_sft_on_preference_data_says_objective_dpo_and_dpo_on_sft_data_names_the_preference_columns(tmp_path):
    pairs = write_rows(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataError, match="looks like preference data .*objective=dpo"):
        load_splits(data_section(pairs))
    sft = write_rows(tmp_path / "s.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match="objective=dpo needs preference data.*'prompt' \\+ 'chosen' \\+ 'rejected'"):
        load_pairs(sft)


@pytest.mark.parametrize("bad, detail", [
    ({"prompt": "a", "chosen": "b"}, "no 'rejected' field"),
    ({"prompt": "a", "chosen": "b", "rejected": None}, "'rejected' is null"),
    ({"prompt": "a", "chosen": "  ", "rejected": "c"}, "'chosen' is empty"),
    ({"prompt": "a", "chosen": [assistant("b"), assistant("c")], "rejected": "c"}, "'chosen' holds 2 messages"),
    ({"prompt": "a", "chosen": [user("b")], "rejected": "c"}, "'chosen' holds a message from 'user'"),
    ({"prompt": [user("a"), assistant("x")], "chosen": "b", "rejected": "c"}, "'prompt' ends with an assistant"),
    ({"prompt": "a", "chosen": "same", "rejected": "same"}, "the chosen and rejected answers are the same"),
])
def test_a_bad_preference_row_is_refused_with_its_line(tmp_path, bad, detail):
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    path = write_rows(tmp_path / "p.jsonl", [good, good, bad, good])
    with pytest.raises(DataError) as caught:
        load_pairs(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: 1 of 4 rows cannot be trained on") and f"first: line 3: {detail}" in message
    assert "\n" not in message


def test_an_implicit_prompt_must_be_shared(tmp_path):
    rows = [{"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("c")]},
            {"chosen": [user("a"), assistant("b")], "rejected": [user("other"), assistant("c")]}]
    with pytest.raises(DataError, match="first: line 2: 'chosen' and 'rejected' differ before their last message"):
        load_pairs(write_rows(tmp_path / "i.jsonl", rows))


# -- encoding ------------------------------------------------------------------------------------------------------


def test_labels_are_the_answer_and_its_end_of_turn_token_only(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, user("say hi")], "chosen": "hi there",
             "rejected": "bye"}]
    tokenizer, data = load_pairs(write_rows(tmp_path / "p.jsonl", rows))
    pair = data.train.examples[0]
    for side, answer in (("chosen", "hi there"), ("rejected", "bye")):
        ids, labels = labelled(pair, side)
        prompt = len(pair["prompt_ids"])
        assert tokenizer.convert_ids_to_tokens(ids[prompt - 1]) == "<|assistant|>"  # the header ends the prompt
        assert labels[:prompt] == [IGNORE_INDEX] * prompt
        assert labels[prompt:] == ids[prompt:]
        assert tokenizer.decode(labels[prompt:-1]) == answer and labels[-1] == tokenizer.eos_token_id  # <|end|>
    assert data.train.targets == len(pair["chosen_ids"]) + len(pair["rejected_ids"])


def test_max_length_keeps_the_start_and_drops_pairs_without_an_answer_token(tmp_path):
    rows = [{"prompt": "a b", "chosen": "x y z w", "rejected": "v"},
            {"prompt": "a b c d e f g h i j", "chosen": "x", "rejected": "y"}]
    tokenizer, data = load_pairs(write_rows(tmp_path / "p.jsonl", rows), max_length=7)
    # Pair 1: <|user|> a b <|end|> <|assistant|> = 5 prompt tokens, room for 2 answer tokens; pair 2 has none left.
    assert (len(data.train.examples), data.train.truncated, data.train.dropped) == (1, 1, 1)
    pair = data.train.examples[0]
    assert len(pair["prompt_ids"]) == 5 and tokenizer.decode(pair["chosen_ids"]) == "x y"
    assert tokenizer.convert_ids_to_tokens(pair["rejected_ids"]) == ["v", "<|end|>"]
    with pytest.raises(DataError, match="data.max_length=4 leaves no answer token in any of the 2 training pairs"):
        load_pairs(write_rows(tmp_path / "q.jsonl", rows), max_length=4)


def test_the_embedded_preference_pairs_are_a_right_and_a_wrong_answer_of_the_same_length():
    splits = embedded.synthetic_preference_splits(400, 40, seed=3)
    assert splits == embedded.synthetic_preference_splits(400, 40, seed=3)
    plain = embedded.synthetic_splits(400, 40, seed=3)
    for name in ("train", "test"):
        for pair, row in zip(splits[name], plain[name]):
            assert pair["chosen"] == row["answer"] and pair["rejected"] != pair["chosen"]
            assert len(pair["rejected"].split()) == len(pair["chosen"].split())
    assert {pair["task"] for pair in splits["test"]} == set(embedded.TASKS)


def test_the_trainer_engine_gets_the_recipes_settings_and_the_same_token_ids(tmp_path):
    """The trainer engine hands TRL the kept pairs as conversations and a DPOConfig built from the recipe's
    TrainingArguments (not DPOConfig's own defaults) and the dpo section; TRL tokenizes the pairs to the ids
    the loop engine trains on."""
    from datasets import Dataset

    from hf_accum import AccumDPOTrainer
    from hf_accum.recipe.preference import dpo_config

    config = resolved("objective=dpo", "data.num_train_examples=24", "data.num_eval_examples=4", "dpo.beta=0.25",
                      "dpo.loss_type=hinge", "dpo.sft_weight=0.5", f"training.output_dir={tmp_path}")
    args = dpo_config(config, config.training_arguments(activation_checkpointing=False, gradient_checkpointing=None,
                                                        resume_from_checkpoint=None))
    assert (args.beta, args.loss_type, args.loss_weights, args.max_length) == (0.25, ["hinge", "sft"], [1.0, 0.5], 128)
    assert (args.learning_rate, args.bf16, args.per_device_train_batch_size) == (2e-3, False, 8)  # not 1e-6, True
    tokenizer, data = load_preference_data(config.model, config.data)
    _, model = tiny_lora_model(tokenizer)
    trainer = AccumDPOTrainer(model=model, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list(data.train.as_conversations()))
    assert len(trainer.train_dataset) == len(data.train.examples) == 24
    for theirs, ours in zip(trainer.train_dataset, data.train.examples):
        assert {key: theirs[key] for key in ours} == ours


# -- the dpo section -----------------------------------------------------------------------------------------------


def resolved(*argv):
    return checks.load_recipe_config(list(argv), engines=("loop", "trainer"), objectives=("sft", "dpo"))


@pytest.mark.parametrize("argv, message", [
    (["objective=ppo"], "objective='ppo'; allowed: sft, dpo"),
    (["objective=dpo", "dpo.loss_type=aot"], "dpo.loss_type='aot' (it depends on the whole batch"),
    (["objective=dpo", "dpo.loss_type=kto"], "dpo.loss_type='kto'; allowed: sigmoid, hinge, ipo, robust"),
    (["objective=dpo", "dpo.beta=0"], "dpo.beta=0.0 must be > 0"),
    (["objective=dpo", "dpo.label_smoothing=0.5"], "dpo.label_smoothing=0.5 must be >= 0 and < 0.5"),
    (["objective=dpo", "dpo.sft_weight=-1"], "dpo.sft_weight=-1.0 must be >= 0"),
    (["objective=dpo", "dpo.gamma=1"], "unknown key 'dpo.gamma'"),
    (["objective=dpo", "dpo.beta=high"], "dpo.beta: expected float, got 'high'"),
    (["objective=dpo", "data.format=chat"], "objective=dpo cannot run with data.format=chat"),
    (["objective=dpo", "data.packing=true"], "objective=dpo cannot run with data.packing=true"),
    (["objective=dpo", "accumulation.normalization=sequence"], "accumulation.normalization=sequence"),
    (["data.format=preference"], "data.format=preference is preference data: it needs objective=dpo"),
])
def test_bad_dpo_settings_are_refused_naming_the_key_and_what_is_allowed(argv, message):
    with pytest.raises(recipe_config.ConfigError) as caught:
        resolved(*argv)
    assert message in str(caught.value)


def test_the_dpo_section_maps_to_trls_config_and_the_pair_loss():
    from hf_accum.recipe.preference import loss_settings, trl_settings

    config = resolved("objective=dpo", "dpo.beta=0.3", "dpo.loss_type=ipo", "dpo.sft_weight=0.5")
    assert config.objective == "dpo" and config.dpo.beta == 0.3
    assert trl_settings(config.dpo) == {"beta": 0.3, "loss_type": ["ipo", "sft"], "loss_weights": [1.0, 0.5],
                                        "label_smoothing": 0.0}
    assert loss_settings(config.dpo)["sft_weight"] == 0.5
    assert "the dpo section is not used with objective=sft" in " ".join(resolved("dpo.beta=0.3").notes)


def test_objective_dpo_without_a_config_loads_the_embedded_dpo_default():
    config = resolved("objective=dpo")
    assert (config.objective, config.dpo.sft_weight, config.data.num_train_examples, config.global_batch_size) == (
        "dpo", 1.0, 4000, 16)
    assert os.path.samefile(embedded.default_config_path("dpo"), os.path.join(ROOT, "recipes", "configs",
                                                                              "cpu_dpo.yaml"))
    sft = resolved()
    assert (sft.objective, sft.data.num_train_examples, sft.dpo) == ("sft", 5000, recipe_config.DPOSection())


def test_a_bad_dpo_value_exits_2_before_any_model_loads(tmp_path):
    out = tmp_path / "run"  # the recipe's main in this process: it stops before anything loads
    proc = run_main("objective=dpo", "dpo.loss_type=aot_unpaired", f"training.output_dir={out}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "dpo.loss_type='aot_unpaired'" in proc.stderr + proc.stdout
    assert not out.exists()


# -- reference log-probs ---------------------------------------------------------------------------------------------


def tiny_lora_model(tokenizer):
    from peft import LoraConfig, get_peft_model

    base = embedded.build_tiny_llama(tokenizer, seed=0, overrides={"num_hidden_layers": 1})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                      task_type="CAUSAL_LM")
    return base, get_peft_model(base, lora)


def test_reference_logps_use_the_base_model_and_are_cached_reused_and_invalidated(tmp_path):
    from hf_accum.recipe.reference import CACHE_NAME, completion_logps_of, reference_logps

    tokenizer, data = load_preference_data(recipe_config.ModelSection(),
                                           recipe_config.DataSection(num_train_examples=12, num_eval_examples=4))
    pairs = {"train": data.train.examples, "held_out": data.held_out.examples}
    base, model = tiny_lora_model(tokenizer)
    expected = completion_logps_of(base, pairs["train"], tokenizer.pad_token_id)
    with torch.no_grad():  # a trained adapter and head copy: the reference must not see them
        for name, parameter in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                parameter.add_(0.5)
    assert not torch.allclose(completion_logps_of(model, pairs["train"], tokenizer.pad_token_id)[0], expected[0])
    lines = []
    scored = reference_logps(model, pairs, tokenizer.pad_token_id, str(tmp_path), batch_size=5, report=lines.append)
    assert torch.equal(torch.tensor([p["ref_chosen_logps"] for p in scored["train"]]), expected[0])
    assert torch.equal(torch.tensor([p["ref_rejected_logps"] for p in scored["train"]]), expected[1])
    assert len(scored["held_out"]) == 4 and "16 pairs scored by the base model" in lines[-1]
    assert os.path.isfile(tmp_path / CACHE_NAME)

    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    again = reference_logps(model, pairs, tokenizer.pad_token_id, str(tmp_path), report=lines.append)
    assert again == scored and not calls and lines[-1].startswith("reference log-probs: reused from")

    _, shorter = load_preference_data(recipe_config.ModelSection(), recipe_config.DataSection(
        num_train_examples=12, num_eval_examples=4, max_length=20))
    reference_logps(model, {"train": shorter.train.examples}, tokenizer.pad_token_id, str(tmp_path),
                    report=lines.append)
    assert "computed for other pairs: recomputing" in lines[-2] and calls
    with torch.no_grad():
        base.model.embed_tokens.weight.mul_(1.01)  # another base model
    reference_logps(model, {"train": shorter.train.examples}, tokenizer.pad_token_id, str(tmp_path),
                    report=lines.append)
    assert "computed for other weights: recomputing" in lines[-2]
    hook.remove()


# -- end to end ------------------------------------------------------------------------------------------------------

DPO_SMALL = ["objective=dpo", "data.num_train_examples=64", "data.num_eval_examples=16", "training.max_steps=3",
             "training.logging_steps=1", "training.per_device_train_batch_size=4", "global_batch_size=8"]


def run_recipe(out, *overrides):
    """A DPO run of the recipe in the pytest process (nothing kills it: a process of its own would show nothing
    more, and cost a start-up), ended 0: what it printed, and its metrics."""
    proc = run_main(*recipe_arguments(out, *overrides, small=DPO_SMALL))
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    return proc, read_metrics(out)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_both_engines_train_dpo_on_the_embedded_pairs_and_print_the_pairwise_accuracy(tmp_path, engine):
    proc, metrics = run_recipe(tmp_path / engine, f"engine={engine}")
    assert "held-out pairwise accuracy before training:" in proc.stdout
    assert "held-out pairwise accuracy: before " in proc.stdout and "% -> after " in proc.stdout
    assert metrics["engine"] == engine and len(metrics["updates"]) == 3
    assert metrics["eval_before"]["examples"] == metrics["eval_after"]["examples"] == 16
    assert metrics["eval_after"]["mean_margin"] != metrics["eval_before"]["mean_margin"]  # it trained
    assert metrics["data"]["format"] == "preference" and metrics["data"]["train_examples"] == 64
    if engine == "loop":  # 8 pairs per update: the pair is the unit the update's loss is a mean over
        assert [update["targets"] for update in metrics["updates"]] == [8, 8, 8]
        assert "reference log-probs: 80 pairs scored by the base model" in proc.stdout
        assert re.search(r"reference log-probs \(base model\): 100%.*\| 80/80 \[", proc.stderr)  # its progress
        assert "trained 3 updates, 24 pairs in " in proc.stdout
        assert os.path.isfile(tmp_path / engine / "reference_logps.pt")
    for when in ("before", "after"):  # the held-out scoring's progress (main process)
        assert re.search(rf"held-out pairwise accuracy {when} training: 100%.*\| 16/16 \[", proc.stderr), when
