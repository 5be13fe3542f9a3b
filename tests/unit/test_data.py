"""The recipe's data: formats detected from the columns, local file types, held-out splits that never
overlap training, labels that carry the prompt mask (through Trainer's column removal too), the tiny
tokenizer built from the user's data, the embedded dataset and the exact-match metric.

Bad input (malformed files, rows without an answer, ...) is in ``test_data_errors.py``."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from hf_accum import tiny
from hf_accum.batching import PackingCollator, PaddingCollator
from hf_accum.losses.token_loss import IGNORE_INDEX, count_targets
from hf_accum.recipe import checks, embedded, modeling
from hf_accum.recipe import config as recipe_config
from hf_accum.recipe import data as data_module

SAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
END = "<|end|>"  # the tiny chat template's end of turn: the last target of every answer


def sample(name: str) -> str:
    return os.path.join(SAMPLES, name)


def section(dataset: str, **values) -> recipe_config.DataSection:
    """The user-data defaults, with no held-out carve-out unless asked (every row is trained on)."""
    return recipe_config.DataSection(dataset=dataset, **{"eval_fraction": 0.0, **values})


def read_jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def target_tokens(tokenizer, example: dict) -> list[list[str]]:
    """The runs of consecutive targets of an encoded example, as tokens (position 0 is never one)."""
    runs, current = [], []
    for position, label in enumerate(example["labels"]):
        if position > 0 and label != IGNORE_INDEX:
            current.append(tokenizer.convert_ids_to_tokens(label))
        elif current:
            runs, current = runs + [current], []
    return runs + [current] if current else runs


def first_target(example: dict) -> int:
    """Tokens before the first target: the prompt's length."""
    return next(i for i, label in enumerate(example["labels"]) if i > 0 and label != IGNORE_INDEX)


def words(tokenizer, text: str) -> list[str]:
    return tokenizer.tokenize(text)


@pytest.fixture(scope="module")
def tokenizer():
    return modeling.load_tokenizer(modeling.TINY_MODEL)


# -- formats ------------------------------------------------------------------------------------


def test_each_format_trains_on_its_answers_only():
    """Targets, per format, from the raw file: the answer's words and the end of turn (every
    assistant message of a chat; every token but the first of a text)."""
    expected_answers = {
        "alpaca": lambda row: [row["output"]],
        "prompt_completion": lambda row: [row["completion"]],
        "chat": lambda row: [m["content"] for m in row["messages"] if m["role"] == "assistant"],
    }
    for name, answers in expected_answers.items():
        tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), section(sample(f"{name}.jsonl")))
        rows = read_jsonl(sample(f"{name}.jsonl"))
        assert data.format == name and len(data.train.examples) == len(rows)
        for row, example in zip(rows, data.train.examples):
            assert target_tokens(tokenizer, example) == [words(tokenizer, a) + [END] for a in answers(row)]
    tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), section(sample("text.jsonl")))
    assert data.format == "text" and data.eval_rows == []
    for row, example in zip(read_jsonl(sample("text.jsonl")), data.train.examples):
        assert target_tokens(tokenizer, example) == [words(tokenizer, row["text"])[1:] + [END]]
    assert any("data.packing=true is recommended" in line for line in data.report)


def test_alpaca_input_is_joined_into_the_user_message():
    splits = data_module.load_splits(section(sample("alpaca.jsonl")))
    assert splits.format.columns == {"prompt": "instruction", "answer": "output", "input": "input"}
    rows = read_jsonl(sample("alpaca.jsonl"))
    for row, example in zip(rows, splits.train):
        context = row.get("input", "")
        user = row["instruction"] + (f"\n\n{context}" if context else "")
        assert example.messages == [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def test_format_is_detected_from_the_columns_or_forced(tmp_path):
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "a b", "answer": "c", "text": "d e f", "id": 1}])
    detected = data_module.load_splits(section(both))
    assert detected.format.name == "prompt_completion"
    assert detected.format.columns == {"prompt": "prompt", "answer": "answer"}
    assert "not used: id, text" in detected.report[0]
    assert data_module.load_splits(section(both, format="text")).train[0].text == "d e f"
    lacks = r"data.format=alpaca: .*lacks column\(s\) 'instruction' \+ 'output'.*answer, id"
    with pytest.raises(data_module.DataError, match=lacks):
        data_module.load_splits(section(both, format="alpaca"))


