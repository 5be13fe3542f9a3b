"""Bad data, refused before any model is loaded: one line naming the file, the line (or row) and what
is wrong. Nothing is trained on a bad row, nothing is silently dropped or turned into the string "None".

The config-level checks (``hf_accum.recipe.checks.resolve``) run before anything is read; the content checks
run in :func:`hf_accum.recipe.data.load_tokenizer_and_data`, which the recipe calls before building the model
or creating the output directory."""

from __future__ import annotations

import json

import pytest

from hf_accum.recipe import checks
from hf_accum.recipe import config as recipe_config
from hf_accum.recipe import data as data_module


def load(path, **values):
    return data_module.load_tokenizer_and_data(recipe_config.ModelSection(), recipe_config.DataSection(dataset=str(path), **values))


def refused(path, match: str, **values) -> str:
    with pytest.raises(data_module.DataError, match=match) as caught:
        load(path, **values)
    message = str(caught.value)
    assert "\n" not in message
    return message


def write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


GOOD = json.dumps({"instruction": "say hi", "output": "hi"})


@pytest.mark.parametrize(
    "bad_row, detail",
    [
        ({"instruction": "say hi", "output": None}, "'output' is null"),
        ({"instruction": "say hi"}, "no 'output' field"),
        ({"instruction": "say hi", "output": "  "}, "'output' is empty"),
        ({"instruction": "say hi", "output": ["hi"]}, "'output' is a list, not text"),
        ({"output": "hi", "instruction": None}, "'instruction' is null"),
    ],
)
def test_rows_without_an_answer_are_counted_and_the_first_is_named(tmp_path, bad_row, detail):
    # Line 1 good, line 2 blank (still counted as a line), lines 3 and 5 bad.
    path = write_lines(tmp_path / "a.jsonl", [GOOD, "", json.dumps(bad_row), GOOD, json.dumps(bad_row), GOOD])
    message = refused(path, "cannot be trained on")
    assert message.startswith(f"{path}: 2 of 5 rows cannot be trained on")
    assert f"first: line 3: {detail}" in message and "format alpaca" in message


def test_bad_rows_of_several_kinds_are_counted_by_kind(tmp_path):
    rows = [{"prompt": "a", "completion": None}, {"prompt": "b", "completion": "x"}, {"completion": "y"},
            {"prompt": "c", "completion": ""}]
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in rows])
    message = refused(path, "3 of 4 rows")
    assert "2 without a completion in" not in message  # the role is 'answer', the column 'completion'
    assert "2 without an answer in 'completion', 1 without a prompt in 'prompt'" in message
    assert "first: line 1: 'completion' is null" in message


def test_held_out_rows_are_checked_too(tmp_path):
    rows = [json.dumps({"prompt": f"p{i}", "completion": "c"}) for i in range(9)] + [json.dumps({"prompt": "p"})]
    path = write_lines(tmp_path / "p.jsonl", rows)
    refused(path, r"1 of 10 rows .* first: line 10: no 'completion' field", eval_split="train[90%:]")


@pytest.mark.parametrize(
    "messages, detail",
    [
        ([{"role": "user", "content": "hi"}], "the last message is from 'user', not the assistant"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], "the assistant's last message is"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "message 2 needs a 'role' and"),
        ([{"role": "assistant", "content": "hi"}], "the assistant's answer has no message before it"),
        ([], "'messages' is empty"),
        ("hi", "'messages' is not a list of messages"),
    ],
)
def test_chat_rows_must_end_with_an_assistant_answer(tmp_path, messages, detail):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = write_lines(tmp_path / "c.jsonl", [json.dumps(good), json.dumps({"messages": messages})])
    refused(path, f"1 of 2 rows .*first: line 2: {detail}")


def test_empty_text_rows_are_refused(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [json.dumps({"text": "a b"}), json.dumps({"text": ""})])
    refused(path, r"1 of 2 rows cannot be trained on \(1 without a text in 'text'\); first: line 2: 'text' is empty")


def test_malformed_json_line_names_its_line(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [GOOD, GOOD, '{"instruction": "x", "output": "y"', GOOD])
    refused(path, r"m.jsonl: line 3: not valid JSON: Expecting ',' delimiter \(column 35\)$")
    array = tmp_path / "m.json"
    array.write_text('[\n {"instruction": "x", "output": "y"},\n {"instruction": "x" "output": "y"}\n]\n')
    refused(array, r"m.json: line 3: not valid JSON")


