"""Run accumulation under the big-batch auditor: hf_accum's loop vs the naive ``loss / K`` loop.

Used by ``hf-accum check`` (on the built-in tiny model or a user's own local model) and by the
test suite, so the product's check and the tests exercise the very same code path.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader
from transformers import get_scheduler

from hf_accum.loop import LoopConfig, TrainResult, train
from hf_accum.verify import BigBatchAuditor


@dataclass
class Scenario:
    """A model factory, examples and a collator, plus the accumulation settings to audit."""

    name: str
    model_factory: Callable[[], torch.nn.Module]
    examples: list
    collator: Any
    micro_batch: int = 2
    accumulation: int = 4
    epochs: float = 1
    max_steps: int = -1
    label_smoothing: float = 0.0
    loss_kind: str = "causal_lm"
    lr: float = 1e-2
    warmup_steps: int = 0
    scheduler: str = "constant"
    pad_token_id: int = 0
    reference_dtype: torch.dtype | None = None
    max_grad_norm: float = 0.0
    """0: unclipped, so the audit compares the raw applied gradient."""
    accelerator_kwargs: dict = field(default_factory=dict)
    loop_kwargs: dict = field(default_factory=dict)


def fresh_accelerator(accumulation: int, **kwargs) -> Accelerator:
    # Accelerator state is a per-process singleton; reset it so each run gets its own K.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=accumulation, **kwargs)


def run_exact(scenario: Scenario, on_model=None) -> tuple[TrainResult, BigBatchAuditor]:
    """hf_accum's loop under the auditor."""
    accelerator = fresh_accelerator(scenario.accumulation, **scenario.accelerator_kwargs)
    model, optimizer, loader, auditor = _prepare(scenario, accelerator, on_model)
    config = LoopConfig(
        num_train_epochs=scenario.epochs,
        max_steps=scenario.max_steps,
        lr_scheduler_type=scenario.scheduler,
        warmup_steps=scenario.warmup_steps,
        max_grad_norm=scenario.max_grad_norm,
        label_smoothing=scenario.label_smoothing,
        loss_kind=scenario.loss_kind,
        disable_tqdm=True,
        **scenario.loop_kwargs,
    )
    return train(model, optimizer, loader, accelerator, config), auditor


def run_naive(scenario: Scenario, on_model=None) -> BigBatchAuditor:
    """The classic loop: the model's own per-micro-batch mean, ``Accelerator.backward``'s fixed
    ``1 / K``, and an LR horizon counted in micro-batches. The baseline hf_accum must beat."""
    accelerator = fresh_accelerator(scenario.accumulation, **scenario.accelerator_kwargs)
    model, optimizer, loader, auditor = _prepare(scenario, accelerator, on_model)
    epochs = int(scenario.epochs)
    scheduler = get_scheduler(
        scenario.scheduler, optimizer, num_warmup_steps=scenario.warmup_steps, num_training_steps=len(loader) * epochs
    )
    model.train()
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch, use_cache=False).loss)
                if accelerator.sync_gradients:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
    return auditor


def _prepare(scenario: Scenario, accelerator: Accelerator, on_model=None):
    model = scenario.model_factory()
    auditor = BigBatchAuditor(
        loss_kind=scenario.loss_kind, label_smoothing=scenario.label_smoothing, pad_token_id=scenario.pad_token_id,
        reference_dtype=scenario.reference_dtype,
    )
    loader = DataLoader(
        scenario.examples, batch_size=scenario.micro_batch, shuffle=False,
        collate_fn=auditor.wrap_collator(scenario.collator),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=scenario.lr)
    auditor.attach(model, optimizer)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if on_model is not None:
        on_model(model)
    return model, optimizer, loader, auditor


# -- hf-accum check -----------------------------------------------------------------------------


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
    """Audit a few updates of ``model`` on synthetic uneven, prompt-masked data, in float64."""
    from hf_accum.batching import PaddingCollator

    factory, vocab_size, pad_id = _model_factory(model)
    examples = synthetic_examples(n_examples, vocab_size, pad_id, seed)
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


def synthetic_examples(n: int, vocab_size: int, pad_id: int, seed: int = 0) -> list[dict]:
    """Rows of 3..48 random tokens (never the pad id), each with a random prompt prefix masked."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        length = int(torch.randint(3, 49, (1,), generator=generator))
        ids = torch.randint(0, vocab_size - 1, (length,), generator=generator)
        ids = torch.where(ids >= pad_id, ids + 1, ids).tolist()  # skip pad_id
        examples.append({"input_ids": ids, "prompt_length": int(torch.randint(0, length, (1,), generator=generator))})
    return examples


def _model_factory(model: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if model == "tiny":
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=False,
        )

        def tiny():
            torch.manual_seed(0)
            return keep_norm_dtype(LlamaForCausalLM(config).to(torch.float64))

        return tiny, config.vocab_size, 0

    if not os.path.isdir(model):
        raise ValueError(f"--model {model!r}: not 'tiny' and not a directory (nothing is downloaded; pass a local model)")

    def local():
        try:
            loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64, local_files_only=True)
        except OSError as error:
            raise ValueError(f"--model {model!r}: not 'tiny' and not a loadable local model directory ({error})")
        return keep_norm_dtype(loaded)

    probe = local()
    pad = probe.config.pad_token_id if probe.config.pad_token_id is not None else 0
    return local, probe.config.vocab_size, int(pad)


def keep_norm_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """Make RMSNorm instances compute in the input dtype (same formula).

    Stock RMSNorms upcast to fp32 even in a float64 model; that fp32 island would put a ~1e-7
    rounding floor under any float64 comparison and hide what the check measures.
    """

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(forward, module)
    return model