def test_column_names_are_configurable(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "why", "context": "because", "response": "so"}])
    unknown = r"cannot tell the format .* \(context, question, response\).*chat: 'messages'"
    with pytest.raises(data_module.DataError, match=unknown):
        data_module.load_splits(section(path))
    named = section(path, prompt_column="question", answer_column="response", input_column="context")
    splits = data_module.load_splits(named)
    assert splits.format.name == "prompt_completion"
    user, assistant = splits.train[0].messages
    assert user == {"role": "user", "content": "why\n\nbecause"} and assistant == {"role": "assistant", "content": "so"}


def test_system_prompt_is_added_to_conversations_without_one():
    splits = data_module.load_splits(section(sample("chat.jsonl"), system_prompt="Be kind."))
    rows = read_jsonl(sample("chat.jsonl"))
    for row, example in zip(rows, splits.train):
        has_system = row["messages"][0]["role"] == "system"
        expected = row["messages"][0] if has_system else {"role": "system", "content": "Be kind."}
        assert example.messages[0] == expected


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".json-lines", ".parquet", ".csv"])
def test_local_file_types_give_the_same_rows(tmp_path, suffix):
    import datasets

    rows = read_jsonl(sample("prompt_completion.jsonl"))
    if suffix in (".jsonl", ".json-lines"):
        path = write_jsonl(tmp_path / ("data.json" if suffix == ".json-lines" else "data.jsonl"), rows)
    elif suffix == ".json":
        path = tmp_path / "data.json"
        path.write_text(json.dumps(rows, indent=1))
    else:
        path = tmp_path / f"data{suffix}"
        table = datasets.Dataset.from_list(rows)
        table.to_parquet(str(path)) if suffix == ".parquet" else table.to_csv(str(path), index=False)
    splits = data_module.load_splits(section(str(path)))
    assert [e.messages[-1]["content"] for e in splits.train] == [r["completion"] for r in rows]


def test_numbers_are_text_but_null_never_becomes_none(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "two plus three", "completion": 5}])
    assert data_module.load_splits(section(path)).train[0].messages[-1]["content"] == "5"


# -- held-out rows: never trained on --------------------------------------------------------------


def numbered_rows(tmp_path, n: int) -> str:
    rows = [{"prompt": f"row {i}", "completion": f"answer {i}"} for i in range(n)]
    return write_jsonl(tmp_path / "numbered.jsonl", rows)


def prompts(examples) -> list[str]:
    return [e.messages[0]["content"] for e in examples]


def test_user_data_defaults_carve_a_seeded_disjoint_held_out_split(tmp_path):
    path = numbered_rows(tmp_path, 100)
    checks.resolve(recipe_config.build_config({"data": {"dataset": path}}), ("loop", "trainer"), ("sft", "dpo"))  # the DataSection defaults fit a local file
    splits = data_module.load_splits(recipe_config.DataSection(dataset=path))
    train, held_out = prompts(splits.train), prompts(splits.held_out)
    assert len(held_out) == 5 and len(train) == 95  # eval_fraction 0.05 of 100
    assert not set(train) & set(held_out)
    assert sorted(train + held_out) == sorted(f"row {i}" for i in range(100))
    assert train == sorted(train, key=lambda p: int(p.split()[1]))  # file order kept
    assert "held-out: 5 of the 100 rows" in splits.report[1] and "data.seed=0" in splits.report[1]
    again = data_module.load_splits(recipe_config.DataSection(dataset=path))
    other_seed = data_module.load_splits(recipe_config.DataSection(dataset=path, seed=1))
    assert prompts(again.held_out) == held_out and prompts(other_seed.held_out) != held_out


