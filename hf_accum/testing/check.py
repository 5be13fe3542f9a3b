"""``hf-accum check``: audit a few accumulated updates of a model, hf_accum's loop vs the naive loop.

Trains the built-in tiny Llama (or a user's local model directory) in float64 on uneven,
prompt-masked random rows, under :class:`hf_accum.verify.BigBatchAuditor`, and reports per update
how far the applied gradient is from the big-batch gradient.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hf_accum.batching import PaddingCollator
from hf_accum.testing.data import random_rows
from hf_accum.testing.models import PAD, VOCAB, keep_norm_dtype, tiny_causal_lm
from hf_accum.testing.scenarios import Scenario, run_exact, run_naive


@dataclass
class CheckReport:
    model: str
    exact_errors: list[float]
    naive_errors: list[float]
    targets: list[int]
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.exact_errors) and max(self.exact_errors) <= self.tolerance

    def table(self) -> str:
        lines = [f"{'update':>6} {'targets':>8} {'hf_accum error':>15} {'naive loss/K error':>19}"]
        for i, (t, e, n) in enumerate(zip(self.targets, self.exact_errors, self.naive_errors), start=1):
            lines.append(f"{i:>6} {t:>8} {e:>15.2e} {n:>19.2e}")
        return "\n".join(lines)

    def verdict(self) -> str:
        worst = max(self.exact_errors)
        state = "PASS" if self.passed else "FAIL"
        return (
            f"{state}: max relative gradient error {worst:.2e} (tolerance {self.tolerance:.0e}) vs naive "
            f"{max(self.naive_errors):.2e}, float64, model {self.model}"
        )


def check_model(
    model: str, micro_batch: int, accumulation: int, n_examples: int, tolerance: float = 1e-8, seed: int = 0
) -> CheckReport:
    """Audit a few updates of ``model`` ('tiny' or a local directory) in float64."""
    factory, vocab_size, pad_id = _model_factory(model)
    examples = random_rows(
        n_examples, seed=seed, min_len=3, max_len=48, prompt_masking=True, vocab_size=vocab_size,
        pad_token_id=pad_id, lowest_id=0,
    )
    scenario = Scenario(
        f"check:{model}", factory, examples, PaddingCollator(pad_id), micro_batch=micro_batch,
        accumulation=accumulation, pad_token_id=pad_id,
    )
    result, exact = run_exact(scenario)
    naive = run_naive(scenario)
    return CheckReport(
        model=model,
        exact_errors=[r.relative_error for r in exact.records],
        naive_errors=[r.relative_error for r in naive.records],
        targets=[u.targets for u in result.updates],
        tolerance=tolerance,
    )


def _model_factory(model: str):
    if model == "tiny":
        return tiny_causal_lm, VOCAB, PAD
    if not os.path.isdir(model):
        raise ValueError(
            f"--model {model!r}: not 'tiny' and not a directory (nothing is downloaded; pass a local model)"
        )

    def local():
        from transformers import AutoModelForCausalLM

        try:
            loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64, local_files_only=True)
        except OSError as error:
            raise ValueError(
                f"--model {model!r}: not 'tiny' and not a loadable local model directory ({error})"
            ) from error
        return keep_norm_dtype(loaded)

    probe = local()
    pad = probe.config.pad_token_id if probe.config.pad_token_id is not None else 0
    return local, probe.config.vocab_size, int(pad)
