"""AccumSFTTrainer (AccumTrainer on TRL's SFTTrainer) against the independent big-batch reference, on
TRL's own dataset preparation and collators: completion-only loss (prompt/completion, conversational),
assistant-only loss (messages), plain text, padding-free, packing, label smoothing, activation
checkpointing, LoRA; TRL's logged metrics kept;
stock ``SFTTrainer`` as the negative control. The 2-process case is in tests/distributed/test_sft_ddp.py.

float64 with dtype-keeping norms, so "exact" means < 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

pytest.importorskip("trl")

from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_accum import AccumSFTTrainer  # noqa: E402
from hf_accum.testing import Scenario, run_trainer  # noqa: E402
from hf_accum.testing.sft import answer_targets, sft_model_factory, sft_rows, sft_tokenizer  # noqa: E402

EXACT = 1e-10
TOKENIZER = sft_tokenizer()
# TRL's defaults that would hide the accumulation math in these tests: bf16 autocast (on CPU too)
# and activation checkpointing (tested on its own below).
SFT_TEST_ARGS = {"bf16": False, "activation_checkpointing": False}
TRL_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")


def sft_scenario(name: str, rows, micro_batch: int = 2, accumulation: int = 3, model_factory=None,
                 **sft_args) -> Scenario:
    """``rows`` through TRL's own preparation and collator (``collator=None``). With 20 rows, 2 per
    micro-batch and 3 micro-batches per update: windows of 3, 3, 3, 1 (a short last window)."""
    return Scenario(
        name, model_factory or sft_model_factory(TOKENIZER), rows, collator=None, micro_batch=micro_batch,
        accumulation=accumulation, pad_token_id=TOKENIZER.pad_token_id,
        label_smoothing=sft_args.pop("label_smoothing_factor", 0.0), args={**SFT_TEST_ARGS, **sft_args},
    )


def run_sft(scenario: Scenario, tmp_path, trainer_cls=AccumSFTTrainer):
    return run_trainer(scenario, str(tmp_path / trainer_cls.__name__), trainer_cls, args_cls=SFTConfig,
                       trainer_kwargs={"processing_class": TOKENIZER})


PROMPT_COMPLETION = sft_rows(20, "prompt_completion", seed=1)
CASES = {
    # prompt/completion: TRL's default completion_only_loss=None means True for this format.
    "prompt_completion": sft_scenario("prompt_completion", PROMPT_COMPLETION),
    "conversational_prompt_completion": sft_scenario(
        "conversational_prompt_completion", sft_rows(20, "conversational_prompt_completion", seed=2)
    ),
    "messages_assistant_only": sft_scenario(
        "messages_assistant_only", sft_rows(20, "messages", seed=3), assistant_only_loss=True
    ),
    # TRL's DataCollatorForLanguageModeling flattens each micro-batch into one row (position_ids).
    "padding_free": sft_scenario("padding_free", PROMPT_COMPLETION, padding_free=True, max_length=None),
    # Best-fit-decreasing packing into rows of 32 tokens (no row is longer: nothing is truncated),
    # 2 packed rows per micro-batch, trained padding-free.
    "packing": sft_scenario("packing", sft_rows(40, "prompt_completion", seed=4), packing=True, max_length=32,
                            accumulation=2),
    # Plain text (loss on every token), packed: the usual pre-training-style SFT.
    "text_packing": sft_scenario("text_packing", sft_rows(40, "text", seed=6), packing=True, max_length=32,
                                 accumulation=2),
    "label_smoothing": sft_scenario("label_smoothing", PROMPT_COMPLETION, label_smoothing_factor=0.2),
    "activation_checkpointing": sft_scenario("activation_checkpointing", PROMPT_COMPLETION,
                                             activation_checkpointing=True),
    # A PEFT model (TRL wraps a base model itself when given peft_config; here the auditor needs the
    # adapters before TRL sees the model).
    "lora": sft_scenario("lora", PROMPT_COMPLETION, model_factory=lambda: get_peft_model(
        sft_model_factory(TOKENIZER)(),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )),
    "one_micro_batch_per_update": sft_scenario("one_micro_batch_per_update", PROMPT_COMPLETION, micro_batch=4,
                                               accumulation=1, max_steps=3),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: intra-op threads only contend for the cores (measured ~10x slower with 2
    threads on a loaded 2-core machine). Results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each case trained once, on demand, shared by the tests below."""
    cache = {}

    def get(name: str, trainer_cls=AccumSFTTrainer):
        key = (name, trainer_cls.__name__)
        if key not in cache:
            cache[key] = run_sft(CASES[name], tmp_path_factory.mktemp(name), trainer_cls)
        return cache[key]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_accum_sft_trainer_is_exact(runs, name):
    run = runs(name)
    assert len(run.errors) >= 2
    assert run.max_error < EXACT, run.errors
    # Every update's logged target count is the one the reference took its mean over.
    assert [log["tokens_per_update"] for log in run.update_logs] == [r.targets for r in run.auditor.records]


@pytest.mark.parametrize(
    "name", ["prompt_completion", "conversational_prompt_completion", "messages_assistant_only", "padding_free",
             "packing"]
)
def test_loss_is_on_the_answers_only(runs, name):
    """The targets of the whole run are the answers' tokens (+ EOS), counted from the raw rows: TRL's
    completion / assistant masks reached AccumTrainer's loss, in every collator layout."""
    run = runs(name)
    assert sum(r.targets for r in run.auditor.records) == answer_targets(CASES[name].examples, TOKENIZER)


