"""Settings for the whole suite, and what makes it safe to run in 2 pytest-xdist workers (``.ci/run``).

Layout (each folder's kind is what a test starts, see docs/testing.md):

* ``unit/`` -- everything runs in the pytest process (functions, modules, tiny in-process training runs);
* ``integration/`` -- the product started as a user starts it in one process: the recipe script, the CLI,
  the benchmarks, the docs' examples, runs killed and started again;
* ``distributed/`` -- jobs of 2 processes (torchrun, gloo; 2 "nodes"; DeepSpeed, FSDP) and the worker
  scripts they launch, which sit beside their tests.

Helpers two test files share live in :mod:`hf_accum.testing` (:mod:`hf_accum.testing.cases` for the cases a
worker and its test share) or :mod:`hf_accum.recipe.testing` (the recipe script's runners); a test file
never imports another one (``tests/unit/test_test_layout.py``).

Under ``pytest -n 2 --dist loadgroup`` (pytest-xdist):

* every slow test of ``distributed/`` (a 2-process job, or a test reading its report), and every test elsewhere
  marked ``multiprocess`` (a 2-process launch of the recipe script), is in one xdist group, ``multiprocess``: one
  worker runs them one after the other, so no more than one 2-process job competes with the other worker's single-process test for the 2
  cores; every other test is grouped with its module, so a module-scoped fixture (a model, a run) is built
  once, on one worker;
* each worker has its own temporary directory (``TMPDIR``, inherited by its subprocesses), so a test that
  checks it left no ``hf_accum*`` directory behind does not see the other worker's, and torch uses one
  thread per worker.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TESTS = os.path.dirname(os.path.abspath(__file__))
# Where the tests that start more than one process live; under xdist they run on one worker, one at a time.
MULTIPROCESS_DIR = os.path.join(TESTS, "distributed")
MULTIPROCESS_GROUP = "multiprocess"
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


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if any(item.iter_markers("xdist_group")):
            continue
        path = str(item.path)
        in_multiprocess_dir = os.path.commonpath([path, MULTIPROCESS_DIR]) == MULTIPROCESS_DIR
        # In distributed/, the slow tests are the ones that launch (or read the report of) a 2-process job; the
        # others run in-process and may go to either worker.
        slow = any(item.iter_markers("slow"))
        multiprocess = (in_multiprocess_dir and slow) or any(item.iter_markers("multiprocess"))
        group = MULTIPROCESS_GROUP if multiprocess else os.path.relpath(path, TESTS)
        item.add_marker(pytest.mark.xdist_group(group))
