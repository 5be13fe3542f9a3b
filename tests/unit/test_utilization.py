"""Model FLOPs, the peak FLOP/s and MFU (hf_accum.measure.utilization, hf_accum.measure.peak_flops).

The analytic FLOP count is checked against ``torch.utils.flop_counter.FlopCounterMode`` on a tiny Llama (eager
attention: the CPU SDPA kernel has no formula in the counter), full fine-tuning, LoRA and the fused loss. Then
both front-ends: every update's ``flops`` is the formula over the update's own micro-batches, and its MFU is
``flops / seconds / peak``. The peak is injected (``peak_flops``): the GEMM probe is timed once, with a tiny
budget. No GPU here: the GPU peaks are checked by device name only.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from hf_accum import LoopConfig, train
from hf_accum.accumulation import squared_sequence_lengths
from hf_accum.batching import PackingCollator, PaddingCollator
from hf_accum.loop import LoopConfigError
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.losses.token_loss import count_targets
from hf_accum.measure.peak_flops import PEAK_FLOPS_ENV, cpu_gemm_peak, device_peak_flops, gpu_peak_flops
from hf_accum.measure.utilization import ModelFlops, UtilizationMeter, compute_dtype, summarize
from hf_accum.records import UpdateLog
from hf_accum.testing import PAD, Scenario, fresh_accelerator, random_rows, run_trainer, tiny_causal_lm

ROWS, LENGTH = 3, 10


def _ids() -> torch.Tensor:
    return torch.randint(3, 60, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))


def _counted(run, in_place_addmm: bool = False) -> int:
    # The fused loss sums its weight gradient with the in-place addmm_, which the counter has no formula for.
    def addmm_(self_shape, a_shape, b_shape, out_shape=None, **kwargs):
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    mapping = {torch.ops.aten.addmm_: addmm_} if in_place_addmm else {}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        run()
    return counter.get_total_flops()


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, config)


def test_full_fine_tuning_matches_the_flop_counter():
    model = tiny_causal_lm(attn_implementation="eager")
    ids = _ids()
    counted = _counted(lambda: model(input_ids=ids).logits.sum().backward())
    # The stock forward computes logits at every position: ROWS x LENGTH head rows.
    flops = ModelFlops.of(model)
    assert flops.body_trainable == flops.body and flops.head_trainable == flops.head > 0
    assert counted == flops.update_flops(ROWS * LENGTH, ROWS * LENGTH, ROWS * LENGTH**2)


def test_lora_counts_weight_gradients_of_the_adapters_only():
    model = _lora(tiny_causal_lm(attn_implementation="eager"))
    model.enable_input_require_grads()  # every layer's input gradient is computed: the convention's count
    ids = _ids()
    counted = _counted(lambda: model(input_ids=ids).logits.sum().backward())
    flops = ModelFlops.of(model)
    assert 0 < flops.body_trainable < flops.body / 10 and flops.head_trainable == 0
    assert counted == flops.update_flops(ROWS * LENGTH, ROWS * LENGTH, ROWS * LENGTH**2)


def test_lora_without_input_gradients_counts_at_most_the_first_attention_inputs_more():
    """Autograd skips the input gradients of layer 0's projections (they read the frozen embeddings); the
    convention counts them: the formula is above the counter by no more than that layer's attention linears."""
    model = _lora(tiny_causal_lm(attn_implementation="eager"))
    ids = _ids()
    counted = _counted(lambda: model(input_ids=ids).logits.sum().backward())
    analytic = ModelFlops.of(model).update_flops(ROWS * LENGTH, ROWS * LENGTH, ROWS * LENGTH**2)
    first = model.base_model.model.model.layers[0].self_attn
    bound = 2 * ROWS * LENGTH * sum(m.in_features * m.out_features for m in first.modules()
                                    if isinstance(m, torch.nn.Linear))
    assert 0 < analytic - counted <= bound


@pytest.mark.parametrize("lora", [False, True])
def test_fused_loss_runs_the_head_on_targets_only(lora):
    model = tiny_causal_lm(attn_implementation="eager")
    model = _lora(model) if lora else model
    ids = _ids()
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt: no targets there
    loss = MicroBatchLoss("causal_lm", fused=True)
    first = loss(model, {"input_ids": ids}, labels)  # the first micro-batch also probes the model's own loss
    first[1].backward()
    targets = int(count_targets(labels, "causal_lm"))

    def step():
        loss(model, {"input_ids": ids}, labels)[1].backward()

    counted = _counted(step, in_place_addmm=True)
    analytic = ModelFlops.of(model).window_flops(head_on_targets=True)(
        _Totals(real_tokens=ROWS * LENGTH, targets=targets, squared_lengths=ROWS * LENGTH**2))
    if lora:  # layer 0's projections skip their input gradients (see the test above)
        assert 0 < analytic - counted < 0.1 * analytic
    else:
        assert counted == analytic


class _Totals:
    def __init__(self, **values):
        self.__dict__.update(values)


def test_squared_sequence_lengths_of_padded_packed_and_plain_batches():
    rows = [{"input_ids": [5] * n} for n in (3, 5, 2)]
    padded = PaddingCollator(PAD)(rows)
    assert int(squared_sequence_lengths(padded)) == 9 + 25 + 4
    packed = PackingCollator()(rows)
    assert int(squared_sequence_lengths(packed)) == 9 + 25 + 4
    assert int(squared_sequence_lengths({"input_ids": torch.ones(2, 7, dtype=torch.long)})) == 2 * 49


