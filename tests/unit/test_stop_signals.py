"""Ctrl-C and the stop signals, in-process (hf_accum.control): which repeat aborts, the one note, and no terminal
taken outside accelerate's one-process launcher. The real launchers, typed into a terminal:
tests/integration/test_interrupted_runs.py."""

from __future__ import annotations

import os
import signal

import pytest

from hf_accum import control
from hf_accum.control import CTRL_C_NOTE, LauncherTerminal, StopSignals, TrainingControl, is_second_interrupt


@pytest.mark.parametrize(
    "stopping_for, arriving, aborts",
    [(None, "SIGINT", False), (None, "SIGTERM", False),
     ("SIGINT", "SIGINT", True), ("SIGINT", "SIGTERM", True),  # torchrun's agent turns the 2nd Ctrl-C into SIGTERM
     ("SIGTERM", "SIGINT", True), ("SIGTERM", "SIGTERM", False), ("SIGUSR1", "SIGTERM", False),
     ("stop requested on another process", "SIGINT", True),
     ("stop requested on another process", "SIGTERM", False)],
)
def test_which_repeated_signal_aborts(stopping_for, arriving, aborts):
    assert is_second_interrupt(arriving, stopping_for) is aborts


def test_ctrl_c_says_once_what_happens_and_sigterm_after_it_aborts(capfd):
    run = TrainingControl()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with StopSignals(run):
            os.kill(os.getpid(), signal.SIGINT)
            assert run.stop_reason == "SIGINT"
            os.kill(os.getpid(), signal.SIGTERM)
    assert capfd.readouterr().err.count(CTRL_C_NOTE) == 1
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_repeated_preemption_notice_keeps_stopping(capfd):
    run = TrainingControl()
    with StopSignals(run):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert run.stop_reason == "SIGTERM"
    assert capfd.readouterr().err.count("SIGTERM: finishing the current update, then checkpoint and stop") == 1


@pytest.mark.parametrize("environ", [{}, {control.ACCELERATE_LAUNCHER_VARIABLE: "True", "TORCHELASTIC_RUN_ID": "x"}])
def test_the_terminal_is_left_alone_outside_accelerates_one_process_launcher(monkeypatch, environ):
    for name in (control.ACCELERATE_LAUNCHER_VARIABLE, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    group = os.getpgrp()
    terminal = LauncherTerminal()
    assert terminal.take() is False
    terminal.give_back()
    assert os.getpgrp() == group