def test_carve_out_is_capped_and_can_be_turned_off(tmp_path):
    path = numbered_rows(tmp_path, 100)
    capped = data_module.load_splits(recipe_config.DataSection(dataset=path, eval_fraction=0.5, max_eval_examples=7))
    assert len(capped.held_out) == 7 and len(capped.train) == 93
    assert "capped at data.max_eval_examples=7" in capped.report[1]
    none = data_module.load_splits(recipe_config.DataSection(dataset=path, eval_fraction=0.0))
    assert none.held_out == [] and len(none.train) == 100 and "no exact-match metric" in none.report[1]
    unscored = data_module.load_splits(recipe_config.DataSection(dataset=path, max_eval_examples=0))
    assert unscored.held_out == [] and "(data.max_eval_examples=0)" in unscored.report[1]
    tiny = data_module.load_splits(recipe_config.DataSection(dataset=numbered_rows(tmp_path, 3)))
    assert len(tiny.held_out) == 1 and len(tiny.train) == 2  # at least one held out, one trained


def test_eval_slice_is_taken_out_of_an_unsliced_train_split(tmp_path):
    path = numbered_rows(tmp_path, 20)
    splits = data_module.load_splits(recipe_config.DataSection(dataset=path, eval_split="train[80%:]"))
    assert prompts(splits.held_out) == [f"row {i}" for i in range(16, 20)]
    assert prompts(splits.train) == [f"row {i}" for i in range(16)]
    assert "training on the other 16 rows" in splits.report[1]
    disjoint = data_module.load_splits(recipe_config.DataSection(dataset=path, train_split="train[:50%]", eval_split="train[-5:]"))
    assert len(disjoint.train) == 10 and len(disjoint.held_out) == 5
    shared = r"data.train_split='train\[:90%\]' and data.eval_split='train\[80%:\]' share 2 rows"
    with pytest.raises(data_module.DataError, match=shared):
        data_module.load_splits(recipe_config.DataSection(dataset=path, train_split="train[:90%]", eval_split="train[80%:]"))


def test_a_second_file_is_the_held_out_split_but_not_the_training_file_itself(tmp_path):
    path = numbered_rows(tmp_path, 10)
    splits = data_module.load_splits(recipe_config.DataSection(dataset=path, eval_split=sample("prompt_completion.jsonl")))
    assert len(splits.train) == 10 and len(splits.held_out) == 6
    copy = tmp_path / "copy.jsonl"
    shutil.copy(path, copy)
    duplicated = data_module.load_splits(recipe_config.DataSection(dataset=path, eval_split=str(copy)))
    assert "10 held-out rows also occur among the training rows" in " ".join(duplicated.report)
    with pytest.raises(data_module.DataError, match="is the training file itself"):
        data_module.load_splits(recipe_config.DataSection(dataset=path, eval_split=path))


# -- encoding and masking -------------------------------------------------------------------------


def test_truncation_is_counted_and_answerless_examples_dropped(tokenizer):
    fmt = data_module.RowFormat("prompt_completion", {"prompt": "prompt", "answer": "answer"})
    # Prompts of 8, 12 and 37 tokens (chat markers included); answers of 2 tokens (word + end).
    rows = [{"prompt": "repeat the words : " + " ".join(["apple"] * n), "answer": "apple"} for n in (1, 5, 30)]
    # A short prompt with a long answer: cut inside the answer, still trainable.
    rows.append({"prompt": "repeat the words : apple", "answer": "apple river stone cloud green"})
    split = data_module.encode_examples(tokenizer, [data_module.to_example(r, fmt) for r in rows], max_length=12)
    assert (split.truncated, split.dropped, split.longest_prompt) == (3, 2, 37)
    assert [len(target_tokens(tokenizer, e)[0]) for e in split.examples] == [2, 4]
    assert all(len(e["input_ids"]) == len(e["labels"]) <= 12 for e in split.examples)


