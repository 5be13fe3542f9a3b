"""FSDP2 on 2 real CPU processes (torchrun, gloo): the loop engine through Accelerate's FSDP2 path
(:func:`hf_accum.fsdp.fsdp_accelerator`). Every update equals the big-batch update in float64 (full
fine-tuning, LoRA, activation checkpointing), gradients are reduce-scattered once per update, clipping
takes the global norm, bf16 compute with fp32 master weights trains like DDP's bf16 run; the naive loop
fails the same check. All runs share the FSDP2 family's one launch (tests/distributed/fsdp_worker.py)."""

from __future__ import annotations

import pytest

from hf_accum.testing.launch import JobReports
from hf_accum.testing.logs import fused_on

pytestmark = pytest.mark.slow
EXACT_RUNS = ["full", "lora", "lora_head", "checkpointing", "logits_path"]
FUSED_RUNS = ["full", "lora", "lora_head", "checkpointing"]  # the fused loss inside the gathered head's forward


@pytest.fixture(scope="module")
def report(fsdp_family):
    return JobReports(fsdp_family)  # the FSDP2 family's one launch (conftest.py); a job that raised fails its tests


@pytest.mark.parametrize("name", EXACT_RUNS)
def test_every_update_equals_the_big_batch_update_under_fsdp2(report, name):
    run = report[name]
    assert report["world_size"] == 2 and run["distributed_type"] == "FSDP" and run["all_dtensor"]
    assert run["updates"] == len(run["errors"]) == 6
    assert max(run["errors"]) < 1e-10, run["errors"]  # measured ~6e-16 (LoRA ~2e-15)
    assert run["logged_lrs"] == pytest.approx(run["expected_lrs"], rel=1e-12)


@pytest.mark.parametrize("name", FUSED_RUNS)
def test_the_fused_loss_runs_under_fsdp2(report, name):
    """Trainable head (full, lora_head: its gradient reduce-scattered like any parameter's) and frozen head
    (lora): the fused loss reads the head inside its own FSDP2-gathered forward, no logits path."""
    assert fused_on(report[name]["fused_log"], "FSDP2"), report[name]["fused_log"]
    assert report[name]["head_trainable"] == (name != "lora")


def test_dpo_fused_logprobs_are_exact_under_fsdp2(report):
    """The fused log-probs' backward recomputes the head's logits: under FSDP2 the head's weight it saved is the
    gathered one, and the gradient equals the unsharded logits path's (float64)."""
    run = report["dpo_fused_logprobs"]
    assert run["all_dtensor"] and run["fused_forwards"] == 1 and run["parameters"] > 10
    assert run["max_error"] < 1e-10, run


def test_grpo_fused_logprobs_and_entropies_are_exact_under_fsdp2(report):
    """AccumGRPOTrainer's fused per-token log-probs and entropies (temperature, KL to a reference, entropy bonus)
    under FSDP2 give the unsharded full-logits path's gradient (float64)."""
    run = report["grpo_fused_logprobs"]
    assert run["all_dtensor"] and run["fused_forwards"] == 1 and run["parameters"] > 10
    assert run["max_error"] < 1e-10, run


def test_the_logits_path_stays_available_and_exact(report):
    assert not fused_on(report["logits_path"]["fused_log"])


def test_activation_checkpointing_really_wrapped_the_layers(report):
    assert report["checkpointing"]["checkpointed_layers"] == 2 and report["full"]["checkpointed_layers"] == 0


@pytest.mark.parametrize("name", EXACT_RUNS + ["naive"])
def test_gradients_are_reduced_once_per_update_not_per_micro_batch(report, name):
    """Windows of 3, 3 and 1 micro-batches: the same number of reduce-scatters in each."""
    counts = report[name]["reduce_scatters"]
    assert len(set(counts)) == 1 and counts[0] > 0, counts


def test_the_naive_loop_fails_the_same_check(report):
    assert min(report["naive"]["errors"]) > 1e-2, report["naive"]["errors"]


def test_clipping_uses_the_global_norm_over_shards(report):
    clip = report["clip"]
    assert clip["fsdp_norms"] == pytest.approx(clip["ddp_norms"], rel=1e-10)
    assert max(clip["ddp_norms"]) > 0.05  # the clip (0.05) was active on every update
    assert clip["weight_difference"] < 1e-10


def test_bf16_compute_with_fp32_reduction_trains_like_ddps_bf16_run(report):
    bf16 = report["bf16"]
    assert bf16["master_weights_fp32"]
    assert bf16["fsdp_losses"] == pytest.approx(bf16["ddp_losses"], rel=2e-3)  # bf16 rounding, not a bug
    assert bf16["movement_difference"] < 0.1  # measured 0.044: the updates agree to bf16 precision
