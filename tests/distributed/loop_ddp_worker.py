"""torchrun worker, the loop DDP family (2 CPU processes, gloo): every check of the loop engine under plain DDP in
ONE launch, as a job table (:mod:`hf_accum.testing.jobs`; process start-up costs more than most checks). Ranks hold
very different token counts throughout. Rank 0 writes ``{job: result}`` to ``argv[1]``; the tests read their job
(tests/distributed/conftest.py, ``loop_ddp_family``).

* ``loop_ddp``: audited gradient errors of the exact and (negative control) naive loops, the LRs, the gradient
  all-reduce rounds counted by a DDP comm hook, the refusal of ranks with different micro-batch counts; ``llava``:
  a tiny LLaVA whose CLIP ``post_layernorm`` gets no gradient, with the loop's default DDP setting;
  ``llava_plain_ddp`` (last: it stops in DDP's reducer): the negative control, DDP as ``accelerator.prepare``
  built it (``ddp_find_unused_parameters=False``);
* ``loop_windows``: ramp-up and token-budget windows; ``rampup_auto``: the auto batch ramp, every rank deciding
  the same;
* ``fused``: the fused loss (loop and AccumTrainer with Trainer's ``find_unused_parameters=True``);
* ``sequence``: per-sequence normalization, both engines (token mode: the negative control);
* ``noise_scale``: the noise-scale estimates against independent gradients, both engines;
* ``moe``: the MoE router loss and encoder-decoders' own objectives, both engines;
* ``compile``: ``LoopConfig(compile=True)`` (aot_eager);
* ``resume_references``: the interrupted-run story's uninterrupted runs, both engines.

Run as ``torchrun --nproc_per_node 2 tests/distributed/loop_ddp_worker.py OUT.json``.
"""

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import functools
import logging
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from accelerate import DistributedDataParallelKwargs

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_naive, run_trainer, tiny_causal_lm
from hf_accum.testing.cases.loop_ddp_case import EXAMPLES, AllReduceCounter
from hf_accum.testing.cases.seq2seq_ddp_case import SEQ2SEQ_DDP_JOBS
from hf_accum.testing.families import VisionCollator, tiny_llava, vlm_rows
from hf_accum.testing.float64 import float64_arithmetic
from hf_accum.testing.jobs import run_job_table
from hf_accum.testing.models import MOE_FAMILIES, tiny_moe_causal_lm


class LogLines(logging.Handler):
    """The messages of one logger while attached (``with LogLines("hf_accum.loop") as lines``)."""

    def __init__(self, logger: str) -> None:
        super().__init__()
        self.logger = logging.getLogger(logger)
        self.messages: list[str] = []

    def __enter__(self) -> "LogLines":
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def ddp_scenario(name: str = "ddp", examples=EXAMPLES, factory=tiny_causal_lm, **options) -> Scenario:
    """The family's common case: 28 rows, micro-batch 2, K=3 (windows of 3, 3 and 1 per rank)."""
    return Scenario(name, factory, examples, PaddingCollator(PAD), micro_batch=2, accumulation=3, **options)


def audited(scenario: Scenario) -> dict:
    """The exact loop's errors, windows, LRs and gradient all-reduce rounds."""
    counter = AllReduceCounter()
    result, exact = run_exact(scenario, on_model=counter.attach)
    return {"updates": len(result.updates), "errors": [r.relative_error for r in exact.records],
            "sequences": [u.sequences for u in result.updates], "targets": [u.targets for u in result.updates],
            "micro_batches": [u.micro_batches for u in result.updates],
            "learning_rates": [u.learning_rate for u in result.updates], "allreduce_rounds": counter.rounds,
            "audited_learning_rates": [r.learning_rate for r in exact.records],
            "changes": [u.batch_change for u in result.updates]}


# -- loop_ddp, llava, llava_plain_ddp ------------------------------------------------------------------


def loop_ddp(out_dir: str) -> dict:
    scheduled = {"epochs": 2, "scheduler": "linear", "warmup_steps": 1}
    exact = audited(ddp_scenario(**scheduled))
    naive = run_naive(ddp_scenario(**scheduled))
    return {"updates": exact["updates"], "targets_per_update": exact["targets"], "exact_errors": exact["errors"],
            "naive_errors": [r.relative_error for r in naive.records],
            "learning_rates": exact["audited_learning_rates"],
            "allreduce_rounds": exact["allreduce_rounds"], "uneven_ranks_error": uneven_ranks_refusal()}


