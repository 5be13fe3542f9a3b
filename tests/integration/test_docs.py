"""The README and docs/*.md say what runs: their examples are executed, their commands' printed lines
checked, their links resolved.

A python block meant to run starts with ``# example: <name>`` (or ``# readme-example: <name>``, the
blocks ``tests/unit/test_trainer.py`` also executes). It runs with these names bound, as a reader's own
code would have them: ``model`` (a tiny Llama), ``tokenizer``, ``examples`` / ``train_ds`` (uneven,
prompt-masked rows), ``collator`` and ``training_args`` (a short CPU run). A ``hf-accum plan`` line of a
bash block that is followed by ``# ...`` lines must print exactly those lines.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE = re.compile(r"```python\n(# (?:readme-)?example: (\S+)\n.*?)```", re.S)
BASH = re.compile(r"```bash\n(.*?)```", re.S)
LINK = re.compile(r"\]\(((?:docs/)?[\w.-]+\.md)\)")


def examples() -> list[tuple[str, str, str]]:
    """``(page, name, code)`` of every runnable python block."""
    found = []
    for page in PAGES:
        for match in EXAMPLE.finditer(page.read_text()):
            found.append((page.relative_to(ROOT).as_posix(), match.group(2), match.group(1)))
    return found


def plan_commands() -> list[tuple[str, str, list[str]]]:
    """``(page, command, expected lines)`` of every ``hf-accum plan`` line followed by ``# ...`` lines."""
    found = []
    for page in PAGES:
        for block in BASH.findall(page.read_text()):
            lines = block.splitlines()
            for i, line in enumerate(lines):
                if not line.startswith("hf-accum plan"):
                    continue
                expected = []
                for following in lines[i + 1 :]:
                    if not following.startswith("# "):
                        break
                    expected.append(following[2:])
                if expected:
                    found.append((page.relative_to(ROOT).as_posix(), line, expected))
    return found


@pytest.fixture
def reader_namespace(tmp_path):
    """The names a runnable example takes as given, small enough to train in seconds on a CPU."""
    from transformers import TrainingArguments

    from hf_accum import PaddingCollator
    from hf_accum.testing import PAD, random_rows, reset_accelerate_state, tiny_causal_lm
    from hf_accum.tiny import build_tiny_tokenizer

    reset_accelerate_state()
    tokenizer = build_tiny_tokenizer(["w"])
    assert tokenizer.pad_token_id == PAD  # the tiny rows pad with the same id
    rows = random_rows(24, seed=0, prompt_masking=True)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
        report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
    )
    yield {
        "model": tiny_causal_lm(dtype=torch.float32), "tokenizer": tokenizer, "examples": rows, "train_ds": rows,
        "collator": PaddingCollator(PAD), "training_args": args,
    }
    reset_accelerate_state()


def test_the_pages_hold_runnable_examples():
    names = {name for _, name, _ in examples()}
    assert {"loop", "trainer", "z-loss"} <= names, names


@pytest.mark.parametrize("page,name,code", examples(), ids=[f"{p}:{n}" for p, n, _ in examples()])
def test_an_example_runs(page, name, code, reader_namespace, capsys):
    exec(compile(code, f"{page} ({name})", "exec"), reader_namespace)
    if name == "loop":  # the loop's example prints one line per update
        assert len(reader_namespace["result"].updates) == 2
        assert capsys.readouterr().out.count("\n") >= 2


@pytest.mark.parametrize("page,command,expected", plan_commands(), ids=[c for _, c, _ in plan_commands()])
def test_a_plan_command_prints_what_the_page_says(page, command, expected, capsys):
    from hf_accum.cli import main

    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out.splitlines() == expected


def test_the_pages_plan_commands_are_checked():
    assert len(plan_commands()) >= 2


def test_every_linked_page_exists():
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name} links to {target}, which does not exist"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
