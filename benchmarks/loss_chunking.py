"""Evidence for a proposed change to hf_accum/losses/token_loss.py (not used by the product).

Compares the peak extra memory of the loss step (forward + backward) on bf16 logits for:

* ``token_loss_sum``  -- hf_accum's chunked cross-entropy as it is today;
* ``fused``           -- a prototype that writes d(loss)/d(logits) chunk by chunk during the forward
  (as Liger-Kernel's fused cross-entropy does): no copy of the target rows, no full-size
  slice/index backward buffers, and a chunk size bounded in *bytes*, so it scales with the vocabulary;
* ``plain``           -- ``F.cross_entropy(logits.float())``, what a stock causal-LM loss does.

Run:  python -m benchmarks.loss_chunking --vocab 32768 --tokens 8192 [--chunk-mib 256]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.harness import measure_memory
from hf_accum.losses.token_loss import IGNORE_INDEX, aligned_targets, token_loss_sum


class ChunkedCrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy whose gradient is computed in the forward, one fp32 chunk at a time."""

    @staticmethod
    def forward(ctx, logits2d, targets, chunk_rows):
        grad = torch.empty_like(logits2d)  # the only full-size buffer, in the logits' dtype
        total = torch.zeros((), dtype=torch.float32, device=logits2d.device)
        for start in range(0, logits2d.shape[0], chunk_rows):
            x = logits2d[start:start + chunk_rows].float()
            t = targets[start:start + chunk_rows]
            valid = t.ne(IGNORE_INDEX)
            safe = t.clamp_min(0)
            lse = torch.logsumexp(x, -1)
            total += ((lse - x.gather(1, safe[:, None])[:, 0]) * valid).sum()
            x.sub_(lse[:, None]).exp_()  # softmax in place
            x[torch.arange(x.shape[0], device=x.device), safe] -= 1.0
            grad[start:start + chunk_rows] = x.mul_(valid[:, None])  # rounded once to the logits' dtype
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_output.to(grad.dtype)), None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk-mib", type=int, default=256, help="fp32 bytes per chunk of the fused prototype")
    args = parser.parse_args()
    vocab, n = args.vocab, args.tokens
    chunk_rows = max(1, args.chunk_mib * 2**20 // (vocab * 4))
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (1, n), generator=generator)
    logits = torch.randn(1, n, vocab, generator=generator, dtype=torch.bfloat16).requires_grad_()
    targets = aligned_targets(labels).reshape(-1)
    variants = {
        "token_loss_sum": lambda: token_loss_sum(logits, labels)[0],
        "fused": lambda: ChunkedCrossEntropySum.apply(logits.reshape(-1, vocab), targets, chunk_rows),
        "plain": lambda: F.cross_entropy(logits.float().reshape(-1, vocab), targets, reduction="sum"),
    }
    print(f"bf16 logits {n} x {vocab}; full fp32 logits = {(n - 1) * vocab * 4 / 2**20:.0f} MiB; "
          f"fused chunk = {chunk_rows} rows")
    reference = None
    for name, loss_fn in variants.items():
        with measure_memory(torch.device("cpu")) as reading:
            loss = loss_fn()
            loss.backward()
            grad, logits.grad = logits.grad, None
        reference = reference or (loss.item(), grad)
        error = ((grad.float() - reference[1].float()).abs().max() / reference[1].float().abs().max()).item()
        print(f"{name:15s} peak extra {reading.peak_bytes / 2**20:7.0f} MiB, largest allocation "
              f"{reading.largest_allocation / 2**20:6.0f} MiB, loss {loss.item():.2f}, "
              f"max grad diff vs token_loss_sum {error:.1e} (relative to max |grad|)")


if __name__ == "__main__":
    main()