def uneven_ranks_refusal() -> str:
    """26 rows with even_batches=False: 7 micro-batches on rank 0, 6 on rank 1. Without the check,
    rank 0's last window would wait forever in an all-reduce rank 1 never joins."""
    from accelerate import DataLoaderConfiguration

    uneven = ddp_scenario("uneven", EXAMPLES[:26],
                          accelerator_kwargs={"dataloader_config": DataLoaderConfiguration(even_batches=False)})
    try:
        run_exact(uneven)
    except ValueError as error:
        return str(error)
    return ""


def unused_parameters(find_unused: bool | None) -> dict:
    """LLaVA (``vision_feature_layer=-1``: CLIP's ``post_layernorm`` gets no gradient), 2 updates of K=3 per
    rank; the loop's DDP setting ``find_unused`` (None: the loop decides, as Trainer does). The run's audited
    errors, all-reduce rounds, the loop's log lines about it, or the error that stopped it."""
    scenario = Scenario("llava", tiny_llava, vlm_rows(24, seed=3), VisionCollator(PAD), micro_batch=2,
                        accumulation=3, loop_kwargs={"ddp_find_unused_parameters": find_unused})
    counter = AllReduceCounter()
    run: dict = {"error": "", "errors": [], "updates": 0}
    with LogLines("hf_accum.loop") as lines:
        try:
            with float64_arithmetic():
                result, exact = run_exact(scenario, on_model=counter.attach)
            run.update(updates=len(result.updates), errors=[r.relative_error for r in exact.records])
        except RuntimeError as error:  # the negative control: DDP's reducer
            run["error"] = str(error).splitlines()[0]
    run.update(allreduce_rounds=counter.rounds, ddp_lines=[m for m in lines.messages if "find_unused" in m])
    return run


# -- windows: ramp-up, token budgets, the auto ramp -------------------------------------------------------

# 28 rows per epoch; global batch 2 x 2 x 3 = 12, ramp from 4 by 4.
WINDOW_SETTINGS = {"rampup": {"rampup_batch_size": [4, 4, 16]}, "tokens": {"tokens_per_update": 120}}
# 64 rows, micro-batch 2 -> 16 micro-batches per rank and epoch; K up to 8: global batch 32, start 2 x 2 x 2 = 8.
AUTO_EXAMPLES = random_rows(64, seed=21, min_len=3, max_len=40, long_rows=lambda i: (i // 2) % 2 == 0)
EAGER = {"margin": 0.5, "release": 0.25, "patience": 2, "min_updates": 2, "lr_rule": "sqrt"}


def loop_windows(out_dir: str) -> dict:
    return {name: audited(ddp_scenario("ddp_windows", epochs=2, scheduler="linear", warmup_steps=1,
                                       loop_kwargs=loop_kwargs))
            for name, loop_kwargs in WINDOW_SETTINGS.items()}


def rampup_auto(out_dir: str) -> dict:
    scenario = Scenario("auto_ddp", tiny_causal_lm, AUTO_EXAMPLES, PaddingCollator(PAD), micro_batch=2,
                        accumulation=8, epochs=2, scheduler="linear",
                        loop_kwargs={"rampup_batch_size": "auto", "warmup_ratio": 0.1, "rampup_auto": EAGER})
    run = audited(scenario)
    seen = list(zip(run["sequences"], run["changes"], run["learning_rates"]))
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, seen)
    return {**run, "ranks_agree": all(other == every_rank[0] for other in every_rank)}


# -- the fused loss ---------------------------------------------------------------------------------------


def fused(out_dir: str) -> dict:
    """The loop with the fused loss and the logits path (the same all-reduce rounds: the fused head runs inside
    DDP's forward); AccumTrainer with Trainer's default ``ddp_find_unused_parameters`` (True here), on a plain
    Llama and on LoRA + ``modules_to_save=["lm_head", "embed_tokens"]``."""
    with LogLines("hf_accum.fused.loss") as lines:
        report = {"loop_fused": _fused_loop(lines), "loop_logits": _fused_loop(lines, fused_loss=False),
                  "trainer_plain": _fused_trainer(lines, tiny_causal_lm, os.path.join(out_dir, "plain")),
                  "trainer_modules_to_save": _fused_trainer(lines, _modules_to_save, os.path.join(out_dir, "mts"))}
    report["fused_off_lines"] = sum("fused linear cross-entropy off" in m for m in lines.messages)
    return report


def _fused_on_lines(lines: LogLines) -> int:
    return sum("fused linear cross-entropy on" in m for m in lines.messages)


def _fused_loop(lines: LogLines, **loop_kwargs) -> dict:
    before = _fused_on_lines(lines)
    run = audited(ddp_scenario("fused_ddp", loop_kwargs=loop_kwargs))
    return {**run, "fused": _fused_on_lines(lines) > before}


def _fused_trainer(lines: LogLines, factory, out_dir: str) -> dict:
    before = _fused_on_lines(lines)
    run = run_trainer(ddp_scenario("fused_ddp", factory=factory), out_dir, AccumTrainer)
    find_unused = getattr(run.trainer.model_wrapped, "find_unused_parameters", None)
    return {"errors": run.errors, "fused": _fused_on_lines(lines) > before, "find_unused_parameters": find_unused}


def _modules_to_save():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        modules_to_save=["lm_head", "embed_tokens"])
    return get_peft_model(tiny_causal_lm(), config).to(torch.float64)


