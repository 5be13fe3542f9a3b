"""torchrun worker of section ``fsdp_fused`` (2 CPU processes, gloo): the loop engine under FSDP2, the fused loss
against the logits path, same model, data and order. Each variant's peak is read around its training on every
rank (:func:`hf_accum.measure.memory.measure_memory`: the c10 allocator's peak tensor memory, the sharded parameters and
the gathered units included); the report holds the larger rank's peak and the update's wall time.

    torchrun --nproc_per_node 2 --standalone -m benchmarks.fsdp_fused_worker OUT.json VOCAB HIDDEN LAYERS LENGTH ROUNDS
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: neither variant quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader

from benchmarks.harness import bench_llama
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.fsdp import fsdp2_plugin, fsdp_accelerator
from hf_accum.loop import LoopConfig, train
from hf_accum.measure.memory import measure_memory

MICRO_BATCH, ACCUMULATION, UPDATES = 2, 2, 2
LAYER = ["LlamaDecoderLayer"]


def rows(vocab: int, length: int) -> list[dict]:
    """Every update's rows on every rank: full-length rows whose every position is a target."""
    generator = torch.Generator().manual_seed(0)
    count = MICRO_BATCH * ACCUMULATION * UPDATES * dist.get_world_size()
    ids = torch.randint(1, vocab, (count, length), generator=generator)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def run(fused: bool, vocab: int, hidden: int, layers: int, length: int) -> dict:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = fsdp_accelerator(fsdp2_plugin(LAYER), ACCUMULATION, cpu=True)
    model = bench_llama(vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(rows(vocab, length), batch_size=MICRO_BATCH, shuffle=False, collate_fn=PaddingCollator(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(num_train_epochs=1, disable_tqdm=True, fused_loss=fused, max_grad_norm=0.0)
    start = time.perf_counter()
    with measure_memory(torch.device("cpu")) as reading:
        result = train(model, optimizer, loader, accelerator, config)
    seconds = (time.perf_counter() - start) / max(1, len(result.updates))
    peak = torch.tensor([float(reading.peak_bytes), seconds], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"peak_bytes": int(peak[0]), "seconds_per_update": float(peak[1]), "updates": len(result.updates),
            "loss": result.updates[-1].loss}


def main(out: str, vocab: int, hidden: int, layers: int, length: int, rounds: int) -> None:
    dist.init_process_group("gloo")
    results: dict[str, list[dict]] = {"fused": [], "logits": []}
    for round_index in range(rounds):
        order = ("fused", "logits") if round_index % 2 == 0 else ("logits", "fused")
        for name in order:
            results[name].append(run(name == "fused", vocab, hidden, layers, length))
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump({"world_size": dist.get_world_size(), **results}, handle)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], *(int(value) for value in sys.argv[2:7]))
    leave_process_group()