def test_collators_pad_labels_with_ignore_and_keep_prompt_length(tokenizer):
    _, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), section(sample("alpaca.jsonl")))
    examples = data.train.examples[:3]
    targets = sum(len(sum(target_tokens(tokenizer, e), [])) for e in examples)
    padded = PaddingCollator(tokenizer.pad_token_id)(examples)
    assert int(count_targets(padded["labels"])) == targets
    assert bool((padded["labels"][padded["attention_mask"] == 0] == IGNORE_INDEX).all())
    assert int(count_targets(PackingCollator()(examples)["labels"])) == targets
    # The older form: no labels, the first prompt_length positions masked.
    legacy = {"input_ids": examples[0]["input_ids"], "prompt_length": len(examples[0]["input_ids"]) - 2}
    assert int(count_targets(PaddingCollator(0)([legacy])["labels"])) == 2
    with pytest.raises(ValueError, match="3 input_ids but 2 labels"):
        PaddingCollator(0)([{"input_ids": [5, 6, 7], "labels": [5, 6]}])


def test_masking_survives_trainer_removing_unused_columns_of_a_datasets_dataset(tmp_path):
    """AccumTrainer on a ``datasets.Dataset`` with Trainer's default ``remove_unused_columns=True``:
    only the answers' tokens are targets (counted independently from the file's ``output`` column),
    and the update equals the big-batch gradient. Negative control: the old ``prompt_length`` form
    loses its mask to the column removal and trains on every token."""
    import datasets

    from hf_accum import AccumTrainer
    from hf_accum.testing import Scenario, run_trainer, tiny_causal_lm

    tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), section(sample("alpaca.jsonl")))
    rows = read_jsonl(sample("alpaca.jsonl"))
    answer_targets = sum(len(words(tokenizer, row["output"])) + 1 for row in rows)  # + end of turn
    all_targets = sum(len(e["input_ids"]) - 1 for e in data.train.examples)

    def targets_seen(examples) -> int:
        scenario = Scenario(
            "datasets.Dataset", lambda: tiny_causal_lm(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id),
            datasets.Dataset.from_list(examples), PaddingCollator(tokenizer.pad_token_id), micro_batch=2,
            accumulation=5, pad_token_id=tokenizer.pad_token_id,
        )
        run = run_trainer(scenario, str(tmp_path / "run"), trainer_cls=AccumTrainer, remove_unused_columns=True)
        assert len(run.auditor.records) == 1 and run.max_error < 1e-10
        return run.auditor.records[0].targets

    assert targets_seen(data.train.examples) == answer_targets
    legacy = [{"input_ids": e["input_ids"], "prompt_length": first_target(e)} for e in data.train.examples]
    assert targets_seen(legacy) == all_targets > 4 * answer_targets


# -- the tiny tokenizer built from the user's data ------------------------------------------------


def test_tiny_tokenizer_is_built_from_the_users_data():
    tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), recipe_config.DataSection(dataset=sample("chat.jsonl")))
    rows = read_jsonl(sample("chat.jsonl"))
    texts = [m["content"] for row in rows for m in row["messages"]]
    assert len(data.eval_rows) == 1 and len(data.train.examples) == len(rows) - 1
    for text in texts:  # train and held-out rows alike: every word is in the vocabulary
        assert tokenizer.unk_token_id not in tokenizer(text)["input_ids"]
    assert data.train.unknown == 0 and "<unk> left: 0 of" in data.report[-1]
    # The embedded model's fixed vocabulary would have made most of these words <unk>.
    embedded = modeling.load_tokenizer(modeling.TINY_MODEL)
    assert sum(embedded(t)["input_ids"].count(embedded.unk_token_id) for t in texts) > 20