def test_gpu_peaks_by_device_name():
    """Names as torch.cuda.get_device_name reports them (no GPU here: the table lookup only)."""
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4e12)
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == pytest.approx(756e12)
    assert gpu_peak_flops("NVIDIA H200", torch.float16) == pytest.approx(989.4e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == pytest.approx(156e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == pytest.approx(19.5e12)
    assert gpu_peak_flops("NVIDIA A10G", torch.bfloat16) == pytest.approx(70e12)
    assert gpu_peak_flops("NVIDIA A10", torch.bfloat16) == pytest.approx(125e12)
    assert gpu_peak_flops("NVIDIA L4", torch.bfloat16) == pytest.approx(121e12)
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # no bf16 there
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_peak_sources_in_order(monkeypatch):
    monkeypatch.setenv(PEAK_FLOPS_ENV, "5e11")
    assert device_peak_flops("cpu", torch.float32, configured=2e12).flops == 2e12  # a configured value first
    env = device_peak_flops("cpu", torch.bfloat16)
    assert env.flops == 5e11 and env.dtype == "bfloat16" and PEAK_FLOPS_ENV in env.source


def test_cpu_gemm_probe_measures_a_rate():
    peak = cpu_gemm_peak(torch.float32, 1, budget_s=0.02)
    assert 1e8 < peak < 1e13  # a real measurement: between 0.1 GFLOP/s and 10 TFLOP/s on one thread


def test_compute_dtype_follows_mixed_precision_else_the_weights():
    model = tiny_causal_lm(dtype=torch.bfloat16)
    assert compute_dtype(model) == torch.bfloat16
    assert compute_dtype(tiny_causal_lm(dtype=torch.float32), "bf16") == torch.bfloat16


def test_meter_fills_time_rate_and_mfu():
    times = iter([10.0, 12.0, 13.0])
    meter = UtilizationMeter(device_peak_flops("cpu", torch.float32, configured=1e9), world_size=2,
                             clock=lambda: next(times))
    meter.start()
    updates = [UpdateLog(step=i, epoch=0.0, loss=1.0, learning_rate=0.1, grad_norm=None, targets=1, sequences=1,
                         padding_fraction=0.0, micro_batches=1, flops=flops) for i, flops in ((1, 8e9), (2, 1e9))]
    for update in updates:
        meter.observe(update)
    assert (updates[0].seconds, updates[0].flops_per_second, updates[0].mfu) == (2.0, 4e9, 2.0)
    assert (updates[1].seconds, updates[1].flops_per_second, updates[1].mfu) == (1.0, 1e9, 0.5)
    assert "MFU 50.0%" in updates[1].line()
    assert meter.take_interval() == {"flops_per_second": 3e9, "mfu": 1.5} and meter.take_interval() == {}
    summary = summarize(updates, meter.peak, 2)
    assert summary["flops_per_update"] == 4.5e9 and summary["mfu"] == pytest.approx(9e9 / 3 / 2e9)


def test_loop_config_refuses_a_bad_peak():
    with pytest.raises(LoopConfigError, match="LoopConfig.peak_flops=-1"):
        LoopConfig(peak_flops=-1)


def _expected_update_flops(model, batches) -> float:
    """The formula over the update's own micro-batches (real tokens, targets, squared lengths)."""
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    targets = sum(int(count_targets(b["labels"], "causal_lm")) for b in batches)
    squared = sum(int(squared_sequence_lengths(b)) for b in batches)
    return ModelFlops.of(model).update_flops(tokens, targets, squared)


def test_loop_reports_flops_and_mfu_of_every_update():
    rows = random_rows(8, seed=3)
    collator = PaddingCollator(PAD)
    batches = [collator(rows[i:i + 2]) for i in range(0, 8, 2)]
    accelerator = fresh_accelerator(2)
    model = tiny_causal_lm(seed=0)
    expected = [_expected_update_flops(model, batches[i:i + 2]) for i in (0, 2)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(rows, batch_size=2,
                                                                                collate_fn=collator))
    result = train(model, optimizer, loader, accelerator, LoopConfig(disable_tqdm=True, peak_flops=1e9))
    assert [u.flops for u in result.updates] == expected
    for update in result.updates:
        assert update.mfu == pytest.approx(update.flops / update.seconds / 1e9)
        assert f"MFU {update.mfu:.1%}" in update.line() and update.tracked()["train/mfu"] == update.mfu
    assert result.utilization["flops_per_update"] == pytest.approx(sum(expected) / 2)
    assert result.utilization["mfu"] == pytest.approx(sum(expected) / sum(u.seconds for u in result.updates) / 1e9)


def test_trainer_reports_flops_and_mfu_in_updates_and_logs(tmp_path):
    rows = random_rows(8, seed=3)
    collator = PaddingCollator(PAD)
    batches = [collator(rows[i:i + 2]) for i in range(0, 8, 2)]
    scenario = Scenario("mfu", tiny_causal_lm, rows, collator, micro_batch=2, accumulation=2)
    run = run_trainer(scenario, str(tmp_path), trainer_cls=_accum_trainer(), trainer_kwargs={"peak_flops": 1e9})
    model = tiny_causal_lm()
    assert [u.flops for u in run.trainer.updates] == [_expected_update_flops(model, batches[i:i + 2]) for i in (0, 2)]
    for update in run.trainer.updates:
        assert update.mfu == pytest.approx(update.flops / update.seconds / 1e9)
    logged = [log for log in run.logs if "loss" in log]
    assert len(logged) == 2 and all(log["mfu"] > 0 and log["flops_per_second"] > 0 for log in logged)
    assert run.trainer.utilization["mfu"] > 0 and run.trainer.utilization["peak_flops"] == 1e9


def _accum_trainer():
    from hf_accum import AccumTrainer

    return AccumTrainer
