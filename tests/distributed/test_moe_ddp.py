"""What a model's own loss holds beyond our cross-entropy, on 2 real CPU processes (torchrun, gloo): the MoE router
loss, and encoder-decoders building their decoder inputs from the labels. Job ``moe`` of tests/distributed/loop_ddp_worker.py."""

from __future__ import annotations

import pytest

from hf_accum.testing.cases.seq2seq_ddp_case import SEQ2SEQ_DDP_JOBS
from hf_accum.testing.launch import job_report
from hf_accum.testing.models import MOE_FAMILIES

EXACT = 1e-10
FRONT_ENDS = ("loop_fused", "loop_logits", "trainer_fused", "trainer_logits")


@pytest.fixture(scope="module")
def report(loop_ddp_family):
    return job_report(loop_ddp_family, "moe")  # the loop DDP family's one launch (conftest.py)


@pytest.mark.slow
def test_two_processes_really_started(report):
    assert report["world_size"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_updates_are_exact_with_the_router_loss_of_every_rank(report, family, front_end):
    run = report[f"{family}:{front_end}:uneven"]
    assert len(run["errors"]) >= 2 and max(run["errors"]) < EXACT, run["errors"]
    for loss, aux, reference in zip(run["loss"], run["aux_loss"], run["reference_loss"]):
        assert abs(loss + aux - reference) < 1e-12 * reference


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["loop_fused", "trainer_fused"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_router_term_does_not_grow_with_the_ranks(report, family, front_end):
    """Same rows everywhere: the big batch's gradient, and the logged term is one micro-batch's."""
    run = report[f"{family}:{front_end}:same"]
    assert len(run["errors"]) == 2 and max(run["errors"]) < EXACT, run["errors"]
    assert run["aux_loss"][0] == pytest.approx(report[f"{family}:one_copy_router_term"], rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("job", SEQ2SEQ_DDP_JOBS, ids=":".join)
def test_encoder_decoders_train_on_their_own_objective_over_ranks(report, job):
    """Labels-only or with decoder_input_ids, against the model's own forward(labels=...) loss of both ranks' rows."""
    errors = report[":".join(job)]
    assert len(errors) == 2 and max(errors) < EXACT, errors
