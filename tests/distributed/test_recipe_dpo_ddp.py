"""The recipe's DPO trainer engine on 2 CPU processes (torchrun, gloo) from an SFT run's adapter (issue 37 item 4):
``objective=dpo engine=trainer model.adapter=<SFT run>`` trains, its reference the starting policy (the loaded
adapter on), precomputed on both ranks by AccumDPOTrainer in memory. It was refused before (TRL 1.16's precompute
hands the values between ranks through a dataset cache file the recipe's in-memory data lacks: FileNotFoundError on
rank 1; without precompute the reference would have been the base model). The SFT run it starts from runs in the
pytest process (conftest.py ``one_process_run``): it is an input here, and a process of its own would only add a
start-up. Library-level exactness: tests/distributed/test_dpo_precompute_ddp.py."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl")

from hf_accum.recipe.testing import TORCHRUN_2, read_metrics, run_script  # noqa: E402

pytestmark = pytest.mark.slow
DPO = ("objective=dpo", "engine=trainer", "data.num_train_examples=64", "data.num_eval_examples=16",
       "training.max_steps=2", "training.per_device_train_batch_size=4", "global_batch_size=8",
       "training.logging_steps=1", "dpo.sft_weight=0")  # the DPO term alone: policy = reference gives log 2


def test_dpo_trainer_engine_from_an_adapter_on_two_processes(tmp_path, one_process_run):
    sft = one_process_run(tmp_path / "sft", "training.max_steps=4")  # a short SFT run of the embedded default
    out = tmp_path / "dpo"
    proc = run_script(TORCHRUN_2, out, *DPO, f"model.adapter={sft}", timeout=400)
    assert f"adapter from {sft / 'adapter'}" in proc.stdout
    updates = read_metrics(out)["updates"]
    print(f"2 processes, trainer engine, from the SFT adapter: losses {[u['loss'] for u in updates]}")
    assert len(updates) == 2
    # The reference is the starting policy on every rank, so the first update's DPO loss is log 2; the base model as
    # reference (a live reference after the recipe drops TRL's "ref" adapter copy) gives 0.6944 here.
    assert abs(updates[0]["loss"] - math.log(2)) < 1e-6, updates[0]["loss"]
