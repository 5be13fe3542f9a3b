"""Data for the recipes: the embedded dataset, local files, chat templates, prompt masking,
truncation counts, and the exact-match metric."""

from __future__ import annotations

import json

import pytest
import torch

from hf_accum import data as D
from hf_accum import modeling as M
from hf_accum.batching import PaddingCollator
from hf_accum.loss import count_targets


@pytest.fixture(scope="module")
def tokenizer():
    return M.load_tokenizer(M.TINY_MODEL)


def test_embedded_dataset_is_deterministic_and_held_out_is_unseen():
    a, b = D.synthetic_splits(400, 60, seed=3), D.synthetic_splits(400, 60, seed=3)
    assert a == b
    assert a != D.synthetic_splits(400, 60, seed=4)
    train = {(r["prompt"], r["answer"]) for r in a["train"]}
    assert not any((r["prompt"], r["answer"]) in train for r in a["test"])
    assert {r["task"] for r in a["test"]} == set(D.TASKS)


def test_embedded_lengths_vary_strongly(tokenizer):
    rows = D.synthetic_rows(400, seed=0)
    encoded = D.encode_rows(tokenizer, rows, D.Columns(), max_length=256).examples
    answers = [len(e["input_ids"]) - e["prompt_length"] for e in encoded]
    prompts = [e["prompt_length"] for e in encoded]
    assert max(answers) >= 5 * min(answers)
    assert max(prompts) >= 3 * min(prompts)


def test_tokenizer_round_trips_the_embedded_data(tokenizer):
    for row in D.synthetic_rows(40, seed=1):
        ids = tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == row["answer"]


def test_loss_is_only_on_the_answer(tokenizer):
    row = {"prompt": "reverse the words : apple river", "answer": "river apple"}
    example, truncated = D.encode(tokenizer, D.to_messages(row, D.Columns()), max_length=64)
    assert not truncated
    batch = PaddingCollator(tokenizer.pad_token_id)([example])
    targets = batch["labels"][0][batch["labels"][0] != -100]
    # The answer's two words and the end-of-turn token, nothing of the prompt.
    assert tokenizer.convert_ids_to_tokens(targets.tolist()) == ["river", "apple", "<|end|>"]
    assert int(count_targets(batch["labels"])) == 3


def test_truncation_is_counted_and_answerless_rows_dropped(tokenizer):
    # Prompts of 8, 12 and 37 tokens (with the chat markers); answers of 2 tokens (word + end).
    rows = [{"prompt": "repeat the words : " + " ".join(["apple"] * n), "answer": "apple"} for n in (1, 5, 30)]
    # A short prompt with a long answer: truncated inside the answer, still trainable.
    rows.append({"prompt": "repeat the words : apple", "answer": "apple river stone cloud green"})
    split = D.encode_rows(tokenizer, rows, D.Columns(), max_length=12)
    assert split.truncated == 3
    assert split.dropped == 2 and len(split.examples) == 2
    assert [len(e["input_ids"]) - e["prompt_length"] for e in split.examples] == [2, 4]
    assert all(len(e["input_ids"]) <= 12 for e in split.examples)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_local_files_load_with_prompt_answer_or_messages(tmp_path, suffix, tokenizer):
    rows = [
        {"prompt": "last word of : apple river", "answer": "river"},
        {"prompt": "repeat the words : lamp", "answer": "lamp"},
    ]
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    loaded = D.load_split(str(path), "train")
    assert [r["answer"] for r in loaded] == ["river", "lamp"]
    assert D.load_split(str(path), "train[:50%]") == loaded[:1]
    encoded = D.encode_rows(tokenizer, loaded, D.Columns(), 64)
    assert len(encoded.examples) == 2


def test_messages_rows_and_column_errors(tokenizer):
    row = {"messages": [{"role": "user", "content": "repeat the words : lamp"}, {"role": "assistant", "content": "lamp"}]}
    assert D.to_messages(row, D.Columns())[-1] == {"role": "assistant", "content": "lamp"}
    with pytest.raises(D.DataError, match="assistant"):
        D.to_messages({"messages": row["messages"][:1]}, D.Columns())
    with pytest.raises(D.DataError, match="prompt_column"):
        D.to_messages({"question": "x"}, D.Columns())


def test_empty_and_single_split_files_are_refused(tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n")
    with pytest.raises(D.DataError, match="blank.jsonl"):
        D.load_split(str(blank), "train")
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "a", "answer": "b"}\n')
    with pytest.raises(D.DataError, match="single local file"):
        D.load_split(str(one), "test")


class OracleModel(torch.nn.Module):
    """Answers from a lookup table (or wrongly, for every other row when ``wrong_every`` is 2)."""

    def __init__(self, tokenizer, rows, wrong_every=0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.answers = {}
        for i, row in enumerate(rows):
            prompt = tuple(D.prompt_ids(tokenizer, D.to_messages(row, D.Columns())[:-1]))
            answer = row["answer"] if not (wrong_every and i % wrong_every) else "apple apple"
            self.answers[prompt] = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.pad = tokenizer.pad_token_id

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kwargs):
        outputs = []
        for ids, mask in zip(input_ids, attention_mask):
            answer = self.answers[tuple(ids[mask.bool()].tolist())][:max_new_tokens]
            outputs.append(ids.tolist() + answer + [self.pad] * (max_new_tokens - len(answer)))
        return torch.tensor(outputs)


def test_exact_match_scores_generated_answers(tokenizer):
    rows = D.synthetic_rows(12, seed=5)
    perfect = D.exact_match(OracleModel(tokenizer, rows), tokenizer, rows, D.Columns(), batch_size=5)
    assert perfect["exact_match"] == 1.0 and perfect["examples"] == 12
    half = D.exact_match(OracleModel(tokenizer, rows, wrong_every=2), tokenizer, rows, D.Columns(), batch_size=5)
    assert half["exact_match"] == pytest.approx(0.5)
    assert set(half["per_task"]) == set(D.TASKS)


def test_untrained_tiny_model_scores_near_zero(tokenizer):
    rows = D.synthetic_splits(20, 40, seed=0)["test"]
    model = M.load_model(M.TINY_MODEL, tokenizer, seed=0)
    assert D.exact_match(model, tokenizer, rows, D.Columns(), max_new_tokens=8)["exact_match"] <= 0.05
