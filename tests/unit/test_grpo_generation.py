"""AccumGRPOTrainer end to end with TRL's OWN generation: nothing replaced, every update checked in float64.

tests/unit/test_grpo.py replaces ``_generate_and_score_completions`` by fixed completions, so TRL's sampling,
reward scoring, group advantages and generation-time log-probs are never run there. Here the tiny float64 Llama
samples its own completions (``model.generate`` through TRL), a simple verifiable reward scores them, and TRL
computes the advantages and ``old_per_token_logps``. A spy wraps the real method: it calls it unchanged and only
tags each generated row with an id, so the micro-batches each update trained on can be traced back to the
generated batch. Each update's applied gradient is then compared with the independent float64 reference of
hf_accum/testing/grpo_reference.py over exactly those completions. Stock ``trl.GRPOTrainer`` with ``dapo`` is the
negative control (it divides by the generation batch's average tokens per window, not the update's tokens):
measured 0.000-0.174 per update, ours <= 5.2e-16. Under a second per test on an idle
core (up to ~50 s each on the shared 2-core machine under load).

The prompts are one word each (one token under the word-level tokenizer), so a generation batch has no left
padding and the reference's unpadded forward sees the same positions as the trainer's batched one.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from hf_accum import AccumGRPOTrainer  # noqa: E402
from hf_accum.testing.grpo_reference import MAX_COMPLETION, build_trainer, trained_rows, update_errors  # noqa: E402

EXACT = 1e-10


def even_words(completions: list[Any], **kwargs: Any) -> list[float]:
    """A verifiable reward: how many of the completion's words ``w<k>`` have an even ``k``."""
    return [float(sum(1 for word in str(c).split() if word[1:].isdigit() and int(word[1:]) % 2 == 0))
            for c in completions]


class GenerationSpy:
    """Wraps the trainer's real ``_generate_and_score_completions``: calls it unchanged, tags each generated row
    with a ``row_id`` (split and shuffled by TRL along with the row's other tensors), and keeps what was made."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, inputs: list[dict]) -> dict:
        output = self.real(inputs)
        n = output["completion_ids"].shape[0]
        output["row_id"] = torch.arange(n, device=output["completion_ids"].device) + 1000 * len(self.batches)
        self.batches.append({k: v.detach().cpu().clone() for k, v in output.items() if isinstance(v, torch.Tensor)})
        return output

    def rows_generated(self) -> Counter:
        return Counter(int(r) for batch in self.batches for r in batch["row_id"])


def train_with_trl_generation(tmp_path: Any, trainer_cls: Any, **config: Any) -> tuple[list[float], GenerationSpy,
                                                                                       Any]:
    trainer, recorder, _ = build_trainer(trainer_cls, str(tmp_path / trainer_cls.__name__), **config)
    del trainer._generate_and_score_completions  # the harness's fixed completions: back to TRL's own method
    trainer.reward_funcs = [even_words]
    trainer.reward_func_names = ["even_words"]
    spy = GenerationSpy(trainer._generate_and_score_completions)
    trainer._generate_and_score_completions = spy
    trainer.train()
    assert spy.batches, "TRL's generation never ran"
    assert trained_rows(recorder) == spy.rows_generated()  # every sampled completion trained exactly once
    return update_errors(trainer, recorder), spy, trainer


def assert_real_sampling(spy: GenerationSpy) -> None:
    """The batch came from sampling and scoring: varied completions, non-zero advantages, generation-time
    log-probs present (an update spans two generation batches, so TRL computes them)."""
    completions = torch.cat([b["completion_ids"] for b in spy.batches])
    assert completions.shape[1] <= MAX_COMPLETION
    assert len({tuple(row.tolist()) for row in completions}) > completions.shape[0] // 2
    advantages = torch.cat([b["advantages"] for b in spy.batches])
    assert advantages.abs().max() > 0.1
    assert all("old_per_token_logps" in b for b in spy.batches)


@pytest.mark.parametrize("loss_type, beta", [("dapo", 0.0), ("grpo", 0.1)])
def test_updates_are_exact_on_trls_own_generated_batches(tmp_path, loss_type, beta):
    errors, spy, trainer = train_with_trl_generation(tmp_path, AccumGRPOTrainer, loss_type=loss_type, beta=beta)
    assert_real_sampling(spy)
    assert len(errors) == 6
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    print(f"{loss_type} beta={beta}: {len(spy.batches)} generations, rewards {rewards}, "
          f"update errors max {max(errors):.1e}")
    assert max(errors) < EXACT, errors


def test_stock_trl_fails_the_same_check_on_its_own_generation(tmp_path):
    """The negative control: stock dapo divides by the generation batch's average tokens per window."""
    errors, spy, _ = train_with_trl_generation(tmp_path, GRPOTrainer, loss_type="dapo")
    assert_real_sampling(spy)
    print(f"stock dapo, TRL's generation: update errors {[f'{e:.3f}' for e in errors]}")
    assert max(errors) > 1e-3, errors
