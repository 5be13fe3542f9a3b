"""The benchmarks (``benchmarks/``) through ``hf-accum bench``, end to end on tiny settings: their
outputs, refusals, memory instruments, and the thin entry point's message when no checkout is there.

No timing target is asserted here: unit tests share the machine with other jobs, and the
targets are checked by the benchmark itself, which measures ratios side by side.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import statistics

import pytest
import torch

from benchmarks.harness import SavedActivations, measure_memory
from benchmarks.report import judge, median_interval
from benchmarks.softcap import VARIANTS as SOFTCAP_VARIANTS
from benchmarks.vocab import VARIANTS
from hf_accum import cli
from hf_accum.cli import main
from hf_accum.measure.peak_flops import PEAK_FLOPS_ENV

TINY = [
    "bench", "--global-batch-size", "4", "--accumulation-steps", "1", "2", "4", "--updates", "1",
    "--repeats", "1", "--min-length", "4", "--max-length", "12", "--overhead-accumulation", "2",
    "--overhead-repeats", "2", "--memory-micro-batch", "1", "--memory-accumulation", "2",
    "--padding-micro-batch", "2", "--padding-accumulation", "2", "--padding-updates", "1", "--padding-repeats", "1",
    "--loss-vocab", "512", "--loss-tokens", "64", "--no-progress",
]


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _fraction(value) -> bool:
    """An MFU: a finite fraction in (0, 1] (printed as a percentage in (0, 100])."""
    return _positive_finite(value) and value <= 1


# The MFU line under a table: its peak is tests/conftest.py's $HF_ACCUM_PEAK_FLOPS (1e11 FLOP/s).
MFU_MEANING = "MFU: model FLOPs (hf_accum.measure.utilization) / wall time / peak 100 GFLOP/s float32 (configured by $HF_ACCUM_PEAK_FLOPS)"
MFU_PRINTED = r"MFU\s+(\d+\.\d)%"


def _printed_mfu(line: str) -> float:
    """The MFU a table line prints, as a percentage (the assertion fails on n/a or none). Callers compare it with
    bench.json's value, which must be in (0, 1]: printed with one decimal, a tiny run's 0.04% would read 0.0%."""
    match = re.search(MFU_PRINTED, line)
    assert match, line
    value = float(match[1])
    assert 0 <= value <= 100, line
    return value


@pytest.mark.slow  # more than a few seconds (a subprocess, a real model or a whole bench run): CI only
def test_bench_writes_table_plot_and_json(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main([*TINY, "--only", "sweep", "overhead", "memory", "padding", "loss", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out

    report = json.loads((out / "bench.json").read_text())
    png = (out / "accumulation_tradeoff.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000

    sections = report["sections"]
    rows = sections["sweep"]["rows"]
    assert [r["accumulation_steps"] for r in rows] == [1, 2, 4]
    assert [r["micro_batch"] for r in rows] == [4, 2, 1]
    for row in rows:
        for key in ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "peak_memory_bytes",
                    "peak_saved_activation_bytes"):
            assert _positive_finite(row[key]), (key, row)
        assert 0.0 <= row["padding_fraction"] < 1.0
    # Two tables (variable-length rows, then equal-length rows), one row per K, every column filled:
    # K, micro-batch, pad, tokens/s (min-max), % of K=1 (min-max), peak memory, x K=1, fixed part, activations.
    assert re.search(r"K micro\s+pad\s+tokens/s\s+\(min-max\)\s+% of K=1\s+\(min-max\)\s+peak memory\s+x K=1\s+"
                     r"fixed part\s+activations\s+saved activ\.\s+MFU", printed)
    table_rows = [re.match(r"\s*(\d+)\s+(\d+)\s+(\d+\.\d)%\s+\d+\s+\(\d+-\d+\)\s+(\d+)%\s+\(\d+-\d+%\)\s+[\d.]+ MiB\s+"
                           r"([\d.]+)x\s+[\d.]+ MiB\s+[\d.]+ MiB.*", line) for line in printed.splitlines()]
    parsed = [(int(m[1]), int(m[2])) for m in table_rows if m]
    assert parsed == [(1, 4), (2, 2), (4, 1)] * 2  # one row per K, in each sweep
    first_rows = [m for m in table_rows if m and m[1] == "1"]
    assert [(m[4], m[5]) for m in first_rows] == [("100", "1.00")] * 2  # K=1 is the reference: 100%, 1.00x
    equal = sections["sweep"]["equal_length"]
    assert [r["accumulation_steps"] for r in equal["rows"]] == [1, 2, 4]
    assert all(r["padding_fraction"] == 0.0 for r in equal["rows"])  # equal lengths: no padding at any K
    for row in rows + equal["rows"]:
        assert 0 < row["fixed_bytes"] <= row["peak_memory_bytes"]
        assert row["activation_bytes"] == row["peak_memory_bytes"] - row["fixed_bytes"]
        assert _positive_finite(row["tokens_per_s_percent"]) and _positive_finite(row["memory_multiple"])
    # MFU per K: the same model FLOPs at every K (padding is not counted), over each K's wall time.
    assert sections["sweep"]["peak"] in MFU_MEANING and printed.count(MFU_MEANING) == 2  # once per table
    for sweep_rows in (rows, equal["rows"]):
        assert all(_fraction(row["mfu"]) for row in sweep_rows), sweep_rows
        assert _positive_finite(sweep_rows[0]["flops"])
        assert [row["flops"] for row in sweep_rows] == pytest.approx([sweep_rows[0]["flops"]] * len(sweep_rows))
    printed_mfu = [re.search(r"(\d+\.\d)%$", m[0]) for m in table_rows if m]
    assert [float(m[1]) for m in printed_mfu if m] == [
        pytest.approx(100 * row["mfu"], abs=0.051) for row in rows + equal["rows"]]  # the last column, per K
    conclusion = sections["sweep"]["conclusion"]
    assert conclusion[0].startswith("Accumulation saves activation memory only")
    assert any("At equal padding" in line for line in conclusion)
    assert all(f"=> {line}" in printed for line in conclusion)

    assert _positive_finite(sections["overhead"]["ratio"]) and len(sections["overhead"]["ratios"]) == 2
    overhead = sections["overhead"]  # MFU beside the ratio: the same model FLOPs over each loop's wall time
    assert _positive_finite(overhead["ours_mfu"]) and _positive_finite(overhead["bare_mfu"])
    assert overhead["ours_mfu"] / overhead["bare_mfu"] == pytest.approx(overhead["ours_tokens_per_s"]
                                                                        / overhead["bare_tokens_per_s"])
    assert re.search(r"MFU \(wall time\): ours \d+\.\d%, bare \d+\.\d%", printed)
    memory = sections["memory"]
    assert _positive_finite(memory["single_bytes"]) and _positive_finite(memory["accumulated_bytes"])
    assert _positive_finite(memory["ratio"])
    loss = sections["loss"]
    assert _positive_finite(loss["chunked_peak_bytes"]) and _positive_finite(loss["plain_peak_bytes"])
    assert sections["padding"] is not None
    assert len(report["summary"]) == 5  # one row per measured target
    assert {row["verdict"] for row in report["summary"]} <= {"PASS", "FAIL", "INCONCLUSIVE", "UNMEASURED"}
    assert "Summary" in printed
    assert report["config"]["accumulation_steps"] == [1, 2, 4] and report["config"]["loss_vocab"] == 512


def test_sections_can_be_selected(tmp_path):
    out = tmp_path / "only-loss"
    assert main([*TINY, "--only", "loss", "--output-dir", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert set(report["sections"]) == {"loss"} and report["model"] == ""  # the shared model was never built
    assert not (out / "accumulation_tradeoff.png").exists()  # no sweep, no plot


VOCAB_TINY = ["--vocab-sizes", "512", "--vocab-min-length", "4", "--vocab-max-length", "8",
              "--vocab-hidden-size", "32", "--vocab-pairs", "1", "--threads", "1"]


BASE_FRONT_ENDS = {"trainer", "accum_trainer", "accelerate_loop", "hf_accum_train"}
SEQUENCE_FRONT_ENDS = {"accum_sequence", "accum_sequence_logits"}  # --vocab-sequence-normalization


@pytest.fixture(scope="module")
def vocab_run(tmp_path_factory) -> tuple[str, dict]:
    """ONE vocab section run with --vocab-sequence-normalization (the default front-ends and the sequence pair in
    one helper process), read by the two tests below: what it printed and its bench.json section. The front-ends
    run without the flag: test_vocab_section_runs_the_sequence_front_ends_only_when_asked."""
    out = tmp_path_factory.mktemp("vocab-sequence")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "--only", "vocab", *VOCAB_TINY, "--no-progress", "--vocab-sequence-normalization",
                     "--output-dir", str(out)])
    assert code == 0
    return printed.getvalue(), json.loads((out / "bench.json").read_text())["sections"]["vocab"]


@pytest.mark.slow
def test_vocab_section_prints_its_ratios(vocab_run):
    printed, vocab = vocab_run

    (row,) = vocab["rows"]
    assert row["vocab_size"] == 512
    assert set(row["runs"]) == BASE_FRONT_ENDS | SEQUENCE_FRONT_ENDS
    for runs in row["runs"].values():
        (run,) = runs
        assert run["updates"] == 2 and _positive_finite(run["wall"]) and _positive_finite(run["cpu"])
        assert _positive_finite(run["peak_bytes"])
    pairs = {(c["ours"], c["baseline"]): c for c in row["comparisons"]}
    assert set(pairs) == {("accum_trainer", "trainer"), ("hf_accum_train", "accelerate_loop"),
                          ("accum_sequence", "accum_sequence_logits")}
    for c in pairs.values():
        assert len(c["time_ratios"]) == len(c["memory_ratios"]) == 1
        assert all(_positive_finite(r) for r in c["time_ratios"] + c["memory_ratios"])
        # The printed ratio is the measured one, ours / baseline, within its round.
        ours, base = row["runs"][c["ours"]][0], row["runs"][c["baseline"]][0]
        assert c["time_ratios"][0] == pytest.approx(ours["cpu"] / base["cpu"])
        assert f"time {c['time_ratios'][0]:.3f}x" in printed
        assert f"memory {c['memory_ratios'][0]:.3f}x" in printed
    assert "hf_accum.AccumTrainer / stock transformers.Trainer: time" in printed
    assert "stock Trainer + Liger (use_liger_kernel=True): skipped (Liger's kernels need CUDA" in printed
    assert vocab["skipped"] == {"trainer_liger": "Liger's kernels need CUDA; this run is on cpu"}
    assert "n/a (small)" in printed  # 8-token rows: the 512-1024-token targets are not judged
    assert {r["path"] for r in row["runs"]["accum_trainer"] + row["runs"]["hf_accum_train"]} <= {"fused", "logits"}
    assert {r["path"] for r in row["runs"]["trainer"] + row["runs"]["accelerate_loop"]} == {"-"}
    _assert_mfu_per_front_end(row["runs"], [VARIANTS[name].label for name in row["runs"]], printed)


def test_vocab_section_runs_the_sequence_front_ends_only_when_asked(tmp_path, monkeypatch, capsys):
    """Without --vocab-sequence-normalization the section runs the default front-ends only, each once per round,
    the order alternating between rounds (the runs themselves: a stand-in here; the real ones: vocab_run)."""
    from benchmarks import vocab

    ran: list[str] = []

    class RecordingWorkers:
        def __init__(self, threads):
            pass

        def run(self, spec):
            ran.append(spec.variant)
            return vocab.RunMeasure(wall=1.0, cpu=1.0, peak_bytes=1, updates=spec.updates, flops=1.0, mfu=0.5,
                                    peak="peak 100 GFLOP/s")

        def close(self):
            pass

    monkeypatch.setattr(vocab, "VocabWorkers", RecordingWorkers)
    assert main(["bench", "--only", "vocab", *VOCAB_TINY, "--vocab-pairs", "2", "--no-progress",
                 "--output-dir", str(tmp_path / "out")]) == 0
    assert ran == ["trainer", "accum_trainer", "accelerate_loop", "hf_accum_train",
                   "accum_trainer", "trainer", "hf_accum_train", "accelerate_loop"]
    assert "normalization='sequence'" not in capsys.readouterr().out


def _assert_mfu_per_front_end(runs: dict, labels: list[str], printed: str) -> None:
    """Every run's MFU = its model FLOPs per timed update / wall seconds per update / the peak (the same model
    FLOPs for every front-end: the same rows), and each front-end's line prints it, the peak said once."""
    flops = {run["flops"] for measured in runs.values() for run in measured}
    assert len(flops) == 1 and _positive_finite(flops.pop())
    for measured in runs.values():
        for run in measured:
            assert _fraction(run["mfu"]) and run["peak"] in MFU_MEANING, run
            assert run["mfu"] == pytest.approx(run["flops"] / run["wall"] / float(os.environ[PEAK_FLOPS_ENV]))
    for label, measured in zip(labels, runs.values()):
        (line,) = [line for line in printed.splitlines() if re.match(rf"\s*{re.escape(label)}\s+[\d.]+ s/update", line)]
        expected = 100 * statistics.median(run["mfu"] for run in measured)
        assert _printed_mfu(line) == pytest.approx(expected, abs=0.051), line
    assert printed.count(MFU_MEANING) == 1  # one vocabulary: one table


