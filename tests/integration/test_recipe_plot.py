"""The recipe's loss/LR plot: drawn with matplotlib (the ``recipe`` extra), and the run goes on without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hf_accum.recipe import outputs as run_outputs

UPDATES = [{"step": step, "loss": 2.0 / step, "learning_rate": 1e-3, "targets": 40} for step in range(1, 6)]


def test_the_plot_is_a_png(tmp_path):
    path = tmp_path / run_outputs.PLOT_NAME
    assert run_outputs.plot_curves(UPDATES, str(path), title="t") is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_without_matplotlib_the_library_imports_and_the_plot_is_skipped(tmp_path):
    """A fresh interpreter where ``import matplotlib`` fails: ``hf_accum`` (train, AccumTrainer) and the kit's
    outputs import, and plot_curves draws nothing and says so (False)."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["matplotlib"] = None  # import matplotlib -> ImportError
        import hf_accum
        from hf_accum import AccumTrainer, train
        from hf_accum.recipe import outputs
        print(outputs.plot_curves({UPDATES!r}, {str(tmp_path / "curves.png")!r}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"
    assert not (tmp_path / "curves.png").exists()
