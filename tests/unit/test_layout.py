"""The library and the recipe kit stay apart, and the kit's default config ships with the package.

The rule the import walk holds: no module of the library -- every module under ``hf_accum/``
outside ``hf_accum/recipe/`` -- imports ``hf_accum.recipe``, neither at the top nor lazily inside
a function (``import``, ``from ... import``, relative imports, ``importlib.import_module`` /
``__import__`` with a literal name). The one exception is a *front door*: ``hf_accum/cli.py``, the
command line, may import the kit lazily, inside the function of the command that reads a recipe
config (``hf-accum plan --config``); a top-level import there would load the kit for every command.
The recipe kit itself may import anything in the library.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hf_accum"
KIT = "hf_accum.recipe"
# Front doors: modules that may import the kit, lazily only (inside a function).
FRONT_DOORS = {"hf_accum/cli.py"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str, module: str, is_package: bool) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at top level)`` for every import in ``source``, relative ones resolved."""
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            names = [node.args[0].value]
        found += [(name, node.lineno, id(node) in top_level) for name in names]
    return found


def _is_dynamic_import(node: ast.Call) -> bool:
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    first = node.args[0] if node.args else None
    literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
    return called in ("import_module", "__import__") and literal


def kit_imports(relative: str, source: str) -> list[str]:
    """The forbidden imports in the source of one library module (``relative`` to the repository), as
    ``path:line: name``."""
    path = ROOT / relative
    found = imported_names(source, module_name(path), path.name == "__init__.py")
    return [
        f"{relative}:{line}: {name}"
        for name, line, top_level in found
        if (name == KIT or name.startswith(KIT + ".")) and not (relative in FRONT_DOORS and not top_level)
    ]


def library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not p.relative_to(PACKAGE).as_posix().startswith("recipe/"))


def test_no_library_module_imports_the_recipe_kit():
    modules = library_modules()
    assert len(modules) > 10 and PACKAGE / "cli.py" in modules  # the walk sees the library
    bad = [line for path in modules for line in kit_imports(path.relative_to(ROOT).as_posix(), path.read_text())]
    assert not bad, "library modules import the recipe kit:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        "from hf_accum.recipe.config import load_config\n",
        "import hf_accum.recipe.data\n",
        "def f():\n    from hf_accum.recipe import modeling\n",
        "def f():\n    from .recipe import launch\n",
        "import importlib\nimportlib.import_module('hf_accum.recipe.outputs')\n",
    ],
)
def test_the_walk_finds_every_kind_of_import_of_the_kit(source):
    found = kit_imports("hf_accum/loop_probe.py", source)
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "recipe" in text)
    assert found and all(entry.startswith(f"hf_accum/loop_probe.py:{line}: hf_accum.recipe") for entry in found)


def test_the_walk_passes_library_imports():
    library_only = "from hf_accum.loss import token_loss_sum\nfrom . import schedule\n"
    assert kit_imports("hf_accum/loop_probe.py", library_only) == []


def test_a_front_door_may_import_the_kit_only_inside_a_function():
    lazy = "def plan():\n    from hf_accum.recipe import config\n"
    assert kit_imports("hf_accum/cli.py", lazy) == []
    assert kit_imports("hf_accum/verify.py", lazy) == ["hf_accum/verify.py:2: hf_accum.recipe",
                                                       "hf_accum/verify.py:2: hf_accum.recipe.config"]
    eager = "from hf_accum.recipe import config\n"
    assert kit_imports("hf_accum/cli.py", eager) == ["hf_accum/cli.py:1: hf_accum.recipe",
                                                     "hf_accum/cli.py:1: hf_accum.recipe.config"]


# -- the CPU default config: one file, shipped with the package -----------------------------------


def test_the_packaged_default_config_is_the_recipes_yaml():
    from hf_accum.recipe.embedded import default_config_path

    packaged = Path(default_config_path())
    assert packaged.is_file()
    assert os.path.samefile(packaged, ROOT / "recipes" / "configs" / "cpu_default.yaml")


@pytest.mark.slow
def test_a_built_wheel_carries_the_default_config(tmp_path):
    """A non-editable install gets a copy of recipes/configs/cpu_default.yaml inside hf_accum/recipe/
    (built from a copy of the sources: setuptools writes build/ beside them)."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "hf_accum", source / "hf_accum", symlinks=True, ignore=ignore)
    shutil.copytree(ROOT / "recipes" / "configs", source / "recipes" / "configs")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(source)],
        check=True, capture_output=True, timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("hf_accum-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("hf_accum/recipe/cpu_default.yaml")
    assert shipped == (ROOT / "recipes" / "configs" / "cpu_default.yaml").read_bytes()
