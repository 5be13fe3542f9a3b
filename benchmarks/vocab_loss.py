"""The loss step at real vocabulary sizes: hf_accum's fused linear cross-entropy vs the logits path of
the stock tools, side by side.

Pairs, each run in its own process (so that peak RSS is that run's alone), interleaved and with the
order alternating from pair to pair:

* stock ``transformers.Trainer`` (the model's own loss with ``num_items_in_batch``) vs ``AccumTrainer``;
* a bare Accelerate loop (``model(**batch).loss``, ``accelerator.accumulate()``, clip, AdamW, linear
  schedule) vs ``hf_accum.train`` with the same settings;
* on CUDA with ``liger-kernel`` installed, also stock ``Trainer(use_liger_kernel=True)``.

Every run trains the same model (a Llama built from config: 2 layers, hidden 256, fp32, random init)
on the same rows (uniform length 512..1024, every token a target), micro-batch 2, K = 2, AdamW, clip 1.0.
Per run: peak RSS increment (``VmHWM`` after training, reset just before it, minus ``VmRSS`` then:
gradients, optimizer state, activations, logits; the model and data are already resident) and seconds
per update (wall and process CPU time) over the updates after the first, and MFU: the model FLOPs of those
updates (:func:`benchmarks.harness.batch_flops`, the same for every variant on the same rows) over their wall
time, against the device's peak (:func:`benchmarks.harness.device_peak`). Reported per vocabulary: the median and
range of the per-pair ratios ours / stock, and each side's median MFU.

    OMP_NUM_THREADS=1 python benchmarks/vocab_loss.py                     # 128256, 32000, 4096
    OMP_NUM_THREADS=1 python benchmarks/vocab_loss.py --vocab 32000 --pairs 3 --updates 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script (python benchmarks/vocab_loss.py): the checkout's benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import median_mfu, mfu_meaning, percent  # noqa: E402 (after the path above)

PAIRS = {
    "trainer": ("stock_trainer", "accum_trainer"),
    "loop": ("bare_loop", "hf_accum_loop"),
}


# -- one run (in its own process) ---------------------------------------------------------------------


def _rows(args) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(args.seed)
    count = args.micro_batch * args.accumulation * (args.updates + 1)
    rows = []
    for _ in range(count):
        length = int(torch.randint(args.min_length, args.max_length + 1, (1,), generator=generator))
        rows.append({"input_ids": torch.randint(3, args.vocab, (length,), generator=generator).tolist()})
    return rows


def _model(args):
    import torch
    from transformers import LlamaForCausalLM

    from hf_accum.tiny import tiny_llama_config

    torch.manual_seed(args.seed)
    config = tiny_llama_config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.max_length,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config)


class _Clock:
    """Wall and CPU time at the end of each update; the RSS baseline taken when training starts."""

    def __init__(self):
        self.marks: list[tuple[float, float]] = []
        self.baseline_kib = 0

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as handle:  # reset VmHWM (the peak RSS) to the current RSS
            handle.write("5")
        self.baseline_kib = _status_kib("VmRSS")
        self.marks = [(time.perf_counter(), time.process_time())]

    def update_done(self) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))

    @property
    def wall(self) -> list[float]:
        """Wall seconds of each update."""
        return [b[0] - a[0] for a, b in zip(self.marks, self.marks[1:])]

    def result(self) -> dict:
        cpu = [b[1] - a[1] for a, b in zip(self.marks, self.marks[1:])]
        return {
            "peak_rss_increment_mib": (_status_kib("VmHWM") - self.baseline_kib) / 1024,
            "wall_per_update": statistics.median(self.wall[1:]),  # the first update allocates optimizer state
            "cpu_per_update": statistics.median(cpu[1:]),
            "updates": len(self.wall),
        }


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _train_with_trainer(variant: str, args, clock: _Clock, model, rows: list[dict]) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_accum import AccumTrainer
    from hf_accum.batching import PaddingCollator

    class Timing(TrainerCallback):
        def on_train_begin(self, *unused, **kwargs):
            clock.start()

        def on_step_end(self, *unused, **kwargs):
            clock.update_done()

    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.accumulation, learning_rate=1e-4, max_grad_norm=1.0, num_train_epochs=1,
        lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to="none", use_cpu=args.device == "cpu",
        remove_unused_columns=False, train_sampling_strategy="sequential", disable_tqdm=True,
        dataloader_num_workers=0, use_liger_kernel=variant == "liger_trainer", seed=args.seed,
    )
    trainer_cls = AccumTrainer if variant == "accum_trainer" else Trainer
    trainer = trainer_cls(model=model, args=training_args, train_dataset=rows, data_collator=PaddingCollator(0),
                          callbacks=[Timing()])
    trainer.train()


def _train_with_loop(variant: str, args, clock: _Clock, model, rows: list[dict]) -> None:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    from hf_accum.batching import PaddingCollator
    from hf_accum.loop import LoopConfig, train

    accelerator = Accelerator(cpu=args.device == "cpu", gradient_accumulation_steps=args.accumulation)
    loader = DataLoader(rows, batch_size=args.micro_batch, shuffle=False, collate_fn=PaddingCollator(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    clock.start()
    if variant == "hf_accum_loop":
        config = LoopConfig(lr_scheduler_type="linear", max_grad_norm=1.0, disable_tqdm=True)
        train(model, optimizer, loader, accelerator, config, on_update=lambda update: clock.update_done())
        return
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=args.updates + 1)
    model.train()
    model.config.use_cache = False
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                clock.update_done()


def run_one(variant: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    clock = _Clock()
    model, rows = _model(args), _rows(args)
    train = _train_with_trainer if variant.endswith("trainer") else _train_with_loop
    train(variant, args, clock, model, rows)
    return {"variant": variant, "vocab": args.vocab, **clock.result(), **_utilization(model, rows, clock, args)}


def _utilization(model, rows: list[dict], clock: _Clock, args) -> dict:
    """MFU of the timed updates (all but the first): their model FLOPs (every variant takes the rows in order,
    ``micro_batch`` rows padded per micro-batch, ``accumulation`` per update) over their wall time and the peak."""
    from benchmarks.harness import batch_flops, device_peak, mfu, padded_loader

    per_update = args.micro_batch * args.accumulation
    flops = [batch_flops(model, padded_loader(rows[u * per_update:(u + 1) * per_update], args.micro_batch, 0))
             for u in range(1, len(clock.wall))]
    peak = device_peak(args.device, model)
    return {"flops_per_update": statistics.fmean(flops), "mfu": mfu(sum(flops), sum(clock.wall[1:]), peak.flops),
            "peak": peak.describe()}


# -- the side-by-side driver --------------------------------------------------------------------------


def _spawn(variant: str, vocab: int, args) -> dict:
    command = [sys.executable, __file__, "--run", variant, "--vocab", str(vocab)] + _shared_flags(args)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TRANSFORMERS_VERBOSITY="error")
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{variant} at vocab {vocab} failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _shared_flags(args) -> list[str]:
    return [
        "--updates", str(args.updates), "--micro-batch", str(args.micro_batch), "--accumulation",
        str(args.accumulation), "--min-length", str(args.min_length), "--max-length", str(args.max_length),
        "--hidden", str(args.hidden), "--threads", str(args.threads), "--seed", str(args.seed),
        "--device", args.device,
    ]


def _pairs_to_run(args) -> dict[str, tuple[str, str]]:
    pairs = dict(PAIRS)
    if args.device == "cuda" and _liger_installed():
        pairs["liger"] = ("liger_trainer", "accum_trainer")
    return pairs


def _liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def compare(args) -> list[dict]:
    results = []
    for vocab in args.vocab:
        for repeat in range(args.pairs):
            for name, (stock, ours) in _pairs_to_run(args).items():
                order = (stock, ours) if repeat % 2 == 0 else (ours, stock)
                runs = {variant: _spawn(variant, vocab, args) for variant in order}
                row = {"vocab": vocab, "pair": name, "repeat": repeat, "stock": runs[stock], "ours": runs[ours]}
                results.append(row)
                print(_pair_line(row), flush=True)
    return results


def _ratios(row: dict) -> dict[str, float]:
    stock, ours = row["stock"], row["ours"]
    return {key: ours[key] / stock[key] for key in ("peak_rss_increment_mib", "wall_per_update", "cpu_per_update")}


def _pair_line(row: dict) -> str:
    stock, ours, ratio = row["stock"], row["ours"], _ratios(row)
    return (
        f"vocab {row['vocab']:>6} {ours['variant']:>14} vs {stock['variant']:<13} | peak RSS +{ours['peak_rss_increment_mib']:7.0f} "
        f"vs +{stock['peak_rss_increment_mib']:7.0f} MiB ({ratio['peak_rss_increment_mib']:.2f}x) | s/update wall "
        f"{ours['wall_per_update']:6.2f} vs {stock['wall_per_update']:6.2f} ({ratio['wall_per_update']:.2f}x), CPU "
        f"{ours['cpu_per_update']:6.2f} vs {stock['cpu_per_update']:6.2f} ({ratio['cpu_per_update']:.2f}x)"
        f" | MFU {percent(ours['mfu'])} vs {percent(stock['mfu'])}"
    )


def summary(results: list[dict]) -> str:
    peaks = [run["peak"] for r in results for run in (r["stock"], r["ours"])]
    lines = ["", "ours / stock, median (min..max) over pairs; MFU ours vs stock, median over pairs:"]
    keys = sorted({(r["vocab"], r["pair"]) for r in results}, key=lambda k: (-k[0], k[1]))
    for vocab, pair in keys:
        rows = [_ratios(r) for r in results if r["vocab"] == vocab and r["pair"] == pair]
        cells = []
        for key, label in (("peak_rss_increment_mib", "memory"), ("wall_per_update", "wall"), ("cpu_per_update", "CPU")):
            values = [r[key] for r in rows]
            cells.append(f"{label} {statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})")
        chosen = [r for r in results if r["vocab"] == vocab and r["pair"] == pair]
        cells.append(f"MFU {percent(median_mfu(r['ours']['mfu'] for r in chosen))} vs "
                     f"{percent(median_mfu(r['stock']['mfu'] for r in chosen))}")
        lines.append(f"  vocab {vocab:>6} {PAIRS.get(pair, ('', ''))[1] or pair:>14}: " + ", ".join(cells)
                     + f"  [{len(rows)} pairs]")
    lines.append(f"  {mfu_meaning(peaks)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[128256, 32000, 4096])
    parser.add_argument("--pairs", type=int, default=2, help="interleaved pairs per vocabulary and comparison")
    parser.add_argument("--updates", type=int, default=2, help="timed updates per run (after one untimed)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--min-length", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--output", help="write every run's numbers here (JSON)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: one run in this process
    args = parser.parse_args(argv)
    if args.run:
        args.vocab = args.vocab[0]
        print(json.dumps(run_one(args.run, args)))
        return
    print(f"hidden {args.hidden}, 2 layers, fp32, {args.device}, {args.threads} thread(s); rows "
          f"{args.min_length}..{args.max_length} tokens; micro-batch {args.micro_batch} x K={args.accumulation}; "
          f"{args.updates} timed updates per run, {args.pairs} interleaved pairs; load average {os.getloadavg()[0]:.1f}")
    results = compare(args)
    print(summary(results))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"settings": vars(args), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
