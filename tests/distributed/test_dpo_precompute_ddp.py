"""Precomputed DPO reference log-probs on 2 real CPU processes (torchrun, gloo) with a dataset built in memory and
ranks holding different numbers of pairs (``even_batches=False``; issue 37 item 4): AccumDPOTrainer keeps the
values in memory on every rank and trains exactly as with the live reference; stock ``DPOTrainer`` hands them from
rank 0 to the others through a cache file only rank 0 has, the negative control. Job ``dpo_precompute`` of
tests/distributed/trainer_ddp_worker.py (hf_accum/testing/cases/dpo_precompute_case.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from hf_accum.testing.launch import job_report  # noqa: E402

EXACT = 1e-10
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(trainer_ddp_family):
    return job_report(trainer_ddp_family, "dpo_precompute")  # the Trainer + TRL family's one launch (conftest.py)


def test_precomputed_reference_is_exact_over_uneven_ranks(report):
    run = report["precomputed"]
    print(f"precomputed, in memory, 2 ranks: errors {run['errors']}, versus the live run {run['versus_live']:.1e}")
    assert report["world_size"] == 2
    assert run["pairs"] == [8, 3]  # the last update: 2 pairs on one rank, 1 on the other; every pair once
    assert max(run["errors"]) < EXACT, run["errors"]
    assert run["versus_live"] < EXACT
    assert max(report["live"]["errors"]) < EXACT  # the live run it is compared with is exact itself


def test_every_rank_holds_the_values_in_memory(report):
    for rank in report["datasets"]:
        assert rank == {"reference_columns": ["ref_chosen_logps", "ref_rejected_logps"], "cache_files": 0,
                        "dtypes": ["float64"], "rows": 11}


def test_stock_dpo_trainer_cannot_precompute_in_memory(report):
    """TRL 1.16: rank 0 writes the values to a file in its own temporary directory; rank 1 cannot open it."""
    stock = report["stock"]
    print(f"stock DPOTrainer, precompute_ref_log_probs=True, in-memory dataset: {stock}")
    assert stock[0] == "ok"
    assert stock[1].startswith("FileNotFoundError")
