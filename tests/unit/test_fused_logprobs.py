"""Fused log-probs (hf_accum/fused/logprobs.py) against the full-logits path in float64: the chunked Function's values
and gradients under a loss that is nonlinear in the log-probs (entropy included, with its gradient), and DPO's pair
loss (DPOPairLoss) fused against its logits path on a tiny float64 Llama. The negative control is TRL 1.16's own
chunked log-prob Function on the same float64 tensors: its float32 sums stay ~1e-7 away from the logits path.

The trainers' fused paths are checked against their independent references in test_dpo.py and test_grpo.py
(the fused log-probs are their default; those tests assert they ran).
"""

from __future__ import annotations

import pytest
import torch

from hf_accum.fused.logprobs import target_logps
from hf_accum.fused.loss import LinearHead, LogitTransform
from hf_accum.losses.preference import DPOPairLoss, collate_pairs
from hf_accum.testing.dpo_reference import pair_features, with_reference_logps
from hf_accum.testing.models import tiny_causal_lm

EXACT = 1e-10
ROWS, HIDDEN, VOCAB = 37, 16, 53


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm().clamp_min(1e-300))


def head_case(seed: int, *, softcap: float | None = None, lora: bool = False, bias: bool = False):
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    head = LinearHead(tensor(VOCAB, HIDDEN), tensor(VOCAB) if bias else None, tensor(4, HIDDEN) if lora else None,
                      tensor(VOCAB, 4) if lora else None, 0.7, LogitTransform(softcap=softcap))
    hidden = tensor(ROWS, HIDDEN)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    leaves = [t for t in (hidden, head.weight, head.bias, head.lora_a, head.lora_b) if t is not None]
    return hidden, head, targets, leaves


def nonlinear(logps: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
    """A loss whose per-token upstream gradient differs token by token (as DPO's / GRPO's do)."""
    loss = (torch.sigmoid(0.3 * logps) * torch.arange(1, ROWS + 1, dtype=logps.dtype)).sum()
    return loss + 0.1 * (entropies**2).sum() if entropies is not None else loss


def full_logits(hidden: torch.Tensor, head: LinearHead, targets: torch.Tensor, temperature: float):
    log_probs = (head.model_logits(hidden) / temperature).log_softmax(-1)
    return log_probs.gather(1, targets[:, None]).squeeze(1), -(log_probs.exp() * log_probs).sum(-1)


CASES = {
    "plain": dict(head={}, temperature=1.0, entropy=False, chunk_bytes=None),
    "plain_entropy_small_chunks": dict(head={}, temperature=1.0, entropy=True, chunk_bytes=VOCAB * 8 * 3 * 5),
    "softcap_lora_bias_temperature": dict(head=dict(softcap=3.0, lora=True, bias=True), temperature=0.7,
                                          entropy=True, chunk_bytes=VOCAB * 8 * 3 * 7),
}


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_logprobs_match_the_full_logits_in_float64(name):
    case = CASES[name]
    hidden, head, targets, leaves = head_case(1, **case["head"])
    logps, entropies = target_logps(hidden, head, targets, temperature=case["temperature"], entropy=case["entropy"],
                                    chunk_bytes=case["chunk_bytes"])
    ours = torch.autograd.grad(nonlinear(logps, entropies), leaves)
    ref_logps, ref_entropies = full_logits(hidden, head, targets, case["temperature"])
    theirs = torch.autograd.grad(nonlinear(ref_logps, ref_entropies if case["entropy"] else None), leaves)
    assert relative(logps, ref_logps) < EXACT
    if case["entropy"]:
        assert entropies is not None and relative(entropies, ref_entropies) < EXACT
    errors = [relative(a, b) for a, b in zip(ours, theirs)]
    print(f"{name}: gradient errors {[f'{e:.1e}' for e in errors]}")
    assert max(errors) < EXACT, errors


def test_trls_chunked_logprobs_are_float32_even_on_float64_tensors():
    """The negative control: TRL's fused head (what AccumGRPOTrainer / TRL's DPOTrainer would use) on the same
    float64 tensors is ~1e-7 off the full logits: its running log-sum-exp is float32."""
    kernels = pytest.importorskip("trl.kernels")
    hidden, head, targets, _ = head_case(2)
    trl_logps = kernels.ChunkedLogProbFunction.apply(hidden, head.weight, None, targets, 1.0, 16, None, 1.0,
                                                     ("log_probs",))[0]
    ours, _ = target_logps(hidden, head, targets)
    reference, _ = full_logits(hidden, head, targets, 1.0)
    error, our_error = relative(trl_logps.double(), reference), relative(ours, reference)
    print(f"log-probs vs the float64 logits: TRL's chunked head {error:.1e}, ours {our_error:.1e}")
    assert error > 1e-9
    assert our_error < EXACT


DPO_CASES = {
    "sigmoid_sft": dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
    "ipo": dict(loss_type="ipo"),
    "robust_hinge_sft": dict(loss_type=["robust", "hinge", "sft"], loss_weights=[0.5, 1.0, 0.25], label_smoothing=0.2),
}


@pytest.mark.parametrize("name", list(DPO_CASES))
def test_dpo_pair_loss_fused_matches_its_logits_path(name):
    """One micro-batch of 5 pairs (uneven prompt and answer lengths), the pair loss and its gradient fused and from the
    logits, on a float64 Llama."""
    model = tiny_causal_lm(vocab_size=40, pad_token_id=0)
    model.train()
    batch = collate_pairs(with_reference_logps(pair_features(5, seed=4), model), pad_token_id=0)
    model_inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    results = {}
    for fused in (True, False):
        loss = DPOPairLoss(beta=0.5, fused=fused, **DPO_CASES[name])
        model.zero_grad()
        outputs = loss.run_forward(model, dict(model_inputs), batch["labels"])
        sums, counts = loss(outputs, batch["labels"], batch)
        (sums / counts).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results[fused] = (sums.detach(), counts, grads, loss)
    (fused_sums, fused_counts, fused_grads, fused_loss), (sums, counts, grads, _) = results[True], results[False]
    assert fused_loss.fused is not None and fused_loss.fused.forwards == 1  # the fused path ran
    assert torch.equal(fused_counts, counts)
    assert relative(fused_sums, sums) < EXACT
    errors = [relative(a, b) for a, b in zip(fused_grads, grads)]
    print(f"{name}: gradient error fused vs logits {max(errors):.1e}")
    assert max(errors) < EXACT