def test_a_line_that_is_not_an_object_is_refused(tmp_path):
    path = write_lines(tmp_path / "l.jsonl", [GOOD, '["instruction", "output"]'])
    refused(path, r"l.jsonl: line 2: expected one JSON object \{...\} per line, got list")


def test_invalid_utf8_names_line_and_byte(tmp_path):
    path = tmp_path / "u.jsonl"
    bad_line = b'{"instruction": "caf\xe9", "output": "x"}\n'  # latin-1, not UTF-8
    path.write_bytes(GOOD.encode() + b"\n" + bad_line)
    column, offset = bad_line.index(b"\xe9") + 1, len(GOOD) + 1 + bad_line.index(b"\xe9")
    refused(path, rf"u.jsonl: line 2: invalid UTF-8 \(byte 0xe9 at column {column}, file offset {offset}\)")
    csv = tmp_path / "u.csv"
    csv.write_bytes(b"prompt,completion\nhi,there\nbad,\xff\n")
    refused(csv, r"u.csv: line 3: invalid UTF-8 \(byte 0xff at column 5")


def test_empty_selections_are_refused(tmp_path):
    blank = write_lines(tmp_path / "blank.jsonl", ["", "  "])
    refused(blank, r"blank.jsonl holds no rows \(blank lines only\)$")
    path = write_lines(tmp_path / "a.jsonl", [GOOD] * 4)
    refused(path, r"data.train_split='train\[:0%\]' selects no rows", train_split="train[:0%]")
    refused(path, "holds out every row", eval_split="train")


def test_every_example_truncated_to_zero_targets_names_max_length_and_longest_prompt(tmp_path):
    rows = [{"instruction": " ".join(["word"] * n), "output": "yes"} for n in (7, 9, 8)]
    path = write_lines(tmp_path / "long.jsonl", [json.dumps(r) for r in rows])
    # The tiny template: <|user|> words... <|end|> <|assistant|> answer <|end|>; the longest prompt is
    # 9 words + 3 markers = 12 tokens.
    message = refused(path, "leaves no answer token", max_length=10, eval_fraction=0.0)
    assert message == ("data.max_length=10 leaves no answer token in any of the 3 training examples "
                       "(the longest prompt is 12 tokens); raise data.max_length above 12")
    _, data = load(path, max_length=12, eval_fraction=0.0)  # two fit, one is dropped and said so
    assert len(data.train.examples) == 2 and data.train.dropped == 1
    assert any("1 training examples had no answer token within data.max_length=12" in line for line in data.report)
    _, data = load(path, max_length=13, eval_fraction=0.0)
    assert len(data.train.examples) == 3 and data.train.truncated == 1


def test_undetectable_format_names_the_columns_and_the_formats(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [json.dumps({"question": "q", "response": "r"})])
    message = refused(path, "cannot tell the format")
    assert "(question, response)" in message
    for fmt in data_module.FORMATS:
        assert f"{fmt}:" in message


# -- checked by the config, before anything is read ----------------------------------------------


def resolve(tmp_path, **data):
    return checks.resolve(recipe_config.build_config({"data": data, "training": {"output_dir": str(tmp_path / "out")}}),
                          ("loop", "trainer"), ("sft", "dpo"))


