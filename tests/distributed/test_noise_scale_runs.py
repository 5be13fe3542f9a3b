"""The gradient noise scale measured inside real runs, both engines, 1 and 2 processes.

The exactness check: the raw estimates a run logs (``grad_sq``, ``trace_cov``) equal those computed from an
independent float64 gradient of each micro-batch alone (mode ``every``; ``first``: each window's first
micro-batch) and of the whole update (1e-10), with uneven targets per micro-batch. Then a
short real run reports a finite positive noise scale for most updates after the first few.
"""

from __future__ import annotations

import math

import pytest

from hf_accum.loop import LoopConfig, LoopConfigError
from hf_accum.testing.launch import job_report
from hf_accum.testing.noise_reference import expected_estimates, relative_errors, run_engine, scenario

EXACT = 1e-10


def _mostly_positive(scales: list, skip: int = 4, share: float = 0.7) -> bool:
    later = scales[skip:]
    good = [s for s in later if s is not None and math.isfinite(s) and s > 0]
    return bool(later) and len(good) >= share * len(later)


@pytest.mark.parametrize("engine", ["loop", "trainer"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1e6])  # the norm measured apart / reused from the clip
@pytest.mark.parametrize("mode", ["every", "first"])
def test_measured_estimates_equal_independent_gradients(engine, max_grad_norm, mode, tmp_path):
    # 18 micro-batches, K=4: windows of 4, 4, 4, 4 and a short 2.
    case = scenario(rows=36, max_grad_norm=max_grad_norm, mode=mode)
    updates, model, _ = run_engine(engine, case, str(tmp_path))
    expected = expected_estimates(model, case.collator.batches, case.accumulation, mode)
    if mode == "every":
        assert [e["micro_batches"] for e in expected] == [4, 4, 4, 4, 2]
    errors = relative_errors(updates, expected)
    assert len(errors) == 2 * len(updates) == 10
    assert max(errors) < EXACT, errors


@pytest.mark.parametrize("engine", ["loop", "trainer"])
@pytest.mark.parametrize("mode", ["every", "first"])
def test_a_wrong_scale_fails_the_same_check(engine, mode, tmp_path):
    """Negative control: the reference with the micro-batch gradients off by Accelerate's 1/K."""
    from hf_accum.measure.noise_scale import SmallBatch, pooled_estimate, update_estimates

    case = scenario(rows=16, mode=mode)
    updates, model, _ = run_engine(engine, case, str(tmp_path))
    expected = expected_estimates(model, case.collator.batches, case.accumulation, mode)
    off = case.accumulation ** 2
    for reference in expected:
        big = reference["big_targets"], reference["big_grad_sq"]
        if mode == "every":
            wrong = pooled_estimate(reference["micro_batches"], reference["weighted_grad_sq"] / off, *big)
        else:
            n, grad_sq = reference["small"][0]
            wrong = update_estimates([SmallBatch(n, grad_sq / off)], *big)
        reference.update(grad_sq=wrong.grad_sq, trace_cov=wrong.trace_cov)
    assert max(relative_errors(updates, expected)) > 1e-3


@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_noise_scale_is_reported_for_most_updates(engine, tmp_path):
    updates, _, advice = run_engine(engine, scenario(rows=64, lr=1e-3, epochs=2), str(tmp_path))
    scales = [u["noise_scale"] for u in updates]
    assert _mostly_positive(scales), scales
    assert all(u["noise_scale"] is None for u in updates[:2])  # the tracker's warm-up
    assert "the measured noise scale is ~" in advice


def test_one_micro_batch_per_update_measures_nothing(tmp_path):
    updates, _, advice = run_engine("loop", scenario(rows=8, accumulation=1), str(tmp_path))
    assert all(u["grad_sq"] is None and u["noise_scale"] is None for u in updates)
    assert advice.startswith("gradient noise scale: not measured")


def test_loop_config_rejects_a_non_bool():
    with pytest.raises(LoopConfigError, match="LoopConfig.noise_scale='yes' must be True or False"):
        LoopConfig(noise_scale="yes")