def test_plain_text_loss_is_on_every_token(runs):
    """Every token of every row (+ its EOS) but the first, which nothing predicts: packing puts no
    target across a sequence boundary."""
    rows = CASES["text_packing"].examples
    expected = sum(len(TOKENIZER(row["text"], add_special_tokens=False)["input_ids"]) for row in rows)
    assert sum(r.targets for r in runs("text_packing").auditor.records) == expected


def test_padding_free_trains_like_padding(runs):
    """Same rows, same order: flattening into one row (no attention mask) must give the padded run's
    exact per-update losses -- so sequences do not attend across their boundaries."""
    padded = [log["loss"] for log in runs("prompt_completion").update_logs]
    flat = [log["loss"] for log in runs("padding_free").update_logs]
    assert flat == pytest.approx(padded, rel=1e-12)


def test_stock_sft_trainer_is_off_in_float64(runs):
    """Negative control: stock SFTTrainer's loss (TRL's fused LM head, fp32 statistics) misses the
    float64 big batch by ~1e-7; AccumSFTTrainer's by ~1e-16. (Across ranks it is far worse:
    tests/distributed/test_sft_ddp.py.)"""
    stock = runs("prompt_completion", SFTTrainer)
    print(f"stock SFTTrainer max rel. error {stock.max_error:.1e}; AccumSFTTrainer "
          f"{runs('prompt_completion').max_error:.1e}")
    assert stock.max_error > 1e3 * EXACT
    assert len(stock.errors) == len(runs("prompt_completion").errors)


@pytest.mark.parametrize("name", ["prompt_completion", "padding_free", "packing"])
def test_trl_metrics_are_logged_every_update(runs, name):
    logs = runs(name).update_logs
    assert logs and all(all(metric in log for metric in TRL_METRICS) for log in logs)
    assert all(0.0 <= log["mean_token_accuracy"] <= 1.0 and log["entropy"] > 0.0 for log in logs)


def test_trl_metrics_match_stock_sft_trainer(runs):
    """With one micro-batch per update (stock TRL averages per-micro-batch ratios, AccumSFTTrainer
    weighs every target of the logged updates alike: the same thing here), the first update's metrics
    (identical weights in both runs) agree with stock TRL's fp32 ones; ``num_tokens`` (input tokens
    seen so far) is equal at every log line."""
    ours, stock = runs("one_micro_batch_per_update").update_logs, runs("one_micro_batch_per_update", SFTTrainer).update_logs
    assert [log["num_tokens"] for log in ours] == [log["num_tokens"] for log in stock]
    assert ours[0]["entropy"] == pytest.approx(stock[0]["entropy"], rel=1e-6)
    assert ours[0]["mean_token_accuracy"] == pytest.approx(stock[0]["mean_token_accuracy"], rel=1e-6)


def test_logged_metrics_are_token_weighted_over_the_update(runs):
    """The first update's ``entropy`` and ``mean_token_accuracy`` (3 micro-batches of 2 rows) equal
    the per-target means over its 6 rows, recomputed here in plain torch from the initial weights."""
    run = runs("prompt_completion")
    rows = [run.trainer.train_dataset[i] for i in range(6)]  # sequential, unshuffled: the first window
    model = CASES["prompt_completion"].model_factory()
    entropies, hits = [], []
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
            targets = torch.tensor(row["labels"][1:])
            is_target = targets.ne(-100)
            log_p = torch.log_softmax(logits[is_target], dim=-1)
            entropies.append(-(log_p.exp() * log_p).sum(-1))
            hits.append(logits[is_target].argmax(-1).eq(targets[is_target]))
    first = run.update_logs[0]
    assert first["entropy"] == pytest.approx(float(torch.cat(entropies).mean()), rel=1e-12)
    assert first["mean_token_accuracy"] == pytest.approx(float(torch.cat(hits).double().mean()), abs=1e-15)


def test_eval_metrics_match_stock_sft_trainer(tmp_path):
    """``evaluate()`` on one batch holding every eval row, before training (identical weights): TRL's
    eval metrics are kept and agree with stock SFTTrainer's (which computes them in fp32)."""
    rows = sft_rows(8, "prompt_completion", seed=5)
    scenario = sft_scenario("eval", rows)
    results = {}
    for trainer_cls in (AccumSFTTrainer, SFTTrainer):
        args = SFTConfig(output_dir=str(tmp_path / trainer_cls.__name__), per_device_eval_batch_size=len(rows),
                         report_to="none", use_cpu=True, **SFT_TEST_ARGS)
        trainer = trainer_cls(model=scenario.model_factory(), args=args, train_dataset=rows, eval_dataset=rows,
                              processing_class=TOKENIZER)
        results[trainer_cls] = trainer.evaluate()
    ours, stock = results[AccumSFTTrainer], results[SFTTrainer]
    for metric in ("eval_loss", "eval_entropy"):
        assert ours[metric] == pytest.approx(stock[metric], rel=1e-6), metric
    assert ours["eval_mean_token_accuracy"] == pytest.approx(stock["eval_mean_token_accuracy"], rel=1e-6)


def test_unsupported_loss_type_is_refused(tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, loss_type="dft", **SFT_TEST_ARGS)
    with pytest.raises(ValueError, match="loss_type='nll' only \\(got 'dft'\\)"):
        AccumSFTTrainer(model=CASES["prompt_completion"].model_factory(), args=args,
                        train_dataset=PROMPT_COMPLETION, processing_class=TOKENIZER)
