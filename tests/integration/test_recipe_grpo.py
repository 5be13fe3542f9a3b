"""``objective=grpo`` as a user runs it (``accelerate launch recipes/finetune_llama.py objective=grpo``): the
embedded GRPO default (``hf_accum/recipe/cpu_grpo.yaml``), cut short for the output's shape (its ``main`` in the pytest
process), and in full, launched, for what it promises -- the GRPO stage raises the held-out exact match of the
warm-started tiny model.

What a user reads is checked against what the run recorded: the progress line (loss, reward mean, completion length,
generation vs training seconds) against ``metrics.json``'s ``updates``, the ``GRPO stage: ... before X% -> after Y%``
line against its ``grpo_stage``; TRL's raw log dicts are not printed.
"""

from __future__ import annotations

import os
import re

import pytest
import yaml

from hf_accum.recipe import config as recipe_config
from hf_accum.recipe.testing import ACCELERATE, read_metrics, recipe_arguments, run_main, run_script

# One progress line: "update 4/4: loss 0.0012, reward 1.250 (exact_match 0.56, word_accuracy 0.69), completion 3.1
# tokens, per update: generation 0.1 s, training 0.1 s" (each reward's mean in brackets when there are several).
PROGRESS = re.compile(r"update (\d+)/(\d+): loss (-?[\d.]+), reward ([\d.]+) \(exact_match ([\d.]+), word_accuracy "
                      r"([\d.]+)\), completion ([\d.]+) tokens, per update: generation ([\d.]+) s, training ([\d.]+) s")
STAGE = re.compile(r"GRPO stage: held-out exact match before ([\d.]+)% -> after ([\d.]+)%")
PER_TASK = re.compile(r"GRPO stage per task: (.+)")
# A short run of the default: 20 warm-start updates, 4 GRPO updates of 16 completions (4 prompts x 4), each logged;
# 8 held-out rows.
SHORT = ["data.num_train_examples=240", "data.num_eval_examples=8", "data.max_eval_examples=8", "global_batch_size=16",
         "grpo.warm_start_steps=20", "training.max_steps=4", "training.logging_steps=1"]


def stage_scores(stdout: str) -> tuple[float, float]:
    found = STAGE.findall(stdout)
    assert len(found) == 1, stdout[-3000:]
    before, after = found[0]
    return float(before), float(after)


def check_recorded_as_printed(stdout: str, out) -> dict:
    """Every printed progress line is the matching ``metrics.json`` update; the stage line is ``grpo_stage``. Returns
    the metrics."""
    metrics = read_metrics(out)
    with open(os.path.join(out, recipe_config.RESOLVED_CONFIG_NAME)) as fh:
        max_completion = yaml.safe_load(fh)["grpo"]["max_completion_length"]
    lines = PROGRESS.findall(stdout)
    assert lines, stdout[-3000:]
    updates = {u["step"]: u for u in metrics["updates"]}
    for step, total, loss, reward, exact, words, length, generation, training in lines:
        update = updates[int(step)]
        assert int(total) == metrics["total_updates"]
        assert float(loss) == pytest.approx(update["loss"], abs=5e-5)
        assert float(reward) == pytest.approx(update["reward"], abs=5e-4)
        # The default's rewards, weights 1: their sum; a completion exactly right scores 1 on both.
        assert float(reward) == pytest.approx(float(exact) + float(words), abs=0.011)
        assert 0.0 <= float(exact) <= float(words) <= 1.0
        assert float(length) == pytest.approx(update["completion_length"], abs=0.05)
        assert 1.0 <= update["completion_length"] <= max_completion
        # Per update, generation and training are both measured, and they add up to the update's seconds.
        assert update["generation_seconds"] > 0 and update["training_seconds"] > 0
        assert update["generation_seconds"] + update["training_seconds"] == pytest.approx(update["seconds"])
        assert float(generation) >= 0 and float(training) >= 0
    stage = metrics["grpo_stage"]
    before, after = stage_scores(stdout)
    assert before == pytest.approx(100 * stage["before"]["exact_match"], abs=0.05)
    assert after == pytest.approx(100 * stage["after"]["exact_match"], abs=0.05)
    assert stage["after"] == metrics["eval_after"]  # the run's after is the GRPO stage's, scored once
    (tasks,) = PER_TASK.findall(stdout)
    assert set(re.findall(r"(\w+) \d+% -> \d+%", tasks)) == set(stage["after"]["per_task"])
    return metrics


@pytest.mark.slow
def test_a_short_grpo_default_prints_its_progress_and_stage_lines_as_recorded(tmp_path):
    out = tmp_path / "grpo"
    # In the pytest process (run_main): nothing kills this run, and nothing checked needs a process of its own (the
    # recipe under accelerate launch as a process: test_interrupted_runs.py, and the whole default below).
    proc = run_main(*recipe_arguments(out, "objective=grpo", small=SHORT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = check_recorded_as_printed(proc.stdout, out)
    assert metrics["engine"] == "trainer" and metrics["trained_updates"] == 4
    assert [u["step"] for u in metrics["updates"]] == [1, 2, 3, 4]
    assert metrics["grpo_stage"]["warm_start_steps"] == 20
    # grpo.train_modules_to_save=false: GRPO trains LoRA only, and the adapter is still saved whole (embeddings and
    # LM head included: PEFT saves trainable modules_to_save only, so they are trainable again before the save).
    assert "GRPO trains the LoRA matrices only" in proc.stdout
    from safetensors import safe_open

    with safe_open(os.path.join(out, "adapter", "adapter_model.safetensors"), "pt") as saved:
        names = list(saved.keys())
    assert any("embed_tokens" in name for name in names) and any("lm_head" in name for name in names)
    # TRL's raw log dicts are not printed (the progress line says what matters); they still reach metrics.json.
    printed = proc.stdout + proc.stderr
    assert "'completions/mean_length'" not in printed and "{'loss'" not in printed
    assert all("reward_std" in u for u in metrics["updates"])


@pytest.mark.slow
@pytest.mark.long  # ~3 min a seed on 2 idle cores: outside the suite, python -m pytest -m long
@pytest.mark.parametrize("seed", [0, 1])
def test_the_embedded_grpo_default_raises_held_out_exact_match(tmp_path, seed):
    """The whole default, as shipped (seed 0) and with another seed: the GRPO stage's after is above its before."""
    out = tmp_path / f"grpo_seed{seed}"
    proc = run_script(ACCELERATE, out, "objective=grpo", f"training.seed={seed}", small=[], timeout=1800)
    metrics = check_recorded_as_printed(proc.stdout, out)
    before, after = stage_scores(proc.stdout)
    assert after > before, proc.stdout[-3000:]
    assert metrics["grpo_stage"]["before"]["examples"] == metrics["grpo_stage"]["after"]["examples"] >= 200