# -- per-sequence normalization, the noise scale ----------------------------------------------------------


def sequence(out_dir: str) -> dict:
    """28 rows, micro-batch 2, K=3: windows of 3, 3 and a short 1 on each rank; token mode the negative control."""
    from hf_accum.testing.sequence_reference import run

    examples = random_rows(28, seed=33, prompt_masking=True)
    report = {}
    for engine in ("loop", "trainer"):
        for mode in ("sequence", "token"):
            with tempfile.TemporaryDirectory() as output_dir:
                errors, _ = run(engine, PaddingCollator(PAD), examples, mode, output_dir, accumulation=3)
            report[f"{engine}_{mode}"] = errors
    return report


def noise_scale(out_dir: str) -> dict:
    """Per engine and mode the relative errors of the logged raw estimates against the independent reference
    (every micro-batch of every rank, or every rank's first micro-batch), and a short real run's noise scales."""
    from hf_accum.testing.noise_reference import expected_estimates, relative_errors, run_engine, scenario

    report = {}
    for engine in ("loop", "trainer"):
        with tempfile.TemporaryDirectory() as output_dir:
            for mode in ("every", "first"):
                case = scenario(rows=32, accumulation=3, mode=mode)  # 8 micro-batches per rank: windows 3, 3, 2
                updates, model, _ = run_engine(engine, case, output_dir)
                expected = expected_estimates(model, case.collator.batches, case.accumulation, mode)
                report[f"{engine}_{mode}_errors"] = relative_errors(updates, expected)
                report[f"{engine}_{mode}_small_batches"] = [
                    e["micro_batches"] if mode == "every" else len(e["small"]) for e in expected]
            trained, _, advice = run_engine(engine, scenario(rows=64, lr=1e-3, epochs=3), output_dir)
            report[f"{engine}_noise_scales"] = [u["noise_scale"] for u in trained]
            report[f"{engine}_advice"] = advice
    return report


# -- what a model's own loss holds: the MoE router loss, encoder-decoders -----------------------------------

