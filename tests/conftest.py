"""Settings for the whole suite, and what makes it safe to run in 2 pytest-xdist workers (``.ci/run``).

Layout (each folder's kind is what a test starts, see docs/testing.md):

* ``unit/`` -- everything runs in the pytest process (functions, modules, tiny in-process training runs);
* ``integration/`` -- the product started as a user starts it in one process: the recipe script, the CLI,
  the benchmarks, the docs' examples, runs killed and started again;
* ``distributed/`` -- jobs of 2 processes (torchrun, gloo; 2 "nodes"; DeepSpeed, FSDP) and the worker
  scripts they launch, which sit beside their tests.

Helpers two test files share live in :mod:`hf_accum.testing` (:mod:`hf_accum.testing.cases` for the cases a
worker and its test share) or :mod:`hf_accum.recipe.testing` (the recipe script's runners); a test file
never imports another one (``tests/unit/test_suite_layout.py``).

Under ``pytest -n 2 --dist loadfile`` (pytest-xdist, as ``.ci/run`` runs it):

* every test of ``distributed/`` is in one unit of work: one worker runs them one after the other, so no more
  than one 2-process job competes with the other worker's single-process test for the 2 cores (a 2-process
  run of the recipe in integration/test_recipe.py or test_runs.py may still overlap one); every other
  file is a unit of its own, so a module-scoped fixture (a model, a run) is built once, on one worker
  (:func:`pytest_xdist_make_scheduler`);
* each worker has its own temporary directory (``TMPDIR``, inherited by its subprocesses), so a test that
  checks it left no ``hf_accum*`` directory behind does not see the other worker's, and torch uses one
  thread per worker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# MFU's denominator without the start-up GEMM probe (hf_accum.measure.peak_flops): no test run pays for it.
os.environ.setdefault("HF_ACCUM_PEAK_FLOPS", "1e11")

# Where the tests that start more than one process live (test ids relative to the repository root); under xdist
# they run on one worker, one at a time.
MULTIPROCESS_PREFIX = "tests/distributed/"
MULTIPROCESS_GROUP = "tests/distributed (2-process jobs, one at a time)"
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... inside an xdist worker, else None

if XDIST_WORKER:
    # Before any test imports torch or makes a temporary file: a private temp dir, one thread.
    _PRIVATE_TMP = tempfile.mkdtemp(prefix=f"pytest-xdist-{XDIST_WORKER}-")
    os.environ["TMPDIR"] = _PRIVATE_TMP
    tempfile.tempdir = _PRIVATE_TMP
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    if XDIST_WORKER:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_unconfigure(config: pytest.Config) -> None:
    if XDIST_WORKER:
        shutil.rmtree(_PRIVATE_TMP, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist installed, pytest never calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile``, with every file of tests/distributed/ in ONE unit of work: those tests run on one
    worker, one after the other, so two 2-process jobs never compete for the 2 cores; every other file is its
    own unit, so its module-scoped fixtures (a model, a run) are built once. (Not ``--dist loadgroup`` with
    ``xdist_group`` marks: pytest-xdist 3.8 puts the group into ``item._nodeid``, which pytest 9 no longer reads.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    # HF_ACCUM_TEST_DISTRIBUTED_UNITS=N splits tests/distributed/ into N units (by file), 0 gives each file its own
    # unit (plain loadfile): more parallel 2-process jobs, more contention. The default 1 is the one-at-a-time rule.
    units = int(os.environ.get("HF_ACCUM_TEST_DISTRIBUTED_UNITS", "1"))
    # Units go out in collection order -- tests/distributed/, then integration/ (files of few, long tests: whole
    # processes), then unit/ (many short tests) -- not xdist's default of most tests first, which handed out the
    # long integration files last: a worker finishing its last short unit then idled while the other ran one.
    config.option.loadscopereorder = False

    class DistributedAsOneUnit(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if not path.startswith(MULTIPROCESS_PREFIX) or units == 0:
                return path
            return MULTIPROCESS_GROUP if units == 1 else f"{MULTIPROCESS_GROUP} {zlib.crc32(path.encode()) % units}"

    return DistributedAsOneUnit(config, log)