def test_words_beyond_the_vocabulary_limit_are_counted_as_unk(monkeypatch):
    rows = read_jsonl(sample("text.jsonl"))
    all_words = [w for row in rows for w in tiny.word_splitter().pre_tokenize_str(row["text"])]
    monkeypatch.setattr(embedded, "TINY_VOCAB_LIMIT", 10)
    tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), section(sample("text.jsonl")))
    kept = set(embedded.tiny_vocabulary((row["text"] for row in rows), limit=10))
    outside = sum(word not in kept for word, _ in all_words)
    assert len(kept) == 10 and outside > 0
    assert data.train.unknown == outside
    assert f"<unk> left: {outside} of" in data.report[-1] and "at most 10" in data.report[-1]


def test_vocabulary_counts_words_by_frequency_and_skips_special_tokens():
    vocabulary = embedded.tiny_vocabulary(["b a b", "c <|end|> b a.", "d"], limit=3)
    assert vocabulary == ["b", "a", "c"]


# -- the embedded dataset and the metric ----------------------------------------------------------


def test_embedded_dataset_is_deterministic_and_held_out_is_unseen():
    a, b = embedded.synthetic_splits(400, 60, seed=3), embedded.synthetic_splits(400, 60, seed=3)
    assert a == b
    assert a != embedded.synthetic_splits(400, 60, seed=4)
    train = {(r["prompt"], r["answer"]) for r in a["train"]}
    assert not any((r["prompt"], r["answer"]) in train for r in a["test"])
    assert {r["task"] for r in a["test"]} == set(embedded.TASKS)


def test_embedded_dataset_needs_no_eval_split_setting_and_refuses_unknown_ones():
    default = data_module.load_splits(recipe_config.DataSection(num_train_examples=40, num_eval_examples=12))
    named = data_module.load_splits(recipe_config.DataSection(num_train_examples=40, num_eval_examples=12, eval_split="test"))
    assert len(default.train) == 40 and len(named.held_out) == 12
    assert prompts(default.held_out) == prompts(named.held_out)
    with pytest.raises(data_module.DataError, match="has the splits 'train'"):
        data_module.load_splits(recipe_config.DataSection(eval_split="validation"))


def test_embedded_lengths_vary_strongly(tokenizer):
    fmt = data_module.RowFormat("prompt_completion", {"prompt": "prompt", "answer": "answer"})
    encoded = data_module.encode_examples(tokenizer, [data_module.to_example(r, fmt) for r in embedded.synthetic_rows(400, seed=0)], 256).examples
    answers = [len(target_tokens(tokenizer, e)[0]) for e in encoded]
    prompts_ = [first_target(e) for e in encoded]
    assert max(answers) >= 5 * min(answers)
    assert max(prompts_) >= 3 * min(prompts_)


def test_tokenizer_round_trips_the_embedded_data(tokenizer):
    for row in embedded.synthetic_rows(40, seed=1):
        ids = tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == row["answer"]


class OracleModel(torch.nn.Module):
    """Answers from a lookup table (or wrongly, for every other row when ``wrong_every`` is 2)."""

    def __init__(self, tokenizer, examples, wrong_every=0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.answers = {}
        for i, example in enumerate(examples):
            prompt = tuple(data_module.prompt_ids(tokenizer, example.messages[:-1]))
            answer = example.messages[-1]["content"] if not (wrong_every and i % wrong_every) else "apple apple"
            self.answers[prompt] = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.pad = tokenizer.pad_token_id

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kwargs):
        outputs = []
        for ids, mask in zip(input_ids, attention_mask):
            answer = self.answers[tuple(ids[mask.bool()].tolist())][:max_new_tokens]
            outputs.append(ids.tolist() + answer + [self.pad] * (max_new_tokens - len(answer)))
        return torch.tensor(outputs)


