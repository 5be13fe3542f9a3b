"""``hf-accum plan --auto``: the chosen micro-batch fits the budget as measured, the next larger one does not."""

import re
import subprocess
import sys

import pytest
import torch

from hf_accum.measure.memory import (
    MemoryBudgetError,
    fit_line,
    parse_bytes,
    plan_micro_batch,
    training_step_peak,
)
from hf_accum.testing.models import tiny_causal_lm


def run_plan(*args):
    return subprocess.run([sys.executable, "-m", "hf_accum.cli", "plan", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_a_budget_between_two_measured_sizes_picks_the_smaller():
    model, cpu = tiny_causal_lm(seed=0, dtype=torch.float32), torch.device("cpu")
    peaks = {m: training_step_peak(model, cpu, m, 64) for m in (2, 4, 8)}
    assert peaks[2] < peaks[4] < peaks[8]  # a measurement that grows with the micro-batch
    budget = (peaks[4] + peaks[8]) // 2
    calls = []

    def measure(m):
        calls.append(m)
        return training_step_peak(model, cpu, m, 64)

    plan = plan_micro_batch(measure, per_process_batch=16, budget_bytes=budget)
    assert plan.micro_batch == 4 and plan.accumulation_steps == 4
    assert plan.measured[4] <= budget < plan.measured[8]  # the next larger divisor was measured, and is over
    assert "<- chosen" in plan.table().splitlines()[3]


def test_a_wrong_prediction_is_corrected_by_the_confirming_runs():
    true_peaks = {1: 10, 2: 20, 4: 40, 8: 200, 16: 400}  # not a line: the fit predicts 8 fits
    plan = plan_micro_batch(true_peaks.__getitem__, per_process_batch=16, budget_bytes=100, probes=(1, 2, 4))
    assert plan.micro_batch == 4 and plan.measured[8] == 200
    with pytest.raises(MemoryBudgetError, match="micro-batch 1 needs"):
        plan_micro_batch(true_peaks.__getitem__, per_process_batch=16, budget_bytes=5)


def test_budget_strings():
    assert parse_bytes("70GiB") == 70 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("512") == 512
    for bad in ("70XB", "lots", "-1GiB", "0"):
        with pytest.raises(MemoryBudgetError):
            parse_bytes(bad)
    assert fit_line({1: 10, 3: 30}) == pytest.approx((0.0, 10.0))


@pytest.mark.parametrize("args,fragment", [
    (["--memory-budget", "70XB"], "--memory-budget='70XB'"),
    (["--memory-budget", "1KiB", "--max-length", "16"], "no micro-batch fits"),
    (["--global-batch-size", "7", "--num-processes", "2"], "not a positive multiple of 2 processes"),
])
@pytest.mark.slow
def test_bad_input_exits_2_with_one_line(args, fragment):
    done = run_plan("--auto", *args)
    assert done.returncode == 2 and fragment in done.stderr, done.stderr


@pytest.mark.slow
def test_auto_only_options_without_auto_are_refused():
    done = run_plan("--global-batch-size", "8", "--micro-batch-size", "2", "--memory-budget", "1GiB")
    assert done.returncode == 2 and "go with --auto" in done.stderr


def _run_plan_watched(*args):
    """Run the command and sample the resident memory of its whole process tree every 2 ms. The tree's members are
    re-read every 50 ms (walking /proc for children costs ~50x a member's reading): a process younger than that is a
    Python start-up of a few MiB, far from any budget here."""
    import time

    import psutil

    process = subprocess.Popen([sys.executable, "-m", "hf_accum.cli", "plan", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    root, peak = psutil.Process(process.pid), 0
    members, members_read_at = [root], 0.0
    while process.poll() is None:
        if time.monotonic() - members_read_at > 0.05:
            try:
                members, members_read_at = [root, *root.children(recursive=True)], time.monotonic()
            except psutil.NoSuchProcess:
                pass
        peak = max(peak, sum(_resident_bytes(member) for member in members))
        time.sleep(0.002)
    out, err = process.communicate()
    return process.returncode, out, err, peak


def _resident_bytes(process) -> int:
    import psutil

    try:
        return process.memory_info().rss
    except psutil.NoSuchProcess:  # ended since the tree was read
        return 0


def _planner_peak(out: str) -> float:
    import re

    value, unit = re.search(r"planner peak ([0-9.]+) (MiB|GiB)", out).groups()
    return float(value) * (2**20 if unit == "MiB" else 2**30)


PLANNER_ARGS = ("--auto", "--max-length", "32", "--global-batch-size", "2")  # 2 micro-batches to probe: 1, 2
ROOMY_BUDGET = 1.2 * 2**30


@pytest.fixture(scope="module")
def roomy_run():
    """One watched run of the command under a roomy budget (everything fits), read by the two tests below (each
    run measures two micro-batches in probe processes, 1 and 2: ~14 CPU-s)."""
    return _run_plan_watched(*PLANNER_ARGS, "--memory-budget", str(int(ROOMY_BUDGET)))


@pytest.mark.slow
def test_the_command_prints_the_table_and_the_chosen_plan(roomy_run):
    code, out, err, _ = roomy_run
    assert code == 0, err
    assert "<- chosen" in out and "effective batch 2 = 2 per device x 1 accumulation" in out
    assert "use: training.per_device_train_batch_size=2 global_batch_size=2" in out


@pytest.mark.slow
def test_the_planner_itself_stays_under_its_budget(roomy_run):
    args, budget = PLANNER_ARGS, ROOMY_BUDGET
    # A roomy budget: everything fits; the planner (which never imports torch) and its probe stay under it.
    code, out, err, peak = roomy_run
    assert code == 0, err
    assert peak < budget and "planner peak" in out
    needed = _planner_peak(out)  # what this process and a probe at micro-batch 1 together reach
    # A budget just under that (the probe is stopped at 95% of it): the tree stays under the budget, the output says
    # which probe was stopped and that the larger ones were not run, exit 2.
    budget = needed / 0.95 * 0.98
    code, out, err, peak = _run_plan_watched(*args, "--memory-budget", str(int(budget)))
    assert code == 2 and "no micro-batch fits the budget" in err, out + err
    assert peak < budget, (peak, budget)
    assert "probe at micro-batch 1 stopped" in out and "larger micro-batches not probed" in err
    assert "micro-batch 1: needs more than " in out and "planner peak: " in out and "4294967296" not in err
    assert "use LoRA" not in err and "LoRA adapters" not in err  # the embedded default trains LoRA already


def test_a_stopped_probe_never_fits_and_larger_ones_are_skipped():
    from hf_accum.measure.memory import OverBudget

    measured = []

    def measure(m):
        measured.append(m)
        return {1: 40, 2: OverBudget(60)}[m]  # micro-batch 2 stopped at 60 bytes, under the budget's number

    plan = plan_micro_batch(measure, per_process_batch=8, budget_bytes=100)
    assert plan.micro_batch == 1 and measured == [1, 2]  # 4 and 8 never run
    table = plan.table()
    assert "> 60.0" in table or "(stopped)" in table
    assert table.count("not probed") == 2


def test_the_advice_when_nothing_fits_reads_the_config():
    """No "use LoRA" when LoRA is on, no "quantize" when it already is, no "checkpointing" when it is on."""
    from hf_accum.recipe.plan_auto import advice

    lora = advice({"max_length": 160, "lora": True, "quantized": False, "checkpointing": False})
    assert "LoRA adapters" not in lora and "use LoRA" not in lora and "quantize the frozen base" in lora and "activation_checkpointing" in lora
    assert "160 tokens now" in lora
    qlora = advice({"max_length": 64, "lora": True, "quantized": True, "checkpointing": True})
    assert qlora == "shorten the rows (--max-length, 64 tokens now)"
    full = advice({"max_length": 64, "lora": False, "quantized": False, "checkpointing": True})
    assert "LoRA adapters" in full and "quantize" not in full and "activation" not in full


def test_each_memory_measure_is_a_line_of_its_own_naming_what_it_measures(monkeypatch):
    """A stopped probe's lower bound (this process + probe), a probe that ran out of its cap, a measured peak, and
    the planner's own peak are different measures: one a line, each named, never two figures side by side."""
    from hf_accum.recipe.plan_auto import ProbeWatch

    watch = ProbeWatch(budget=3 * 2**30, announce=lambda line: None)
    answers = iter([(0, '{"tensor_peak": 1000, "rss_peak": 734003200}', "", None),  # 700 MiB
                    (-9, "", "", int(2.83 * 2**30))])  # stopped over the budget
    monkeypatch.setattr(watch, "_run", lambda spec: next(answers))
    watch.peak = int(2.56 * 2**30)
    assert watch.measure({"micro_batch": 1, "device": "cpu"}) == 734003200
    watch.measure({"micro_batch": 2, "device": "cpu"})
    lines = watch.measures(3 * 2**30)
    assert lines[0] == "micro-batch 1: measured peak 700.0 MiB (the probe's training step)"
    assert lines[1].startswith("micro-batch 2: needs more than 2.83 GiB (this process and the probe")
    assert lines[2].startswith("planner peak: 2.56 GiB (") and lines[3] == "budget: 3.00 GiB per process"
    for line in lines:
        assert len(re.findall(r"[0-9.]+ (GiB|MiB)", line)) == 1, line
