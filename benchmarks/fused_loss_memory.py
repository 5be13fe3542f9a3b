"""The fused linear cross-entropy in bf16 against a plain full-logits cross-entropy: peak memory and
time of the loss step (forward + backward), side by side (not a section of ``hf-accum bench``).

For each number of positions, the same bf16 hidden states ``[positions, hidden]`` and bf16 output layer
``[vocab, hidden]`` (both trainable, as under full fine-tuning or ``modules_to_save``) go through:

* ``plain`` -- ``F.cross_entropy(F.linear(h, W).float(), targets, reduction="sum")``: what a stock
  causal-LM loss computes (bf16 logits, upcast, cross-entropy);
* ``fused`` -- :func:`hf_accum.fused.loss.linear_cross_entropy_sum` (chunked, no full logits);
* with ``--stats``, also ``fused+stats`` -- the same with TRL's metrics (entropy, arg-max hits) summed
  in the chunked pass, as ``AccumSFTTrainer`` runs it.

Peak memory: the allocator-level peak of everything allocated inside the step (the profiler's memory
events, :func:`benchmarks.harness.measure_memory`), the weight's gradient included (both variants
create it; it is freed inside the window). Time: median wall seconds per step over ``--rounds`` rounds,
the variants' order rotating from round to round. Ratios are fused / plain.

    OMP_NUM_THREADS=1 python -m benchmarks.fused_loss_memory                      # 512 and 2048 positions
    OMP_NUM_THREADS=1 python -m benchmarks.fused_loss_memory --positions 512 --hidden 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import measure_memory
from hf_accum.fused.loss import LinearHead, TokenStats, linear_cross_entropy_sum


def _variants(h, weight, targets, with_stats: bool):
    def plain():
        return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")

    def fused():
        return linear_cross_entropy_sum(h, LinearHead(weight), targets)

    def fused_stats():
        return linear_cross_entropy_sum(h, LinearHead(weight), targets,
                                        stats=TokenStats.zeros(torch.float64, h.device))

    variants = {"plain": plain, "fused": fused}
    if with_stats:
        variants["fused+stats"] = fused_stats
    return variants


def _step(loss_fn, h, weight) -> float:
    loss = loss_fn()
    loss.backward()
    h.grad = weight.grad = None  # freed inside the window: every variant allocates and frees them alike
    return float(loss.detach())


def measure(positions: int, hidden: int, vocab: int, rounds: int, with_stats: bool, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(positions, hidden, generator=generator).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (positions,), generator=generator)
    variants = _variants(h, weight, targets, with_stats)
    peaks, losses = {}, {}
    for name, loss_fn in variants.items():
        with measure_memory(torch.device("cpu")) as reading:
            losses[name] = _step(loss_fn, h, weight)
        peaks[name] = reading.peak_bytes
    seconds = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            start = time.perf_counter()
            _step(variants[name], h, weight)
            seconds[name].append(time.perf_counter() - start)
    return {"peaks": peaks, "seconds": {k: statistics.median(v) for k, v in seconds.items() if v},
            "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per variant (0: memory only)")
    parser.add_argument("--stats", action="store_true", help="also the fused loss with TRL's metrics")
    args = parser.parse_args()
    print(f"bf16 loss step, vocab {args.vocab}, hidden {args.hidden}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); weight {args.vocab * args.hidden * 2 / 2**20:.0f} MiB")
    print(f"{'positions':>9} {'variant':>12} {'peak MiB':>9} {'x plain':>8} {'s/step':>8} {'x plain':>8} {'loss':>14}")
    for positions in args.positions:
        result = measure(positions, args.hidden, args.vocab, args.rounds, args.stats)
        plain_peak, plain_time = result["peaks"]["plain"], result["seconds"].get("plain")
        for name, peak in result["peaks"].items():
            seconds = result["seconds"].get(name)
            timing = f"{seconds:8.2f} {seconds / plain_time:8.2f}" if seconds else f"{'-':>8} {'-':>8}"
            print(f"{positions:>9} {name:>12} {peak / 2**20:9.0f} {peak / plain_peak:8.2f} {timing} "
                  f"{result['losses'][name]:14.4f}")


if __name__ == "__main__":
    main()
