"""GRPO exactness harness: a GRPO trainer (AccumGRPOTrainer or stock ``trl.GRPOTrainer``) constructed exactly like
``trl.GRPOTrainer``, with generation replaced at ``_generate_and_score_completions`` by fixed completions of uneven
lengths, and an independent float64 reference for every optimizer update.

The fake generation is deterministic (a function of the generation call's index and the row's position):
completions of 1..7 tokens, advantages of both signs, ``old_per_token_logps`` = the model's log-probs at generation
time plus a fixed offset in [-0.3, 0.3] (so PPO clipping is active on some tokens and not others), and
``ref_per_token_logps`` likewise with offsets in [-0.5, 0.5]. Prompts of one generation call share one length (no
left padding: RoPE's float32 cos/sin would then differ between a padded batch and a row forwarded alone).

The reference (:func:`reference_gradient`) knows nothing of micro-batches: it forwards each completion of an update
alone, takes ``log_softmax`` in float64, evaluates the loss type's formula over all the update's completions
directly (:func:`reference_loss`, written from TRL's documented per-token losses and the aggregations of
docs/grpo.md), and differentiates it with autograd. The trainer's applied gradient is read at
``on_pre_optimizer_step`` (after DDP's all-reduce, before the step; no clipping).
"""

from __future__ import annotations

import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from hf_accum.testing.sft import sft_model_factory, sft_tokenizer

TOKENIZER = sft_tokenizer()
MODEL_FACTORY = sft_model_factory(TOKENIZER)
MAX_COMPLETION = 7
FIRST_WORD = 10  # completion / prompt token ids are drawn from [FIRST_WORD, vocab): no special token