def test_exact_match_scores_generated_answers(tokenizer):
    examples = data_module.load_splits(recipe_config.DataSection(num_train_examples=4, num_eval_examples=12)).held_out
    perfect = data_module.exact_match(OracleModel(tokenizer, examples), tokenizer, examples, batch_size=5)
    assert perfect["exact_match"] == 1.0 and perfect["examples"] == 12
    half = data_module.exact_match(OracleModel(tokenizer, examples, wrong_every=2), tokenizer, examples, batch_size=5)
    assert half["exact_match"] == pytest.approx(0.5)
    assert set(half["per_task"]) == set(embedded.TASKS)


def test_exact_match_compares_answers_as_the_tokenizer_spells_them():
    """The data-built word-level tokenizer gives "Lima." back as "Lima ."; that is still a match."""
    tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), section(sample("chat.jsonl")))
    examples = data_module.load_splits(section(sample("chat.jsonl"))).train
    assert data_module.exact_match(OracleModel(tokenizer, examples), tokenizer, examples)["exact_match"] == 1.0


def test_untrained_tiny_model_scores_near_zero(tokenizer):
    examples = data_module.load_splits(recipe_config.DataSection(num_train_examples=4, num_eval_examples=40)).held_out
    model = modeling.load_model(modeling.TINY_MODEL, tokenizer, seed=0)
    assert data_module.exact_match(model, tokenizer, examples, max_new_tokens=8)["exact_match"] <= 0.05


# -- the data people have: ShareGPT, question/answer, save_to_disk directories, each from data.dataset alone


def conversation_rows(n: int, sharegpt: bool) -> list[dict]:
    """Rows whose user turns carry a unique word ``q<i>`` (to find an example's row after the carve-out)."""
    rows = []
    for i in range(n):
        turns = [("system", "be brief"), ("user", f"q{i} first ask"), ("assistant", f"answer {i} one"),
                 ("user", f"q{i} again"), ("assistant", f"answer {i} two")]
        if sharegpt:
            speakers = {"system": "system", "user": "human" if i % 2 else "user", "assistant": "gpt" if i % 2 else "assistant"}
            rows.append({"conversations": [{"from": speakers[r], "value": c} for r, c in turns]})
        else:
            rows.append({"messages": [{"role": r, "content": c} for r, c in turns]})
    return rows


def row_of(tokenizer, example: dict) -> int:
    marks = [t for t in tokenizer.convert_ids_to_tokens(example["input_ids"]) if re.fullmatch(r"q\d+", t)]
    return int(marks[0][1:])


def assert_targets_are_the_answers(tokenizer, data, answers_of_row) -> None:
    """labels are -100 exactly outside the assistant's answers (each answer's words and its end of turn)."""
    assert data.train.examples
    for example in data.train.examples:
        expected = [words(tokenizer, answer) + [END] for answer in answers_of_row(row_of(tokenizer, example))]
        assert target_tokens(tokenizer, example) == expected


def test_sharegpt_conversations_train_on_the_gpt_turns_from_data_dataset_alone(tmp_path):
    path = write_jsonl(tmp_path / "sharegpt.jsonl", conversation_rows(40, sharegpt=True))
    tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), recipe_config.DataSection(dataset=path))
    assert data.format == "chat" and "conversations" in data.report[0]
    assert len(data.train.examples) + len(data.held_out.examples) == 40
    assert_targets_are_the_answers(tokenizer, data, lambda i: [f"answer {i} one", f"answer {i} two"])
    assert data.eval_rows[0].messages[0] == {"role": "system", "content": "be brief"}


def test_sharegpt_rows_in_another_column_through_messages_column(tmp_path):
    rows = [{"dialog": row["conversations"], "id": n} for n, row in enumerate(conversation_rows(10, sharegpt=True))]
    path = write_jsonl(tmp_path / "dialogs.jsonl", rows)
    tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), section(path, messages_column="dialog"))
    assert len(data.train.examples) == 10
    assert_targets_are_the_answers(tokenizer, data, lambda i: [f"answer {i} one", f"answer {i} two"])


