"""A bf16 training step on CPU, profiled by operator: what it spends its time on, and which of it is ours.

The recipe's step (``hf_accum.train``: micro-batch forward, the fused loss, backward, clip, AdamW) on a Llama of
SmolLM2-135M's dimensions (hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536, vocab 49152, tied
head), random init, LoRA r = 16 on every linear layer (PEFT ``all-linear``: the head stays frozen), micro-batches
of 4 rows x 256 tokens, every token a target. The same model is built in float32 and in bfloat16 and trained in
the same process, blocks of updates interleaved (fp32, bf16, bf16, fp32), so that the tokens/s ratio is taken
side by side.
Then one bf16 update (and one fp32 update) runs under ``torch.profiler``; the table groups self CPU time by
operator and by owner:

* ``GEMM`` -- ``aten::mm / addmm / bmm / _weight_int8... / linear`` self time (oneDNN / MKL);
* ``attention`` -- SDPA (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward);
* ``fused loss (ours)`` -- everything under ``_LinearCrossEntropySum`` minus its GEMMs;
* ``optimizer (torch AdamW)``; ``casts (caller)`` (``aten::copy_ / _to_copy``, by the innermost library frame
  of the Python stack: PEFT casts activations to its fp32 adapters' dtype and back, transformers' RMSNorm
  upcasts to fp32; ``backward`` = run by the autograd engine); ``elementwise`` (the rest: norms, activations,
  rotary, adds).

    OMP_NUM_THREADS=1 python -m benchmarks.bf16_profile                 # 2 threads, 2 x 2 timed updates each
    OMP_NUM_THREADS=1 python -m benchmarks.bf16_profile --layers 4 --updates 1   # a quick look
    OMP_NUM_THREADS=1 python -m benchmarks.bf16_profile --variants float32,bfloat16,bfloat16-bf16-adapters,autocast-bf16 \
        --checkpointing --no-profile   # PEFT's fp32 adapters vs adapters in bf16 vs CPU autocast, checkpointed

``--variants``: ``bfloat16`` keeps PEFT's default fp32 adapters and its casts of the activations (the recipe's
``model.adapter_dtype: float32-compute``); ``bfloat16-master-adapters`` is the recipe's default on bf16 weights
(fp32 adapters computed in bf16: ``hf_accum.recipe.cpu_bf16``), ``bfloat16-recipe`` that and attention's SDPA
in float32 (what the recipe builds for bf16 weights on a CPU); ``bfloat16-bf16-adapters`` is
``model.adapter_dtype: weights`` (``autocast_adapter_dtype=False``); ``autocast-bf16`` is ``training.bf16: true``
on fp32 weights (torch's CPU autocast). docs/measurements.md, "bf16 on a CPU with bf16 GEMMs", has the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, rope_theta=100000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
            "mkldnn::", "aten::_mkldnn")
ATTENTION_OPS = ("scaled_dot_product", "_flash_attention")
CAST_OPS = ("aten::copy_", "aten::_to_copy", "aten::to")


# The variants a run can time: the weight dtype, whether PEFT upcasts the LoRA adapters to float32 (its
# default, ``autocast_adapter_dtype=True``) or leaves them in the weights' dtype, and accelerate's mixed
# precision (``training.bf16: true`` with float32 weights: torch's CPU autocast).
VARIANTS = {"float32": (torch.float32, True, "no"), "bfloat16": (torch.bfloat16, True, "no"),
            "bfloat16-bf16-adapters": (torch.bfloat16, False, "no"),
            "bfloat16-master-adapters": (torch.bfloat16, True, "no"),
            "bfloat16-recipe": (torch.bfloat16, True, "no"),
            "autocast-bf16": (torch.float32, True, "bf16")}
# float32 adapters computed in bf16, their weights cast instead of the activations (the recipe's default
# ``model.adapter_dtype: float32``, hf_accum.recipe.cpu_bf16); ``bfloat16`` is PEFT's own path.
MASTER_ADAPTERS = ("bfloat16-master-adapters", "bfloat16-recipe")
# ``bfloat16-recipe``: also attention's SDPA in float32 (hf_accum.recipe.cpu_bf16.SDPA_FLOAT32): what the recipe
# builds for ``model.dtype: bfloat16`` on a CPU with everything else left at its default.
FLOAT32_SDPA = ("bfloat16-recipe",)


def build(dtype: torch.dtype, layers: int, rank: int, seed: int, autocast_adapter_dtype: bool = True,
          checkpointing: bool = False, master_adapters: bool = False, float32_sdpa: bool = False) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_accum.recipe.cpu_bf16 import compute_adapters_in_activation_dtype, use_float32_sdpa_for_bf16
    from hf_accum.recipe.modeling import enable_gradient_checkpointing

    torch.manual_seed(seed)
    config = LlamaConfig(**SMOLLM2_135M, num_hidden_layers=layers)
    model = LlamaForCausalLM(config).to(dtype)
    if checkpointing:  # as the recipe does it (non-reentrant, input grads for the frozen embedding)
        enable_gradient_checkpointing(model)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    if float32_sdpa:
        use_float32_sdpa_for_bf16(model, requested=None)
    peft_model = get_peft_model(model, lora, autocast_adapter_dtype=autocast_adapter_dtype)
    if master_adapters:
        compute_adapters_in_activation_dtype(peft_model)
    return peft_model


class Run:
    """One model and its optimizer; :meth:`train` runs ``hf_accum.train`` over some updates and returns the
    seconds of each update after the first (the first includes the fused loss's probe and one-off costs)."""

    def __init__(self, variant: str, args: argparse.Namespace):
        from accelerate import Accelerator

        dtype, autocast_adapter_dtype, mixed_precision = VARIANTS[variant]
        self.model = build(dtype, args.layers, args.rank, args.seed, autocast_adapter_dtype, args.checkpointing,
                           master_adapters=variant in MASTER_ADAPTERS, float32_sdpa=variant in FLOAT32_SDPA)
        self.accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulation)
        # accelerate's state is one per process: its bf16 mixed precision is torch's CPU autocast, entered here
        self.autocast = mixed_precision == "bf16"
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-4)
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        self.args = args
        self.seconds: list[float] = []

    def train(self, updates: int, seed: int) -> list[float]:
        from torch.utils.data import DataLoader

        from hf_accum.batching import PaddingCollator
        from hf_accum.loop import LoopConfig, train

        args = self.args
        generator = torch.Generator().manual_seed(seed)
        count = args.micro_batch * args.accumulation * updates
        ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (count, args.length), generator=generator)
        loader = self.accelerator.prepare(DataLoader([{"input_ids": row.tolist()} for row in ids],
                                                     batch_size=args.micro_batch, collate_fn=PaddingCollator(0)))
        marks = [time.perf_counter()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            train(self.model, self.optimizer, loader, self.accelerator,
                  LoopConfig(max_grad_norm=1.0, disable_tqdm=True, lr_scheduler_type="constant"),
                  on_update=lambda update: marks.append(time.perf_counter()))
        return [b - a for a, b in zip(marks[1:], marks[2:])]


STACK_OWNERS = (("site-packages/peft/", "peft"), ("site-packages/transformers/", "transformers"),
                ("hf_accum/", "hf_accum"), ("site-packages/torch/", "torch"))


def owner(name: str, stack: list[str] | None = None) -> str:
    """The kind of an operator; for casts, also who called it (the innermost library frame of its Python stack;
    ops the autograd engine runs in backward have none)."""
    if any(name.startswith(op) for op in GEMM_OPS):
        return "GEMM"
    if any(op in name for op in ATTENTION_OPS):
        return "attention"
    if name.startswith(CAST_OPS):
        for frame in stack or []:
            caller = next((who for path, who in STACK_OWNERS if path in frame), None)
            if caller is not None:
                return f"casts ({caller})"
        return "casts (backward)"
    return "elementwise/other"


def profile_update(run: Run, seed: int) -> tuple[dict[str, float], dict[str, float], float]:
    """Self CPU seconds by operator and by owner over one update; the fused loss and the optimizer are the
    operators inside their own ranges (``_LinearCrossEntropySum``, ``Optimizer.step``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        run.train(1, seed)
    events = prof.events()
    by_op: dict[str, float] = defaultdict(float)
    by_owner: dict[str, float] = defaultdict(float)
    ranges = [(e.time_range.start, e.time_range.end, label) for e in events
              for label in ("fused loss (ours)", "optimizer (torch AdamW)")
              if (label.startswith("fused") and e.name == "_LinearCrossEntropySum")
              or (label.startswith("optimizer") and e.name.startswith("Optimizer.step"))]
    total = 0.0
    for event in events:
        self_s = event.self_cpu_time_total / 1e6
        if self_s <= 0 or _is_python_frame(event.name):
            continue
        total += self_s
        by_op[event.name] += self_s
        kind = owner(event.name, event.stack)
        inside = next((label for start, end, label in ranges
                       if start <= event.time_range.start and event.time_range.end <= end), None)
        if inside is not None and kind != "GEMM":
            kind = inside
        elif inside is not None:
            kind = "GEMM (fused loss)" if inside.startswith("fused") else kind
        by_owner[kind] += self_s
    return by_op, by_owner, total


def _is_python_frame(name: str) -> bool:
    """``with_stack`` adds the Python frames as events; their self time is waiting (the main thread blocked in a
    lock while the autograd engine runs backward: ~47% of a step), not work."""
    return name.startswith("<built-in") or ".py(" in name


def print_profile(title: str, by_op: dict[str, float], by_owner: dict[str, float], total: float, top: int) -> None:
    print(f"\n{title}: {total:.2f} s self CPU time")
    print("  by owner:")
    for name, seconds in sorted(by_owner.items(), key=lambda kv: -kv[1]):
        print(f"    {name:<28} {seconds:8.3f} s {100 * seconds / total:6.1f}%")
    print(f"  top {top} operators:")
    for name, seconds in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {name:<60} {seconds:8.3f} s {100 * seconds / total:6.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--updates", type=int, default=2, help="timed updates per block (after one untimed)")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per dtype, fp32 and bf16 alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing, as the recipe's")
    parser.add_argument("--variants", default="float32,bfloat16",
                        help=f"comma-separated, the first is the baseline of the ratios; from {', '.join(VARIANTS)}")
    parser.add_argument("--no-profile", action="store_true", help="tokens/s only")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or len(variants) < 2:
        parser.error(f"--variants {args.variants!r}: give two or more of {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("hf_accum").setLevel(logging.WARNING)
    import os

    load = os.getloadavg()[0]
    runs = {name: Run(name, args) for name in variants}
    for block in range(args.blocks):  # blocks of updates, the variants alternating (and which goes first)
        for name in (runs if block % 2 == 0 else reversed(list(runs))):
            runs[name].seconds.extend(runs[name].train(args.updates + 1, args.seed + block))
    tokens = args.micro_batch * args.accumulation * args.length
    speed = {name: tokens / statistics.median(run.seconds) for name, run in runs.items()}
    print(f"SmolLM2-135M dimensions ({args.layers} layers), LoRA r={args.rank} all-linear, micro-batch "
          f"{args.micro_batch} x {args.length}, K={args.accumulation}, activation checkpointing "
          f"{'on' if args.checkpointing else 'off'}; {args.threads} threads, torch {torch.__version__}, "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    for name, run in runs.items():
        print(f"  {name:<24} {speed[name]:8.0f} tokens/s  (s/update {', '.join(f'{s:.2f}' for s in run.seconds)})")
    baseline = runs[variants[0]]
    for name in variants[1:]:  # same block, same index: updates timed side by side
        ratios = [f / b for f, b in zip(baseline.seconds, runs[name].seconds)]
        print(f"  {name} / {variants[0]} tokens/s: {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] (per interleaved pair)")
    if args.no_profile:
        return
    for name, run in runs.items():
        print_profile(f"profile of one {name} update (with the loop's first-micro-batch probe)",
                      *profile_update(run, args.seed + args.blocks), args.top)


if __name__ == "__main__":
    main()
