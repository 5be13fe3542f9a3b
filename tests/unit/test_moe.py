"""MoE router losses in every front-end, and no silent drop of any term a model adds to its loss.

The rule (hf_accum.losses.micro_batch.MicroBatchLoss): micro-batch k (n_k targets, router loss aux_k) adds
``coef * aux_k * n_k`` to its loss sum, so an update minimizes ``CE mean + coef * sum_k (n_k / N) aux_k``.
Each property is measured in float64 against the independent reference of hf_accum.verify, under
:func:`hf_accum.testing.float64.float64_arithmetic` (the routers' float32 softmax would otherwise put a
~1e-9 floor under the comparison). Mixtral and Qwen2-MoE; the loop and AccumTrainer, fused and logits
paths; AccumSFTTrainer; stock Trainer as the negative control. Two processes: tests/distributed/test_moe_ddp.py.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from transformers import Trainer
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.losses.model_loss import UnaccountedLossTerm
from hf_accum.testing import (
    PAD,
    Scenario,
    random_rows,
    run_exact,
    run_trainer,
    tiny_causal_lm,
)
from hf_accum.testing.float64 import float64_arithmetic
from hf_accum.testing.models import MOE_FAMILIES, router_parameters, tiny_moe_causal_lm

EXACT = 1e-10
COEF = 0.02
K = 3
UNEVEN = random_rows(14, seed=3, prompt_masking=True)  # windows of 3, 3 and a short 1 micro-batch
SAME = random_rows(2, seed=4, prompt_masking=True) * (2 * K)  # every micro-batch holds the same 2 rows
FRONT_ENDS = ("loop_fused", "loop_logits", "trainer_fused", "trainer_logits")


def moe_scenario(family: str, rows, router_loss: str, coef: float = COEF, accumulation: int = K) -> Scenario:
    factory = functools.partial(tiny_moe_causal_lm, family, router_aux_loss_coef=coef)
    return Scenario(f"{family}:{router_loss}", factory, rows, PaddingCollator(PAD), micro_batch=2,
                    accumulation=accumulation, router_loss=router_loss)


def audited_run(scenario: Scenario, front_end: str, tmp_path, caplog) -> tuple[list[float], list]:
    """(relative errors per update, update logs) of one front-end; asserts the path it took."""
    fused = front_end.endswith("fused")
    caplog.set_level(logging.INFO, logger="hf_accum.fused.loss")
    caplog.clear()
    with float64_arithmetic():
        if front_end.startswith("loop"):
            scenario.loop_kwargs = {"fused_loss": fused}
            result, auditor = run_exact(scenario)
            updates = result.updates
        else:
            run = run_trainer(scenario, str(tmp_path / front_end), AccumTrainer, trainer_kwargs={"fused_loss": fused})
            auditor, updates = run.auditor, run.trainer.updates
    assert ("fused linear cross-entropy on" in caplog.text) == fused
    return [r.relative_error for r in auditor.records], updates, auditor


# -- the update's objective: exact against the rule, and the big batch's with identical micro-batches ---


@pytest.mark.slow
@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_update_is_exact_with_the_token_weighted_router_loss(family, front_end, tmp_path, caplog):
    errors, updates, auditor = audited_run(moe_scenario(family, UNEVEN, "per_micro_batch"), front_end, tmp_path, caplog)
    assert len(errors) == 3 and max(errors) < EXACT, errors
    # The logged loss is the cross-entropy; the router term is logged apart, and the two add up to the objective.
    for update, record in zip(updates, auditor.records):
        assert update.aux_loss is not None and 0.5 * COEF < update.aux_loss < 5 * COEF
        assert abs(update.loss + update.aux_loss - record.reference_loss) < 1e-12 * record.reference_loss


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_identical_micro_batches_give_the_big_batch_gradient_with_its_router_loss(family, front_end, tmp_path, caplog):
    """The big batch of K copies has the same router loss as one copy: its weight does not grow with K."""
    errors, updates, _ = audited_run(moe_scenario(family, SAME, "big_batch"), front_end, tmp_path, caplog)
    assert len(errors) == 2 and max(errors) < EXACT, errors
    one, single, _ = audited_run(moe_scenario(family, SAME[:2], "big_batch", accumulation=1), front_end, tmp_path,
                                 caplog)
    assert max(one) < EXACT
    # K=1 and K=3 log the same router term: one copy's.
    assert updates[0].aux_loss == pytest.approx(single[0].aux_loss, rel=1e-12)


@pytest.mark.parametrize("kernel", ["eager_float64", "default_float32"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_router_loss_reaches_the_router_weights(family, kernel):
    """The routers' gradient differs from the coef=0 run (the bug this fixes: bit-identical to it), in float64
    with eager experts and in float32 with the default (grouped-mm) experts kernel."""
    batch = PaddingCollator(PAD)(UNEVEN[:2])
    labels = batch.pop("labels")
    settings = {} if kernel.startswith("eager") else {"dtype": torch.float32, "experts_implementation": None}

    def router_grads(coef):
        model = tiny_moe_causal_lm(family, router_aux_loss_coef=coef, **settings).train()
        _, loss_sum, _ = MicroBatchLoss()(model, batch, labels)
        loss_sum.backward()
        return torch.cat([p.grad.reshape(-1) for p in router_parameters(model).values()])

    with_aux, without = router_grads(COEF), router_grads(0.0)
    assert float((with_aux - without).norm() / without.norm()) > 1e-2


def test_stock_trainer_adds_the_router_loss_k_times(tmp_path):
    """Negative control: stock Trainer adds ``coef * aux_k`` per micro-batch (Mixtral normalizes its CE by
    num_items_in_batch): with identical micro-batches its router term weighs K times the big batch's."""
    grads = {}
    for name, cls, coef in (("stock", Trainer, COEF), ("ours", AccumTrainer, COEF), ("ce_only", AccumTrainer, 0.0)):
        scenario = moe_scenario("mixtral", SAME[: 2 * K], "big_batch", coef=coef)
        with float64_arithmetic():
            run = run_trainer(scenario, str(tmp_path / name), cls, record_grads=True)
        grads[name] = run.grads[0]
        if name == "ours":
            assert run.max_error < EXACT
        if name == "stock":
            assert run.max_error > 1e-3, run.errors
    stock_aux, our_aux = grads["stock"] - grads["ce_only"], grads["ours"] - grads["ce_only"]
    assert float((stock_aux - K * our_aux).norm() / (K * our_aux).norm()) < 1e-8


