"""The recipe test runner (:func:`hf_accum.recipe.testing.run_script`) runs a 2-process launch again only for the
named upstream failure -- the gloo abort at interpreter exit after the run wrote its metrics -- and says so; any
other failure fails at once (a retry would hide an intermittent fault of the product: a lock or barrier race).
The torchrun helper's policy is tested in tests/distributed/test_distributed.py."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hf_accum.recipe import outputs as run_outputs
from hf_accum.recipe import testing as recipe_testing
from hf_accum.testing.launch import EXIT_ABORT_SIGNATURE


class FakeLaunches:
    """Stands in for ``subprocess.run``: each call plays the next outcome, ``(exit code, stderr, writes metrics)``."""

    def __init__(self, out, outcomes: list[tuple[int, str, bool]]):
        self.out, self.outcomes, self.calls = out, list(outcomes), 0

    def __call__(self, cmd, **kwargs) -> subprocess.CompletedProcess:
        code, stderr, writes = self.outcomes[self.calls]
        self.calls += 1
        if writes:
            os.makedirs(self.out, exist_ok=True)
            with open(os.path.join(self.out, run_outputs.METRICS_NAME), "w") as handle:
                json.dump({"call": self.calls}, handle)
        return subprocess.CompletedProcess(cmd, code, stdout="", stderr=stderr)


def run_with(monkeypatch, out, launcher, outcomes) -> tuple[FakeLaunches, object]:
    fake = FakeLaunches(out, outcomes)
    monkeypatch.setattr(recipe_testing.subprocess, "run", fake)
    return fake, lambda: recipe_testing.run_script(launcher, out)


ABORT = f"[rank1]: ...\n{EXIT_ABORT_SIGNATURE}\n"


def test_an_abort_at_exit_after_the_metrics_is_run_once_more_with_a_warning(tmp_path, monkeypatch):
    out = tmp_path / "run"
    fake, run = run_with(monkeypatch, out, recipe_testing.TORCHRUN_2, [(1, ABORT, True), (0, "", True)])
    with pytest.warns(UserWarning, match="retried after a rank aborted at exit"):
        assert run().returncode == 0
    assert fake.calls == 2
    assert json.loads((out / run_outputs.METRICS_NAME).read_text()) == {"call": 2}


@pytest.mark.parametrize(
    "first",
    [(1, ABORT, False),  # the abort message, but no metrics: a rank raised and left its group up
     (1, "Traceback ...\nRuntimeError: barrier timed out\n", True),  # metrics, but another failure
     (-9, "", False)],  # killed
    ids=["abort_without_metrics", "other_failure_after_metrics", "killed"],
)
def test_any_other_failure_of_a_two_process_launch_fails_at_once(tmp_path, monkeypatch, first):
    fake, run = run_with(monkeypatch, tmp_path / "run", recipe_testing.TORCHRUN_2, [first, (0, "", True)])
    with pytest.raises(AssertionError):
        run()
    assert fake.calls == 1


def test_metrics_left_by_an_earlier_run_do_not_count_as_written(tmp_path, monkeypatch):
    """A resumed run starts in a directory that already holds metrics.json: the abort only counts after this
    run wrote its own."""
    out = tmp_path / "run"
    out.mkdir()
    (out / run_outputs.METRICS_NAME).write_text("{}")
    fake, run = run_with(monkeypatch, out, recipe_testing.TORCHRUN_2, [(1, ABORT, False), (0, "", True)])
    with pytest.raises(AssertionError):
        run()
    assert fake.calls == 1


def test_a_one_process_launch_is_never_run_again(tmp_path, monkeypatch):
    fake, run = run_with(monkeypatch, tmp_path / "run", recipe_testing.PYTHON, [(1, ABORT, True), (0, "", True)])
    with pytest.raises(AssertionError):
        run()
    assert fake.calls == 1