def test_question_answer_columns_are_detected_like_prompt_answer(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i} how many", "answer": f"{i} apples"} for i in range(30)])
    tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), recipe_config.DataSection(dataset=path))
    assert data.format == "prompt_completion" and "(question, answer)" in data.report[0]
    assert_targets_are_the_answers(tokenizer, data, lambda i: [f"{i} apples"])


def test_a_save_to_disk_dataset_dict_trains_from_its_directory(tmp_path):
    import datasets

    rows = conversation_rows(30, sharegpt=False)
    directory = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:24]), "test": datasets.Dataset.from_list(rows[24:])}
                         ).save_to_disk(str(directory))
    checks.resolve(recipe_config.load_config(None, {"data.dataset": str(directory), "data.eval_split": "test"}),
                   engines=["loop"], objectives=["sft"], world_size=1)
    tokenizer, data = data_module.load_tokenizer_and_data(
        recipe_config.ModelSection(), recipe_config.DataSection(dataset=str(directory), eval_split="test"))
    assert len(data.train.examples) == 24 and len(data.held_out.examples) == 6
    assert_targets_are_the_answers(tokenizer, data, lambda i: [f"answer {i} one", f"answer {i} two"])
    assert {row_of(tokenizer, e) for e in data.held_out.examples} == set(range(24, 30))


def test_a_save_to_disk_dataset_trains_from_its_directory(tmp_path):
    import datasets

    directory = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": f"q{i} say", "completion": f"word{i}"} for i in range(20)]).save_to_disk(str(directory))
    tokenizer, data = data_module.load_tokenizer_and_data(recipe_config.ModelSection(), recipe_config.DataSection(dataset=str(directory)))
    assert data.format == "prompt_completion"
    assert_targets_are_the_answers(tokenizer, data, lambda i: [f"word{i}"])


@pytest.mark.slow
def test_the_recipe_trains_a_sharegpt_file_from_data_dataset_alone(tmp_path):
    """The recipe's main, in this process (a tiny run of 2 updates)."""
    from hf_accum.recipe.testing import run_main

    path = write_jsonl(tmp_path / "sharegpt.jsonl", conversation_rows(40, sharegpt=True))
    out = tmp_path / "out"
    proc = run_main(f"data.dataset={path}", "training.max_steps=2", f"training.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "metrics.json") as handle:
        metrics = json.load(handle)
    assert metrics["data"]["format"] == "chat" and len(metrics["updates"]) == 2
    assert f"data: {path}: format chat (conversations)" in proc.stdout


def test_generate_prompts_with_the_runs_system_prompt_unless_told_otherwise():
    """``hf-accum generate --run`` prompts the way the run trained: its ``data.system_prompt`` first (the data loader
    added it to every training row), ``--system TEXT`` instead, ``--system ''`` none."""
    from hf_accum.recipe.generate import complete, trained_system_prompt

    config = recipe_config.load_config(None, {"data.system_prompt": "repeat the words"})
    tokenizer = modeling.load_tokenizer(embedded.TINY_MODEL)
    prompts: list[str] = []

    class PromptRecorder:  # a model that records the prompt it is given and answers nothing
        generation_config = None

        def generate(self, input_ids, **kwargs):
            prompts.append(tokenizer.decode(input_ids[0].tolist()))
            return input_ids

    for given in (None, "last word of", ""):
        assert complete(PromptRecorder(), tokenizer, "lemon river", 4, trained_system_prompt(config, given)) == ""
    runs_own, overridden, without = prompts
    assert "<|system|> repeat the words <|end|> <|user|> lemon river" in runs_own  # as the run's rows were encoded
    assert "<|system|> last word of <|end|> <|user|> lemon river" in overridden and "repeat" not in overridden
    assert "<|system|>" not in without and "<|user|> lemon river" in without
    training_row = data_module.to_example({"prompt": "lemon river", "completion": "x"}, data_module.resolve_format(
        ["prompt", "completion"], config.data, "rows"))
    assert training_row.conversation()[0] == {"role": "system", "content": trained_system_prompt(config)}