# -- AccumSFTTrainer: no longer refuses router_aux_loss_coef > 0 ---------------------------------------


@pytest.mark.parametrize(("family", "sft_coef"), [("mixtral", None), ("qwen2_moe", None), ("mixtral", 0.05)])
def test_accum_sft_trainer_adds_the_router_loss(family, sft_coef, tmp_path):
    """TRL's collator and dataset preparation; ``SFTConfig.router_aux_loss_coef`` (0.05) replaces the model's."""
    pytest.importorskip("trl")
    from trl import SFTConfig

    from hf_accum import AccumSFTTrainer
    from hf_accum.testing.sft import sft_rows, sft_tokenizer

    tokenizer = sft_tokenizer()
    factory = functools.partial(tiny_moe_causal_lm, family, router_aux_loss_coef=COEF, vocab_size=len(tokenizer),
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                bos_token_id=None)
    scenario = Scenario(f"sft:{family}", factory, sft_rows(14, "prompt_completion", seed=1), collator=None,
                        micro_batch=2, accumulation=K, pad_token_id=tokenizer.pad_token_id,
                        router_loss="per_micro_batch", args={"bf16": False, "activation_checkpointing": False,
                                                             "router_aux_loss_coef": sft_coef})
    with float64_arithmetic():
        run = run_trainer(scenario, str(tmp_path / "sft"), AccumSFTTrainer, args_cls=SFTConfig,
                          trainer_kwargs={"processing_class": tokenizer})
    assert len(run.errors) == 3 and run.max_error < EXACT, run.errors
    logged = run.update_logs
    coef = sft_coef or COEF
    # A router loss of 4 experts, top-2, is about 2 (1 per chosen expert when balanced): coef x 2.
    assert all("aux_loss" in log and 1.5 * coef < log["aux_loss"] < 2.5 * coef for log in logged), logged
    assert all(u.aux_loss is not None for u in run.trainer.updates)


# -- a term the model adds that hf_accum does not know: the run stops ----------------------------------


class ZLossForCausalLM(torch.nn.Module):
    """A causal LM whose own loss adds an output z-loss (``z * mean(logsumexp(logits)^2)``), unknown to hf_accum."""

    def __init__(self, z: float = 1e-3):
        super().__init__()
        self.inner = tiny_causal_lm()
        self.config = self.inner.config
        self.z = z

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        loss = None
        if labels is not None:
            logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
            loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
            loss = loss + self.z * out.logits.logsumexp(-1).pow(2).mean()
        return CausalLMOutputWithPast(loss=loss, logits=out.logits)


def _probe(model):
    batch = PaddingCollator(PAD)(UNEVEN[:2])
    labels = batch.pop("labels")
    return MicroBatchLoss(kind="causal_lm")(model.train(), batch, labels)


def test_an_unknown_term_in_the_models_loss_stops_the_run():
    with pytest.raises(UnaccountedLossTerm, match=r"ZLossForCausalLM's own loss .* \+ [0-9.e-]+ from a term hf_accum"):
        _probe(ZLossForCausalLM())


def test_the_probe_passes_a_model_without_extra_terms_and_a_known_router_loss():
    """Controls: z=0 (nothing added) and a MoE model (its router term is known) train; the opt-out attribute
    lets the z-loss model train on the cross-entropy alone."""
    _probe(ZLossForCausalLM(z=0.0))
    _probe(tiny_moe_causal_lm("mixtral"))
    model = ZLossForCausalLM()
    model.hf_accum_drop_model_loss_terms = True
    _, loss_sum, n_targets = _probe(model)
    assert torch.isfinite(loss_sum) and int(n_targets) > 0


def test_the_loop_and_trainer_stop_on_an_unknown_term(tmp_path):
    scenario = Scenario("zloss", ZLossForCausalLM, UNEVEN, PaddingCollator(PAD), micro_batch=2, accumulation=K)
    with pytest.raises(UnaccountedLossTerm):
        run_exact(scenario)
    with pytest.raises(UnaccountedLossTerm):
        run_trainer(scenario, str(tmp_path / "trainer"), AccumTrainer, trainer_kwargs={"loss_kind": "causal_lm"})