def test_vocab_loss_script_prints_mfu_beside_its_ratios(capsys):
    """benchmarks/vocab_loss.py (a script beside the vocab section): two runs in this process (what each of its
    worker processes does), then its pair line and summary."""
    from benchmarks import vocab_loss
    from hf_accum.testing import reset_accelerate_state

    tiny = ["--vocab", "64", "--updates", "1", "--min-length", "4", "--max-length", "8", "--hidden", "32"]
    runs = {}
    for variant in ("bare_loop", "hf_accum_loop"):
        reset_accelerate_state()
        vocab_loss.main([*tiny, "--run", variant])
        runs[variant] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["bare_loop"]["flops_per_update"] == runs["hf_accum_loop"]["flops_per_update"] > 0  # same rows
    for run in runs.values():
        assert _fraction(run["mfu"]) and run["peak"] in MFU_MEANING, run
        # one timed update: its FLOPs over its wall time (the median of one) over the peak
        assert run["mfu"] == pytest.approx(run["flops_per_update"] / run["wall_per_update"]
                                           / float(os.environ[PEAK_FLOPS_ENV]))
    # Inside pytest's process a tiny run's peak RSS increment can be 0 (its pages already resident); the ratio
    # lines divide by it, and memory is not what this test checks.
    for run in runs.values():
        run["peak_rss_increment_mib"] = 1.0
    row = {"vocab": 64, "pair": "loop", "repeat": 0, "stock": runs["bare_loop"], "ours": runs["hf_accum_loop"]}
    printed = re.search(r"\| MFU (\d+\.\d)% vs (\d+\.\d)%$", vocab_loss._pair_line(row))
    assert printed, vocab_loss._pair_line(row)
    assert [float(printed[1]), float(printed[2])] == [pytest.approx(100 * row[side]["mfu"], abs=0.051)
                                                      for side in ("ours", "stock")]
    summary = vocab_loss.summary([row])
    assert re.search(r"CPU [\d.]+ \([\d.]+\.\.[\d.]+\), MFU \d+\.\d% vs \d+\.\d%", summary) and MFU_MEANING in summary