def reward_len(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward function TRL's constructor accepts; never called (generation and scoring are replaced)."""
    return [float(len(c)) for c in completions]


def prompts_dataset(n: int) -> Dataset:
    return Dataset.from_list([{"prompt": f"w{i % 40}", "row": i} for i in range(n)])


def grpo_args(output_dir: str, **overrides: Any) -> GRPOConfig:
    values: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=2,
        steps_per_generation=3, max_completion_length=MAX_COMPLETION, learning_rate=1e-2, max_grad_norm=0.0,
        num_train_epochs=1, logging_steps=1, report_to=[], save_strategy="no", bf16=False, use_cpu=True,
        seed=0, data_seed=0, disable_dropout=True, shuffle_dataset=False, epsilon=0.2,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def completion_logps(model: Any, prompt: torch.Tensor, completion: torch.Tensor,
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One completion forwarded alone (no padding): float64 ``log p`` of each completion token and each position's
    entropy, with gradient."""
    ids = torch.cat([prompt, completion]).unsqueeze(0)
    logits = model(input_ids=ids, use_cache=False).logits[0].to(torch.float64)
    logits = logits[prompt.numel() - 1:-1] / temperature
    log_probs = logits.log_softmax(-1)
    token_logps = log_probs.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return token_logps, entropy


class FakeGeneration:
    """``_generate_and_score_completions`` replaced: fixed completions of uneven lengths (see the module docstring)."""

    def __init__(self, trainer: Any, beta: float) -> None:
        self.trainer, self.beta, self.calls = trainer, beta, 0
        self.rows_generated: Counter = Counter()

    def __call__(self, inputs: list[dict]) -> dict:
        trainer = self.trainer
        call, self.calls = self.calls, self.calls + 1
        rank = trainer.accelerator.process_index
        g = torch.Generator().manual_seed(1000 * call + 17 * rank + 3)
        vocab = len(TOKENIZER)
        n = len(inputs)
        prompt_len = 2 + call % 3
        prompts = torch.randint(FIRST_WORD, vocab, (n, prompt_len), generator=g)
        # Rank 1's completions are short (1-2 tokens), rank 0's up to MAX_COMPLETION: uneven counts across ranks.
        longest = MAX_COMPLETION if rank == 0 else 2
        lengths = torch.randint(1, longest + 1, (n,), generator=g)
        completions = torch.full((n, MAX_COMPLETION), TOKENIZER.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, MAX_COMPLETION), dtype=torch.long)
        for i in range(n):
            completions[i, :lengths[i]] = torch.randint(FIRST_WORD, vocab, (int(lengths[i]),), generator=g)
            mask[i, :lengths[i]] = 1
        width = int(lengths.max())
        completions, mask = completions[:, :width], mask[:, :width]
        advantages = torch.randn(n, generator=g, dtype=torch.float64)
        old = torch.zeros((n, width), dtype=torch.float64)
        ref = torch.zeros((n, width), dtype=torch.float64)
        with torch.no_grad():
            for i in range(n):
                logps, _ = completion_logps(trainer.model, prompts[i], completions[i, :lengths[i]], trainer.temperature)
                offsets = torch.rand((2, int(lengths[i])), generator=g, dtype=torch.float64)
                old[i, :lengths[i]] = logps + 0.6 * offsets[0] - 0.3
                ref[i, :lengths[i]] = logps + 1.0 * offsets[1] - 0.5
        row_ids = torch.tensor([1000 * call + 10 * rank + i for i in range(n)])
        self.rows_generated.update(row_ids.tolist())
        device = trainer.accelerator.device
        output = {
            "prompt_ids": prompts.to(device), "prompt_mask": torch.ones_like(prompts).to(device),
            "completion_ids": completions.to(device), "completion_mask": mask.to(device),
            "advantages": advantages.to(device), "old_per_token_logps": old.to(device),
            "num_items_in_batch": trainer.accelerator.gather(mask.sum().to(device)).sum(),
            "row_id": row_ids.to(device),
        }
        if self.beta:
            output["ref_per_token_logps"] = ref.to(device)
        return output


@dataclass
class Update:
    params: dict[str, torch.Tensor]
    micro_batches: list[dict] = field(default_factory=list)
    grad: dict[str, torch.Tensor] | None = None


class UpdateRecorder(TrainerCallback):
    """Parameters at each update's start, the micro-batches its compute_loss calls saw, the applied gradient."""

    def __init__(self) -> None:
        self.updates: list[Update] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.updates.append(Update({n: p.detach().clone() for n, p in model.named_parameters()}))

    def micro_batch(self, inputs: dict) -> None:
        self.updates[-1].micro_batches.append(
            {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.updates[-1].grad = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                 if p.grad is not None}


def build_trainer(trainer_cls: Any, output_dir: str, rows: int = 12, beta: float = 0.0,
                  trainer_kwargs: dict | None = None, **overrides: Any) -> tuple[Any, UpdateRecorder, FakeGeneration]:
    """``trainer_cls`` built like ``trl.GRPOTrainer``, its generation replaced, its updates recorded;
    ``trainer_kwargs``: more constructor arguments (AccumGRPOTrainer's ``fused_logprobs=False``)."""
    recorder = UpdateRecorder()

    class Recording(trainer_cls):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            if self.model.training:
                recorder.micro_batch(inputs)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = grpo_args(output_dir, beta=beta, **overrides)  # sets up the process group under torchrun
    model = MODEL_FACTORY()
    if beta:  # TRL loads its reference model from the policy's path (the fake generation gives ref log-probs)
        path = f"{output_dir}/initial_policy"
        if args.process_index == 0:
            model.save_pretrained(path)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        model.config._name_or_path = path
    trainer = Recording(model=model, reward_funcs=reward_len, args=args, train_dataset=prompts_dataset(rows),
                        processing_class=TOKENIZER, callbacks=[recorder], **(trainer_kwargs or {}))
    fake = FakeGeneration(trainer, beta)
    trainer._generate_and_score_completions = fake
    if trainer_cls is GRPOTrainer:
        attach(trainer, "_get_per_token_logps_and_entropies", full_precision_logps)
    return trainer, recorder, fake


def full_precision_logps(trainer: Any, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         logits_to_keep: int, batch_size: int | None = None, compute_entropy: bool = False,
                         compute_aux_loss: bool = False, **model_kwargs: Any) -> tuple[Any, Any, None]:
    """For stock ``GRPOTrainer`` runs: its fused log-prob head accumulates in float32 (a ~1e-7 floor, also under
    ``float64_arithmetic``, which does not reach into its autograd Function); this computes the same per-token
    log-probs and entropies from float64 logits, so that a stock run's error is its normalization alone."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    log_probs = (logits[:, -logits_to_keep - 1:-1] / trainer.temperature).log_softmax(-1)
    is_target = attention_mask[:, -logits_to_keep:].bool()
    logps = log_probs.gather(-1, input_ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    zero = torch.zeros_like(logps)
    return torch.where(is_target, logps, zero), torch.where(is_target, entropy, zero) if compute_entropy else None, None


def importance_ratio(args: Any, logps: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``pi / pi_old`` per token, or ``exp`` of the mean log-ratio per sequence (GSPO)."""
    log_ratio = logps - old
    if args.importance_sampling_level == "sequence":
        log_ratio = log_ratio.mean().reshape(1)
    return torch.exp(log_ratio)


def per_token_loss(args: Any, loss_type: str, logps: torch.Tensor, old: torch.Tensor,
                   advantage: Any) -> torch.Tensor:
    """TRL's documented per-token (or per-sequence) policy loss of one completion, written independently."""
    ratio = importance_ratio(args, logps, old)
    eps_low, eps_high = args.epsilon, args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if loss_type == "cispo":
        return -torch.clamp(ratio, max=eps_high).detach() * advantage * logps
    if loss_type == "sapo":
        tau = args.sapo_temperature_pos if advantage > 0 else args.sapo_temperature_neg
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantage
    if loss_type == "vespo":
        phi = GRPOTrainer.get_gamma_weights(
            advantage.reshape(1, 1), (logps - old).unsqueeze(0), torch.ones_like(logps).unsqueeze(0), None,
            args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg)
        return -phi.reshape(1) * advantage * logps
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    return -torch.min(ratio * advantage, clipped * advantage)


def reference_loss(args: Any, loss_type: str, rows: list[dict], model: Any) -> torch.Tensor:
    """The loss type's formula over all ``rows`` of one update (each a dict of one completion's tensors)."""
    per_row: list[torch.Tensor] = []
    entropy_sum: torch.Tensor | float = 0.0
    tokens = 0
    for row in rows:
        logps, entropy = completion_logps(model, row["prompt"], row["completion"], args.temperature)
        loss = per_token_loss(args, loss_type, logps, row["old"], row["advantage"])
        loss = loss.expand_as(logps)  # a sequence-level loss counts once per token, as TRL broadcasts it
        if args.beta:
            ref = row["ref"]
            kl = torch.exp(ref - logps) - (ref - logps) - 1  # k3, the estimator TRL and the GRPO paper use
            if args.use_bias_correction_kl:  # TRL 1.16's default: the KL weighted by the importance ratio
                kl = kl * importance_ratio(args, logps, row["old"])
            loss = loss + args.beta * kl
        per_row.append(loss)
        entropy_sum = entropy_sum + entropy.sum()
        tokens += logps.numel()
    n_rows = len(rows)
    if loss_type in ("grpo", "sapo"):
        total = sum(x.mean() for x in per_row) / n_rows
    elif loss_type == "luspo":
        total = sum(x.sum() for x in per_row) / n_rows
    elif loss_type == "dr_grpo":
        total = sum(x.sum() for x in per_row) / (n_rows * args.max_completion_length)
    else:  # bnpo, dapo, cispo, vespo: the update's token mean
        total = sum(x.sum() for x in per_row) / tokens
    if args.entropy_coef:
        total = total - args.entropy_coef * entropy_sum / tokens
    assert isinstance(total, torch.Tensor)  # a sum over the rows' tensors (rows is never empty)
    return total


def completion_rows(micro_batches: list[dict]) -> list[dict]:
    """Every completion of the given micro-batches as its own unpadded tensors."""
    rows = []
    for mb in micro_batches:
        for i in range(mb["completion_ids"].shape[0]):
            keep = mb["completion_mask"][i].bool()
            row = {
                "prompt": mb["prompt_ids"][i][mb["prompt_mask"][i].bool()],
                "completion": mb["completion_ids"][i][keep],
                "old": mb["old_per_token_logps"][i][keep].to(torch.float64),
                "advantage": mb["advantages"][i].to(torch.float64),
                "row_id": int(mb["row_id"][i]),
            }
            if "ref_per_token_logps" in mb:
                row["ref"] = mb["ref_per_token_logps"][i][keep].to(torch.float64)
            rows.append(row)
    return rows


def reference_gradient(args: Any, loss_type: str, update: Update, micro_batches: list[dict]) -> dict[str, torch.Tensor]:
    model = MODEL_FACTORY()
    model.load_state_dict(update.params, strict=False)
    model.train()
    for p in model.parameters():
        p.grad = None
    reference_loss(args, loss_type, completion_rows(micro_batches), model).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def relative_error(applied: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    names = sorted(reference)
    ref = torch.cat([reference[n].flatten() for n in names])
    got = torch.cat([applied.get(n, torch.zeros_like(reference[n])).flatten() for n in names])
    return float((got - ref).norm() / ref.norm())


def update_errors(trainer: Any, recorder: UpdateRecorder,
                  all_micro_batches: list[list[dict]] | None = None) -> list[float]:
    """Each update's relative gradient error against the reference over its micro-batches (all ranks' when given)."""
    errors = []
    for index, update in enumerate(recorder.updates):
        micro_batches = update.micro_batches if all_micro_batches is None else all_micro_batches[index]
        reference = reference_gradient(trainer.args, trainer.loss_type, update, micro_batches)
        assert update.grad is not None  # recorded at every update
        errors.append(relative_error(update.grad, reference))
    return errors


def trained_rows(recorder: UpdateRecorder) -> Counter:
    return Counter(int(r) for u in recorder.updates for mb in u.micro_batches for r in mb["row_id"])


def attach(trainer: Any, name: str, fn: Callable[..., Any]) -> None:
    setattr(trainer, name, types.MethodType(fn, trainer))
