"""The DeepSpeed case on 2 processes (tests/distributed/deepspeed_worker.py runs it; test_deepspeed.py re-derives
its expectations from it): uneven prompt-masked rows, rank 0 holding ~10x the tokens of rank 1, a fp32 tiny Llama."""

from __future__ import annotations

import torch

from hf_accum.testing import random_rows, tiny_causal_lm

MICRO_BATCH, ACCUMULATION, EXAMPLES, EPOCHS = 2, 3, 28, 2
LR = 6.0


def examples() -> list[dict]:
    # Accelerate deals micro-batch j to rank j % 2: rows 4m, 4m+1 (40 tokens) go to rank 0, rows
    # 4m+2, 4m+3 (3-5 tokens) to rank 1. 14 micro-batches = 7 per rank = windows of 3, 3 and 1.
    return random_rows(EXAMPLES, seed=11, prompt_masking=True, long_rows=lambda i: (i // MICRO_BATCH) % 2 == 0)


def fp32_model() -> torch.nn.Module:
    return tiny_causal_lm(seed=0, dtype=torch.float32)


def lora_model() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                        modules_to_save=["lm_head"], lora_dropout=0.0)
    model = get_peft_model(fp32_model(), config)
    torch.manual_seed(1)
    with torch.no_grad():  # LoRA B starts at 0; make the first updates non-trivial for every tensor
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model