@pytest.fixture(scope="module")
def ddp_report(loop_ddp_family):
    return job_report(loop_ddp_family, "noise_scale")  # the loop DDP family's one launch (conftest.py)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_two_ranks_gather_every_small_batch(ddp_report, engine):
    assert ddp_report["world_size"] == 2
    # every: each rank's 3, 3 and 2 micro-batches (the synced last one too); first: both ranks' first ones.
    assert ddp_report[f"{engine}_every_small_batches"] == [6, 6, 4]
    assert ddp_report[f"{engine}_first_small_batches"] == [2, 2, 2]
    for mode in ("every", "first"):
        assert max(ddp_report[f"{engine}_{mode}_errors"]) < EXACT, ddp_report[f"{engine}_{mode}_errors"]
    assert _mostly_positive(ddp_report[f"{engine}_noise_scales"]), ddp_report[f"{engine}_noise_scales"]


def _loop_run(output_dir, resume=None):
    """Loop run of 6 updates (K=4), checkpoints every 3; ``resume``: continue from that checkpoint."""
    import torch
    from torch.utils.data import DataLoader

    from hf_accum.loop import train
    from hf_accum.testing import fresh_accelerator

    case = scenario(rows=48, lr=1e-3)
    accelerator = fresh_accelerator(case.accumulation)
    model = case.model_factory()
    optimizer = torch.optim.AdamW(model.parameters(), lr=case.lr)
    loader = DataLoader(case.examples, batch_size=case.micro_batch, shuffle=False, collate_fn=case.collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(noise_scale=True, output_dir=str(output_dir), save_steps=3, disable_tqdm=True,
                        lr_scheduler_type="constant")
    return [u.noise_scale for u in train(model, optimizer, loader, accelerator, config,
                                         resume_from_checkpoint=resume).updates]


@pytest.mark.slow
def test_a_resumed_loop_run_continues_the_same_averages(tmp_path):
    import json
    import shutil

    from hf_accum.checkpointing.checkpoint import LOOP_STATE_FILE
    from hf_accum.checkpointing.manifest import MANIFEST_FILE

    whole = _loop_run(tmp_path / "whole")
    assert len(whole) == 6 and all(s is not None for s in whole[2:])
    resumed = _loop_run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-3"))
    assert resumed[3:] == pytest.approx(whole[3:], rel=1e-12)
    # Negative control: the same checkpoint without the averages starts them over.
    bare = tmp_path / "bare" / "checkpoint-3"
    shutil.copytree(tmp_path / "whole" / "checkpoint-3", bare)
    state = json.loads((bare / LOOP_STATE_FILE).read_text())
    state["noise_scale"] = None
    (bare / LOOP_STATE_FILE).write_text(json.dumps(state))
    (bare / MANIFEST_FILE).unlink()  # edited on purpose: resumed unverified
    restarted = _loop_run(tmp_path / "restarted", resume=str(bare))
    assert restarted[3] is None and whole[3] is not None


def test_a_resumed_trainer_continues_the_same_averages_and_logs_them(tmp_path):
    from hf_accum.testing import run_trainer
    from hf_accum.trainer import AccumTrainer

    def trained(output_dir, resume=None):
        return run_trainer(scenario(rows=48, lr=1e-3), str(output_dir), trainer_cls=AccumTrainer,
                           trainer_kwargs={"noise_scale": True}, resume_from_checkpoint=resume,
                           save_strategy="steps", save_steps=3)

    whole = trained(tmp_path / "whole")
    scales = [u.noise_scale for u in whole.trainer.updates]
    assert len(scales) == 6 and all(s is not None for s in scales[2:])
    assert [log["noise_scale"] for log in whole.logs if "noise_scale" in log] == pytest.approx(scales[2:])
    resumed = trained(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-3"))
    assert [u.noise_scale for u in resumed.trainer.updates][3:] == pytest.approx(scales[3:], rel=1e-12)
