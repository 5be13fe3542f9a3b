"""The test suite's own layout (see tests/conftest.py and docs/testing.md): test files sorted by kind, worker scripts
beside the distributed tests (or in hf_accum/testing/cases when tests share them), and no file of the suite importing
another one -- what two files share lives in hf_accum.testing, hf_accum.recipe.testing or a conftest fixture."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
KINDS = ("unit", "integration", "distributed")
CASES = ROOT / "hf_accum" / "testing" / "cases"


def suite_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "data" not in p.relative_to(TESTS).parts[:1])


def imported_top_names(source: str) -> list[tuple[int, str]]:
    """``(line, first dotted component)`` of every absolute import in ``source``, at any depth (lazy ones too),
    ``importlib.import_module``/``__import__`` with a literal name included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):  # relative: the suite has no packages, so this reaches a sibling
            found.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


def cross_imports(files: dict[str, str]) -> list[str]:
    """``path:line: name`` for every import, in ``files`` (relative path -> source), of a module that is itself
    one of the suite's files (or of the suite as a package, ``tests``)."""
    own = {Path(path).stem for path in files} | {"tests"}
    return [
        f"{path}:{line}: {name}"
        for path, source in sorted(files.items())
        for line, name in imported_top_names(source)
        if name in own or name.startswith(".")
    ]


def test_no_file_of_the_suite_imports_another():
    files = {p.relative_to(ROOT).as_posix(): p.read_text() for p in suite_files()}
    assert len(files) > 60  # the walk sees the suite
    bad = cross_imports(files)
    assert not bad, (
        "test files import other test files (move what they share to hf_accum/testing, hf_accum/recipe/testing.py "
        "or a conftest fixture):\n" + "\n".join(bad))


@pytest.mark.parametrize(
    "source, line",
    [("from test_recipe import run_script\n", 1), ("import loop_ddp_worker\n", 1),
     ("def f():\n    from deepspeed_worker import LR\n", 2),
     ("import importlib\nimportlib.import_module('interruptions')\n", 2), ("from . import launch_probe\n", 1)],
    ids=["from_test_file", "import_worker", "lazy_import", "import_module", "relative"],
)
def test_the_walk_finds_every_kind_of_import_of_a_suite_file(source, line):
    files = {"tests/unit/test_a.py": source, "tests/integration/test_recipe.py": "",
             "tests/distributed/loop_ddp_worker.py": "", "tests/distributed/deepspeed_worker.py": "",
             "tests/integration/interruptions.py": ""}
    assert [entry for entry in cross_imports(files) if entry.startswith(f"tests/unit/test_a.py:{line}: ")]


def test_the_walk_passes_imports_of_the_library_and_its_testing_helpers():
    source = ("import pytest\nfrom hf_accum.testing.cases.loop_ddp_case import EXAMPLES\n"
              "from hf_accum.recipe.testing import run_script\nimport torch.distributed as dist\n")
    assert cross_imports({"tests/unit/test_a.py": source, "tests/unit/test_b.py": ""}) == []


def test_every_test_file_is_in_a_kind_folder():
    misplaced = [p.relative_to(ROOT).as_posix() for p in TESTS.rglob("test_*.py")
                 if p.parent.parent != TESTS or p.parent.name not in KINDS]
    assert not misplaced, f"put each test file in tests/{{{','.join(KINDS)}}}/ (see tests/conftest.py): {misplaced}"


def test_worker_scripts_sit_beside_the_distributed_tests_or_in_the_shared_cases():
    workers = sorted(p.relative_to(ROOT).as_posix() for p in [*TESTS.rglob("*worker*.py"), *CASES.glob("*worker*.py")])
    assert len(workers) >= 8  # the walk sees them (one worker per family since the job tables)
    misplaced = [w for w in workers if not (w.startswith("tests/distributed/") or w.startswith("hf_accum/testing/cases/"))]
    assert not misplaced, misplaced


# -- tests/unit starts no process ------------------------------------------------------------------------------

UNIT = TESTS / "unit"
# What starts a process when called (subprocess's runners, os's forks and spawns), and what names a fresh interpreter.
PROCESS_STARTERS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen", "execv", "execve", "execvp",
           "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
           "spawnle", "spawnlp", "spawnlpe"},
    "sys": {"executable"},
    "pty": {"fork", "spawn"},
}
PROCESS_MODULES = {"multiprocessing", "torch.multiprocessing", "concurrent.futures.process"}
# The suite's helpers that start a process (the recipe's runner, the torchrun launcher, the pseudo-terminal).
PROCESS_HELPERS = {
    "hf_accum.recipe.testing": {"run_script", "start_script"},
    "hf_accum.testing.launch": {"run_torchrun", "run_torchrun_nodes", "torchrun"},
    "hf_accum.testing.interruptions": {"Terminal"},
}


def process_starts(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every place ``source`` starts a process itself: ``subprocess.run(...)``, ``os.fork``,
    ``sys.executable``, a name imported from them (``from subprocess import Popen``), an import of multiprocessing,
    or an import of one of the suite's process-starting helpers (:data:`PROCESS_HELPERS`) by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.attr in PROCESS_STARTERS.get(node.value.id, ()):
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in PROCESS_MODULES or node.module.split(".")[0] == "multiprocessing":
                found.append((node.lineno, f"from {node.module} import"))
            found += [(node.lineno, f"from {node.module} import {alias.name}") for alias in node.names
                      if alias.name in PROCESS_STARTERS.get(node.module, set()) | PROCESS_HELPERS.get(node.module, set())]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {alias.name}") for alias in node.names
                      if alias.name in PROCESS_MODULES or alias.name.split(".")[0] == "multiprocessing"]
    return sorted(found)


def test_no_unit_test_file_starts_a_process():
    files = sorted(UNIT.glob("*.py"))
    assert len(files) > 40  # the walk sees tests/unit
    bad = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in files if path.name != "test_suite_layout.py"
           for line, what in process_starts(path.read_text())]
    assert not bad, ("tests/unit starts no process (docs/testing.md): call the function instead of the command "
                     "(hf_accum.recipe.testing.run_main for the recipe), or move the test to tests/integration:\n"
                     + "\n".join(bad))


@pytest.mark.parametrize("source", [
    "import subprocess\nsubprocess.run(['ls'])\n", "import subprocess\np = subprocess.Popen(['ls'])\n",
    "from subprocess import check_output\n", "import os\nos.fork()\n", "import sys\ncmd = [sys.executable, '-c', '']\n",
    "import multiprocessing\n", "from torch.multiprocessing import spawn\n", "import pty\npty.fork()\n",
    "def f():\n    import os\n    os.system('true')\n", "from hf_accum.recipe.testing import run_main, run_script\n",
    "from hf_accum.testing.launch import run_torchrun\n", "from hf_accum.testing.interruptions import Terminal\n",
], ids=["run", "popen", "from_import", "fork", "executable", "multiprocessing", "torch_mp", "pty", "lazy",
        "recipe_runner", "torchrun", "terminal"])
def test_the_process_walk_finds_a_planted_start(source):
    assert process_starts(source)


def test_the_process_walk_passes_what_starts_nothing():
    source = ("import os, sys, subprocess\nos.path.join('a')\nsys.argv\nsubprocess.CompletedProcess([], 0)\n"
              "from hf_accum.recipe.testing import run_main\n")
    assert process_starts(source) == []