COEF = 0.02
MOE_UNEVEN = random_rows(24, seed=21, min_len=3, max_len=40, prompt_masking=True,
                         long_rows=lambda i: (i // 2) % 2 == 0)
MOE_SAME = random_rows(2, seed=4, prompt_masking=True) * 12  # every micro-batch of both ranks: the same 2 rows


def moe(out_dir: str) -> dict:
    """Mixtral and Qwen2-MoE in float64, loop and AccumTrainer, fused and logits paths: every update against the
    rule's reference (the token-weighted mean of every micro-batch's router loss, all ranks), and with every
    micro-batch holding the same rows against the big batch's own gradient and router loss (its weight does not
    grow with the ranks). Encoder-decoders: every update against the model's own ``forward(labels=...)`` loss on
    the update's joined batch of both ranks (:class:`hf_accum.testing.seq2seq.Seq2SeqAuditor`)."""
    report: dict = {}
    with float64_arithmetic():
        for job in SEQ2SEQ_DDP_JOBS:
            report[":".join(job)] = _seq2seq_errors(*job[:2], job[2] == "decoder_input_ids", job[3], out_dir)
        for family in MOE_FAMILIES:
            for front_end in ("loop_fused", "loop_logits", "trainer_fused", "trainer_logits"):
                report[f"{family}:{front_end}:uneven"] = _moe_run(front_end, family, MOE_UNEVEN, "per_micro_batch",
                                                                  out_dir)
            for front_end in ("loop_fused", "trainer_fused"):
                report[f"{family}:{front_end}:same"] = _moe_run(front_end, family, MOE_SAME, "big_batch", out_dir)
            report[f"{family}:one_copy_router_term"] = _one_copy_router_term(family)
    return report


def _moe_run(front_end: str, family: str, rows, router_loss: str, out_dir: str) -> dict:
    factory = functools.partial(tiny_moe_causal_lm, family, router_aux_loss_coef=COEF)
    scenario = Scenario(
        f"moe_ddp:{family}", factory, rows, PaddingCollator(PAD), micro_batch=2, accumulation=3,
        router_loss=router_loss, loop_kwargs={"fused_loss": front_end.endswith("fused")},
        # An expert no token of a micro-batch picks gets no gradient.
        accelerator_kwargs={"kwargs_handlers": [DistributedDataParallelKwargs(find_unused_parameters=True)]},
    )
    if front_end.startswith("loop"):
        result, auditor = run_exact(scenario)
        updates = result.updates
    else:
        directory = os.path.join(out_dir, f"{front_end}-{family}-{router_loss}")
        run = run_trainer(scenario, directory, AccumTrainer, trainer_kwargs={"fused_loss": front_end.endswith("fused")})
        auditor, updates = run.auditor, run.trainer.updates
    return {"errors": [r.relative_error for r in auditor.records], "aux_loss": [u.aux_loss for u in updates],
            "loss": [u.loss for u in updates], "reference_loss": [r.reference_loss for r in auditor.records]}


def _one_copy_router_term(family: str) -> float:
    """``coef * aux`` of one micro-batch of MOE_SAME, at the initial weights."""
    batch = PaddingCollator(PAD)(MOE_SAME[:2])
    batch.pop("labels")
    with torch.no_grad():
        return float(COEF * tiny_moe_causal_lm(family, router_aux_loss_coef=COEF)(**batch).aux_loss)


def _seq2seq_errors(family: str, lengths: str, decoder_inputs: bool, front_end: str, out_dir: str) -> list[float]:
    """One encoder-decoder job: 12 rows per rank, K = 3 micro-batches of 2 rows, 2 updates."""
    from hf_accum.testing.seq2seq import seq2seq_rows, seq2seq_scenario

    rows = seq2seq_rows(24, seed=11, equal_lengths=lengths == "equal_lengths")
    scenario = seq2seq_scenario(family, rows, decoder_inputs)
    if front_end == "loop":
        return [r.relative_error for r in run_exact(scenario)[1].records]
    directory = os.path.join(out_dir, f"seq2seq-{family}-{lengths}-{decoder_inputs}")
    return run_trainer(scenario, directory, AccumTrainer).errors


# -- compile ----------------------------------------------------------------------------------------------


def compiled(out_dir: str) -> dict:
    """``LoopConfig(compile=True)``, aot_eager: Dynamo's capture and AOTAutograd's joint graph, no C++ build."""
    from hf_accum.compile import compiled_blocks

    models: list = []
    counter = AllReduceCounter()

    def attach(model) -> None:
        counter.attach(model)
        models.append(model)

    scenario = ddp_scenario("compiled_ddp", loop_kwargs={"compile": True, "compile_backend": "aot_eager"})
    result, auditor = run_exact(scenario, on_model=attach)
    return {"updates": len(result.updates), "errors": [r.relative_error for r in auditor.records],
            "allreduce_rounds": counter.rounds, "compiled_blocks": compiled_blocks(models[0])}


# -- the interrupted-run story's uninterrupted references ------------------------------------------------------


def resume_references(out_dir: str) -> dict:
    """The uninterrupted 2-process run of hf_accum/testing/cases/{loop,trainer}_resume_worker.py (tag ``ref``),
    the reference tests/distributed/test_interrupted_runs_ddp.py stitches its killed and resumed launches against
    (those must be launches of their own: they are killed). Returns engine -> its output folder."""
    from hf_accum.testing.cases import loop_resume_worker, trainer_resume_worker
    from hf_accum.testing.interruptions import parse_args

    folders = {engine: os.path.join(out_dir, engine) for engine in ("loop", "trainer")}
    for folder in folders.values():
        os.makedirs(folder, exist_ok=True)
    loop_resume_worker.run(parse_args([folders["loop"], "ref"]))
    trainer_resume_worker.run(parse_args([folders["trainer"], "ref"]))
    return folders


JOBS = {
    "loop_ddp": loop_ddp,
    "llava": lambda out_dir: unused_parameters(None),
    "loop_windows": loop_windows,
    "rampup_auto": rampup_auto,
    "fused": fused,
    "sequence": sequence,
    "noise_scale": noise_scale,
    "moe": moe,
    "compile": compiled,
    "resume_references": resume_references,
    "llava_plain_ddp": lambda out_dir: unused_parameters(False),  # last: it stops in DDP's reducer
}


if __name__ == "__main__":
    run_job_table(JOBS, sys.argv[1])
    leave_process_group()  # a no-op after run_job_table, which left the group