@pytest.mark.parametrize(
    "data, message",
    [
        ({"format": "jsonl"}, "data.format='jsonl'; allowed: auto, chat, prompt_completion, alpaca, text"),
        ({"eval_fraction": 1.0}, "data.eval_fraction=1.0 must be >= 0 and < 1"),
        ({"eval_fraction": -0.1}, "data.eval_fraction=-0.1 must be >= 0 and < 1"),
        ({"max_length": 1}, "data.max_length=1 must be >= 2"),
        ({"num_train_examples": 0}, "data.num_train_examples=0 must be >= 1"),
        ({"max_eval_examples": -1}, "data.max_eval_examples=-1 must be >= 0"),
        ({"eval_max_new_tokens": 0}, "data.eval_max_new_tokens=0 must be >= 1"),
        ({"eval_split": "validation"}, "has the splits 'train'"),
        ({"dataset": "DATA", "eval_split": "test"}, "is a single local file"),
        ({"dataset": "DATA", "eval_split": "train[abc]"}, "data.eval_split='train[abc]' is not a split"),
        ({"dataset": "DATA", "train_split": "OTHER"}, "data.train_split=.* name the training file in data.dataset"),
        ({"dataset": "DATA", "eval_split": "missing.jsonl"}, "data file not found: 'missing.jsonl'"),
        ({"dataset": "missing.jsonl"}, "data.dataset: data file not found"),
        ({"dataset": "EMPTY"}, "data.dataset: data file is empty"),
        ({"dataset": "TXT"}, "unsupported type '.txt'; allowed: .jsonl, .json, .parquet, .csv"),
    ],
)
def test_config_refuses_bad_data_settings(tmp_path, data, message):
    files = {"DATA": tmp_path / "d.jsonl", "OTHER": tmp_path / "o.jsonl", "EMPTY": tmp_path / "e.jsonl",
             "TXT": tmp_path / "d.txt"}
    for name, path in files.items():
        path.write_text("" if name == "EMPTY" else GOOD + "\n")
    data = {k: str(files[v]) if v in files else v for k, v in data.items()}
    with pytest.raises(recipe_config.ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        resolve(tmp_path, **data)


def test_config_accepts_a_user_file_with_the_data_section_defaults(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [GOOD])
    assert resolve(tmp_path, dataset=path).data.eval_split is None
    assert resolve(tmp_path, dataset=path, eval_split="train[90%:]").data.eval_split == "train[90%:]"


# -- the data people have: what is refused, and how ------------------------------------------------


def sharegpt_row(*speakers: str) -> str:
    return json.dumps({"conversations": [{"from": s, "value": f"turn by {s}"} for s in speakers]})


def test_sharegpt_speakers_other_than_the_known_ones_are_counted_and_the_first_named(tmp_path):
    good = sharegpt_row("human", "gpt")
    path = write_lines(tmp_path / "sg.jsonl", [good, sharegpt_row("human", "tool", "gpt"), good,
                                                sharegpt_row("human", "function_call", "gpt"), good])
    message = refused(path, "cannot be trained on")
    assert message.startswith(f"{path}: 2 of 5 rows cannot be trained on (2 with a ShareGPT speaker other than")
    assert "first: line 2: message 2 is from 'tool'" in message
    assert "human, user, gpt, assistant, system" in message


def test_a_sharegpt_turn_without_a_text_value_is_refused(tmp_path):
    path = write_lines(tmp_path / "sg.jsonl", [json.dumps({"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]})])
    assert "first: line 1: message 1 (from 'human') needs a text 'value'" in refused(path, "cannot be trained on")


@pytest.mark.parametrize("key", ["dataset", "eval_split"])
@pytest.mark.parametrize("url", ["https://example.com/data.jsonl", "hf://datasets/x/y", "s3://bucket/train.parquet"])
def test_a_url_is_refused_with_what_is_supported(tmp_path, key, url):
    values = {key: url} if key == "dataset" else {"dataset": write_lines(tmp_path / "a.jsonl", [GOOD]), key: url}
    with pytest.raises(recipe_config.ConfigError) as caught:
        resolve(tmp_path, **values)
    message = str(caught.value)
    assert message.startswith(f"data.{key}={url!r}: URLs are not read") and "\n" not in message
    assert "save_to_disk" in message and "hub name" in message and ".jsonl" in message


def test_a_directory_not_written_by_save_to_disk_is_refused(tmp_path):
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "a.jsonl").write_text(GOOD + "\n")
    with pytest.raises(recipe_config.ConfigError, match="is a directory but not one written by datasets' save_to_disk"):
        resolve(tmp_path, dataset=str(tmp_path / "rows"))


def test_a_split_a_saved_dataset_dict_lacks_is_refused_before_loading(tmp_path):
    import datasets

    directory = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([json.loads(GOOD)] * 4)}).save_to_disk(str(directory))
    with pytest.raises(recipe_config.ConfigError, match=r"data.eval_split='validation': .* has no split 'validation'; its splits: train"):
        resolve(tmp_path, dataset=str(directory), eval_split="validation")
    assert resolve(tmp_path, dataset=str(directory)).data.dataset == str(directory)