@pytest.mark.slow
def test_vocab_section_compares_sequence_normalization_fused_with_its_logits_path(vocab_run):
    printed, vocab = vocab_run
    (row,) = vocab["rows"]
    assert {"accum_sequence", "accum_sequence_logits"} <= set(row["runs"])
    assert [r["path"] for r in row["runs"]["accum_sequence"]] == ["fused"]
    assert [r["path"] for r in row["runs"]["accum_sequence_logits"]] == ["-"]  # no fused-loss log line: logits
    (pair,) = [c for c in row["comparisons"] if (c["ours"], c["baseline"]) == ("accum_sequence", "accum_sequence_logits")]
    ours, base = row["runs"]["accum_sequence"][0], row["runs"]["accum_sequence_logits"][0]
    assert pair["memory_ratios"][0] == pytest.approx(ours["peak_bytes"] / base["peak_bytes"])
    assert f"memory {pair['memory_ratios'][0]:.3f}x" in printed


@pytest.mark.slow  # more than a few seconds (a subprocess, a real model or a whole bench run): CI only
def test_padding_section_writes_its_numbers(tmp_path, capsys):
    out = tmp_path / "only-padding"
    assert main([*TINY, "--only", "padding", "--padding-repeats", "2", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "bench.json").read_text())
    assert set(report["sections"]) == {"padding"}
    padding = report["sections"]["padding"]
    assert (padding["micro_batch"], padding["accumulation_steps"], padding["updates"]) == (2, 2, 1)
    assert padding["real_tokens"] > 0 and 0.0 <= padding["stock_padding_fraction"] < 1.0
    assert len(padding["packed_ratios"]) == len(padding["trainer_ratios"]) == 2
    for key in ("packed_ratio", "trainer_ratio", "packed_wall_ratio", "trainer_wall_ratio"):
        assert _positive_finite(padding[key]), key
    assert set(padding["tokens_per_s"]) == {"stock", "packed", "ours_padded"}
    assert all(_positive_finite(v) for v in padding["tokens_per_s"].values())
    targets = [row["target"] for row in report["summary"]]
    assert len(targets) == 2 and targets[0].startswith("padding:") and targets[1].startswith("trainer overhead:")
    assert {row["verdict"] for row in report["summary"]} <= {"PASS", "FAIL", "INCONCLUSIVE"}
    assert "AccumTrainer, packed" in printed and "stock Trainer, padded" in printed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--accumulation-steps", "1", "3"], "valid values: 1, 2, 4, 8, 16"),
        (["--overhead-accumulation", "5"], "valid values: 1, 2, 4, 8, 16"),
        (["--global-batch-size", "0"], "global_batch_size=0"),
        (["--padding-repeats", "0"], "padding_repeats=0"),
        (["--min-length", "50", "--max-length", "10"], "min_length <= max_length"),
        (["--model", "/nonexistent/model"], "neither 'tiny' nor a local model directory"),
        (["--only", "vocab", "--vocab-min-length", "9", "--vocab-max-length", "8"], "vocab_min_length <= vocab_max_length"),
        (["--only", "vocab", "--vocab-pairs", "0"], "vocab_pairs=0"),
        (["--only", "sft", "--sft-packing-length", "5000"], "sft_packing_length=5000"),
        (["--only", "sft", "--sft-packing-rows", "0"], "sft_packing_rows=0"),
        (["--only", "sft", "--sft-rows", "8", "--sft-packing-length", "3"], "packing would truncate it"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert main(["bench", *args, "--output-dir", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_unknown_section_is_an_argparse_error(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--only", "speed", "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists()


def test_measure_memory_sees_a_known_allocation():
    with measure_memory(torch.device("cpu")) as reading:
        block = torch.empty(10_000_000, dtype=torch.uint8)
        del block
        small = torch.empty(1000, dtype=torch.float32)
    assert reading.largest_allocation == 10_000_000
    assert reading.peak_bytes >= 10_000_000
    del small


@pytest.mark.slow
def test_measuring_memory_prints_no_profiler_trace_lines():
    """Kineto's "USDT: ... profiler_start" lines went to the terminal once per measured window."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # bitsandbytes kept out as the bench's helpers do (~1 CPU-s of start-up; it has nothing to do with kineto).
    code = ("from hf_accum.startup import keep_bitsandbytes_out; keep_bitsandbytes_out()\n"
            "import torch; from benchmarks.harness import measure_memory\n"
            "with measure_memory(torch.device('cpu')):\n    torch.ones(1000)")
    env = {key: value for key, value in os.environ.items() if key != "KINETO_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "USDT" not in proc.stdout + proc.stderr


def test_saved_activations_count_distinct_storages_and_skip_parameters():
    weight = torch.nn.Parameter(torch.randn(100, 100))
    x = torch.randn(50, 100, requires_grad=True)
    tracker = SavedActivations([weight])
    with tracker.hooks():
        y = (x @ weight).exp()  # saves x (the weight is excluded) and exp's output y
        z = y.sum()
    assert tracker.current == x.numel() * 4 + y.numel() * 4
    z.backward()
    del y, z
    assert tracker.current == 0 and tracker.peak == (50 * 100 + 50 * 100) * 4


def test_median_interval_brackets_the_median():
    low, high = median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0])
    assert low <= 6.0 <= high and (low, high) == (2.0, 10.0)


def test_judge_needs_the_whole_interval_on_one_side():
    assert judge((0.40, 0.48), 0.5, at_least=False) is True
    assert judge((0.52, 0.60), 0.5, at_least=False) is False
    assert judge((0.45, 0.55), 0.5, at_least=False) is None
    assert judge((0.99, 1.10), 0.98) is True and judge((0.90, 0.97), 0.98) is False


def test_bench_from_an_installed_copy_says_what_to_run(monkeypatch, capsys):
    """A wheel ships no benchmarks: the entry point names the command to run from a checkout."""
    monkeypatch.setattr(cli, "benchmarks_location", lambda: None)
    assert main(["bench", "--only", "loss"]) == 2
    err = capsys.readouterr().err
    assert "not part of the installed hf_accum package" in err and "python -m benchmarks --only loss" in err


def test_bench_help_lists_every_section_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    for flag in ("--global-batch-size", "--accumulation-steps", "--padding-repeats", "--loss-vocab", "--vocab-sizes",
                 "--sft-vocab-sizes", "--sft-variants", "--softcap-value", "--no-equal-length-sweep", "--only",
                 "--strict"):
        assert flag in printed


SFT_TINY = ["--sft-vocab-sizes", "64", "--sft-rows", "8", "--sft-prompt-words", "4", "--sft-completion-words", "3",
            "--sft-max-words", "8", "--sft-micro-batch", "2", "--sft-accumulation", "2", "--sft-rounds", "2",
            "--sft-layers", "1", "--sft-hidden-size", "32", "--sft-lora-r", "2", "--threads", "1"]
SFT_LABELS = ["stock Trainer, padded", "TRL SFTTrainer, padding_free=True", "TRL SFTTrainer, packing=True",
              "AccumTrainer, padded", "AccumSFTTrainer, padding_free=True", "AccumSFTTrainer, packing=True",
              "hf_accum.train + PackingCollator"]


@pytest.mark.slow
def test_sft_section_prints_every_front_end_and_ratio(tmp_path, capsys):
    out = tmp_path / "only-sft"
    assert main(["bench", "--only", "sft", *SFT_TINY, "--no-progress", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    sft = json.loads((out / "bench.json").read_text())["sections"]["sft"]

    (row,) = sft["rows"]
    assert row["vocab_size"] == 64 and len(row["runs"]) == 7
    tokens = {runs[0]["real_tokens"] for runs in row["runs"].values()}
    assert len(tokens) == 1 and tokens.pop() > 0  # every front-end trained on the same real tokens
    for name, runs in row["runs"].items():
        assert len(runs) == 2, name  # one run per round
        for run in runs:
            assert _positive_finite(run["seconds"]) and _positive_finite(run["peak_bytes"]), (name, run)
            assert _positive_finite(run["flops"]) and run["mfu"] == pytest.approx(
                run["flops"] / run["seconds"] / float(os.environ[PEAK_FLOPS_ENV]))  # tests/conftest.py sets it
            assert run["path"] in ({"fused", "logits"} if name in ("accum_trainer", "accum_sft_padding_free",
                                                                   "accum_sft_packing", "loop_packing") else {"-"})
    ratios = sft["ratios"]["64"]
    for name in row["runs"]:
        assert set(ratios[name]) == {"trainer", "trl_padding_free", "trl_packing"}
        for by_baseline in ratios[name].values():
            assert len(by_baseline["tokens_per_s"]) == len(by_baseline["memory"]) == 2
            assert all(_positive_finite(r) for r in by_baseline["tokens_per_s"] + by_baseline["memory"])

    # Two tables (tokens/s, memory), each with a row per front-end and a ratio column per baseline.
    for header in ("real tokens/s\\s+MFU", "peak memory"):
        assert re.search(rf"front-end\s+path\s+{header}\s+/ stock Trainer\s+/ TRL padding-free\s+/ TRL packing",
                         printed)
    for label in SFT_LABELS:
        lines = [line for line in printed.splitlines() if line.strip().startswith(label)]
        assert len(lines) == 2, label
        for line in lines:
            assert len(re.findall(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", line)) == 3, line  # median (min-max) x 3
    summary = [r for r in json.loads((out / "bench.json").read_text())["summary"] if r["target"].startswith("sft")]
    assert len(summary) == 4 and {r["verdict"] for r in summary} == {"n/a (small)"}
    assert "AccumSFTTrainer, packing=True / AccumTrainer, padded" in {r["target"].split(": ", 1)[1] for r in summary}


SOFTCAP_TINY = ["--softcap-vocab-sizes", "512", "--softcap-min-length", "4", "--softcap-max-length", "8",
                "--softcap-hidden-size", "32", "--softcap-pairs", "2", "--threads", "1"]


@pytest.mark.slow
def test_softcap_section_says_which_loss_path_and_prints_ratios(tmp_path, capsys):
    out = tmp_path / "only-softcap"
    assert main(["bench", "--only", "softcap", *SOFTCAP_TINY, "--no-progress", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "bench.json").read_text())
    softcap = report["sections"]["softcap"]

    assert softcap["softcap"] == 30.0
    (row,) = softcap["rows"]
    assert row["vocab_size"] == 512 and set(row["runs"]) == {"trainer", "accum_trainer"}
    paths = {run["path"] for run in row["runs"]["accum_trainer"]}
    assert len(paths) == 1 and paths <= {"fused", "logits"}  # read from hf_accum's own log line
    assert {run["path"] for run in row["runs"]["trainer"]} == {"-"}
    (path,) = paths
    c = row["comparison"]
    assert len(c["time_ratios"]) == len(c["memory_ratios"]) == 2
    assert all(_positive_finite(r) for r in c["time_ratios"] + c["memory_ratios"])
    assert f"AccumTrainer took the {path} loss path" in printed
    assert re.search(rf"AccumTrainer / stock Trainer \({path} path\): time \d\.\d{{3}}x \(\d\.\d{{3}}-\d\.\d{{3}} over 2\), "
                     r"memory \d\.\d{3}x", printed)
    (summary,) = report["summary"]
    assert summary["verdict"] == "n/a (small)" and f"({path} path)" in summary["measured"]
    _assert_mfu_per_front_end(row["runs"], [SOFTCAP_VARIANTS[name] for name in row["runs"]], printed)


def test_token_budget_section_writes_its_numbers(tmp_path, capsys):
    out = tmp_path / "only-token-budget"
    assert main([*TINY, "--only", "token_budget", "--token-budget-rows", "32", "--token-budget-repeats", "1",
                 "--max-length", "48", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    section = json.loads((out / "bench.json").read_text())["sections"]["token_budget"]
    assert section["budget"] > 0 and section["real_tokens"] > 0 and len(section["ratios"]) == 1
    for name in ("fixed_k", "token_budget"):
        spread = section["spread"][name]
        assert spread["minimum"] <= spread["median"] <= spread["maximum"] and spread["cv"] >= 0
        assert _positive_finite(section["tokens_per_s"][name])
    assert "token_budget" in printed and "targets/update min" in printed


def test_noise_scale_section_times_both_sides(tmp_path):
    out = tmp_path / "bench"
    assert main([*TINY, "--only", "noise_scale", "--noise-scale-accumulation", "2", "--noise-scale-repeats", "2",
                 "--output-dir", str(out)]) == 0
    section = json.loads((out / "bench.json").read_text())["sections"]["noise_scale"]
    assert len(section["ratios"]) == 2 and all(_positive_finite(r) for r in section["ratios"])
    assert len(section["first_ratios"]) == 2 and all(_positive_finite(r) for r in section["first_ratios"])
    assert _positive_finite(section["tracked_seconds_per_update"])
    assert _positive_finite(section["first_seconds_per_update"])


@pytest.mark.slow
def test_fsdp_fused_section_measures_both_paths_under_fsdp2(tmp_path):
    """2 CPU processes under FSDP2, fused loss vs logits path: both trained, both peaks read, ratios reported
    (the <= 0.5x target applies at vocab >= 128256 only, so a tiny run judges nothing)."""
    out = tmp_path / "bench"
    assert main(["bench", "--only", "fsdp_fused", "--fsdp-fused-vocab", "4096", "--fsdp-fused-hidden", "32",
                 "--fsdp-fused-length", "64", "--fsdp-fused-rounds", "1", "--no-progress",
                 "--output-dir", str(out)]) == 0
    section = json.loads((out / "bench.json").read_text())["sections"]["fsdp_fused"]
    assert section["world_size"] == 2 and len(section["fused"]) == len(section["logits"]) == 1
    for run in section["fused"] + section["logits"]:
        assert run["updates"] == 2 and _positive_finite(run["peak_bytes"]) and math.isfinite(run["loss"])
    # Same model, data and order: the two paths train to the same loss (float32 rounding apart).
    assert section["fused"][0]["loss"] == pytest.approx(section["logits"][0]["loss"], rel=1e-4)
    assert section["memory_ratio"] < 1.0  # vocab 4096 at 64 x 2 positions: the logits already dominate


def test_fsdp_fused_section_refuses_bad_values(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--only", "fsdp_fused", "--fsdp-fused-hidden", "30", "--no-progress",
                 "--output-dir", str(out)]) == 2
    assert "--fsdp-fused-hidden 30 must be a multiple of 4" in capsys.readouterr().err and not out.exists()
