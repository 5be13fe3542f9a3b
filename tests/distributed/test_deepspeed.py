"""DeepSpeed ZeRO-2 and ZeRO-3 on 2 real CPU processes (torchrun; DeepSpeed's CPU accelerator, gloo),
both engines: every update equals the big-batch update (weight deltas of SGD, fp32), the LR is the
big batch's, the scheduler steps once per update; a ZeRO-3 run saves the same adapter as a DDP run.
All runs share one torchrun launch (tests/distributed/deepspeed_worker.py): DeepSpeed's start-up dominates."""

from __future__ import annotations

import importlib.util
import os

import pytest

from hf_accum.testing import big_batch_learning_rates
from hf_accum.testing.logs import fused_on

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="pip install 'hf_accum[deepspeed]'"),
]

EXACT_RUNS = ["loop_zero2", "loop_zero3", "loop_zero3_offload", "loop_zero3_logits", "trainer_zero2", "trainer_zero3"]
# The fused loss under ZeRO: inside the head's own forward, where ZeRO-3 has gathered it (ZeRO-2 does not
# partition parameters). save_*_zero3 train LoRA + a trainable head (modules_to_save): its gradient is
# reduced like any other (the saved adapter equals DDP's, test_zero3_saves_the_adapter_ddp_saves).
FUSED_RUNS = {"loop_zero2": "", "loop_zero3": "ZeRO-3", "loop_zero3_offload": "ZeRO-3", "trainer_zero2": "",
              "trainer_zero3": "ZeRO-3", "save_loop_zero3": "ZeRO-3", "save_trainer_zero3": "ZeRO-3"}
UPDATES = 6  # 2 epochs x windows of 3, 3 and 1 micro-batches per rank


@pytest.fixture(scope="module")
def report(deepspeed_report):
    return deepspeed_report  # one launch of every job, shared with test_deepspeed_windows.py (conftest.py)


def test_two_processes_really_ran_deepspeed(report):
    assert report["world_size"] == 2
    for name in EXACT_RUNS + ["naive_loop_zero2"]:
        run = report[name]
        assert run["distributed_type"] == "DEEPSPEED" and run["num_processes"] == 2, name
        assert run["zero_stage"] == (2 if "zero2" in name else 3), name
        assert run["engine_accumulation_steps"] == 3, name
        assert run["offload"] == (["cpu", "cpu"] if "offload" in name else ["none", "none"]), name


@pytest.mark.parametrize("name", EXACT_RUNS)
def test_update_equals_big_batch_update(report, name):
    """Weight delta of SGD = -lr x (big-batch gradient), recomputed in float64 from the recorded weights
    and micro-batches of both ranks; the tolerance is fp32 rounding of the deltas (measured ~3e-7)."""
    run = report[name]
    assert run["updates"] == len(run["errors"]) == UPDATES
    assert max(run["errors"]) < 1e-6, run["errors"]


@pytest.mark.parametrize("name", sorted(FUSED_RUNS))
def test_the_fused_loss_runs_under_deepspeed(report, name):
    """DeepSpeed refuses float64 (fp32 is its widest dtype), so exactness is shown at fp32 rounding (above);
    a fused pass reading a partitioned (empty) head or skipping ZeRO's gradient reduction fails it by far."""
    assert fused_on(report["fused_logs"][name], FUSED_RUNS[name]), report["fused_logs"][name]


def test_the_logits_path_under_zero3_is_the_control(report):
    assert not fused_on(report["fused_logs"]["loop_zero3_logits"])


def test_ranks_hold_very_different_token_counts():
    from hf_accum.testing.cases.deepspeed_case import MICRO_BATCH, examples

    per_rank = [0, 0]
    for index, example in enumerate(examples()):
        per_rank[(index // MICRO_BATCH) % 2] += len(example["input_ids"]) - 1
    assert per_rank[0] > 5 * per_rank[1]
    assert any(example["prompt_length"] > 0 for example in examples())


def test_naive_accumulation_under_deepspeed_is_wrong(report):
    """Negative control: the model's own mean loss per micro-batch, DeepSpeed's 1/K."""
    errors = report["naive_loop_zero2"]["errors"]
    assert min(errors) > 1e-2, errors


def test_loop_skips_a_window_without_targets_under_deepspeed(report):
    run = report["loop_zero2_window_without_targets"]
    assert run["applied"] == [False, True, True] and run["targets"][0] == 0
    assert run["skip_reasons"][0] == "no targets in window"
    assert run["moved"][0] == 0.0 and run["moved"][1] > 0  # no engine step for the empty window
    assert run["scheduler_steps"] == 2  # the scheduler counts applied updates only


@pytest.mark.parametrize("name", EXACT_RUNS)
def test_lr_is_the_big_batch_lr_and_scheduler_steps_once_per_update(report, name):
    from hf_accum.testing.cases.deepspeed_case import EPOCHS, LR

    run = report[name]
    expected = big_batch_learning_rates(LR, EPOCHS * 3, 0, "linear")
    # ZeRO steps the torch optimizer once per parameter group; every group of an update gets its LR.
    assert [set(rates) for rates in run["applied_lrs"]] == [{lr} for lr in expected]
    assert run["scheduler_steps"] == UPDATES
    if run["logged_lrs"]:
        assert run["logged_lrs"] == expected


def test_trainer_logs_the_batch_plan_under_deepspeed(report):
    assert report["trainer_zero3"]["plan"] == "effective batch 12 = 2 per device x 3 accumulation x 2 processes"


# -- saving under ZeRO-3 -----------------------------------------------------------------------------


def load_adapter(directory: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "adapter_model.safetensors"))


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[key] - b[key]).abs().max()) for key in a)


@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_zero3_saves_the_adapter_ddp_saves(report, engine):
    """10 AdamW updates (clipping on), LoRA + a full lm_head, same config and seed: the adapter gathered
    from ZeRO-3's shards equals the DDP run's; training moved it far more than the tolerance."""
    from hf_accum.testing.cases.deepspeed_case import lora_model

    ddp, zero3 = report[f"save_{engine}_ddp"], report[f"save_{engine}_zero3"]
    ddp_dir, zero3_dirs = (ddp["ours"], zero3) if engine == "trainer" else (ddp, {"ours": zero3})
    reference = load_adapter(ddp_dir)
    assert any("lora_A" in key for key in reference) and any("lm_head" in key for key in reference)
    for directory in zero3_dirs.values():  # ours, and Trainer's own save_model for the Trainer
        assert max_abs_diff(load_adapter(directory), reference) <= 1e-4, directory
    initial = {key.replace(".default", ""): value for key, value in lora_model().state_dict().items()}
    moved = max(float((reference[key] - initial[key]).abs().max()) for key in reference if key in initial)
    assert moved > 1e-2
