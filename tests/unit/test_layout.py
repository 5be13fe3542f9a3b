"""The library and the recipe kit stay apart, and the kit's default config ships with the package.

The rule the import walk holds: no module of the library -- every module under ``hf_accum/``
outside ``hf_accum/recipe/`` -- imports ``hf_accum.recipe``, neither at the top nor lazily inside
a function (``import``, ``from ... import``, relative imports, ``importlib.import_module`` /
``__import__`` with a literal name). The one exception is a *front door*: ``hf_accum/cli.py``, the
command line, may import the kit lazily, inside the function of the command that reads a recipe
config (``hf-accum plan --config``); a top-level import there would load the kit for every command.
The recipe kit itself may import anything in the library.

The import graph of the whole package (library and kit) has no cycle: an edge is any import a module
makes, at the top, lazily inside a function, or under ``if TYPE_CHECKING:`` (it never runs, but a circle that
only type checkers see is still two modules that each need the other: the lower one owns the shared type, or a
``Protocol`` names what is used), plus a ``"package.module:name"`` string (a callable named for ``importlib``). The Trainer side
(``hf_accum/trainer/``) never imports the loop package, and no module is longer than 500 lines.
"""

from __future__ import annotations

import ast
import os
import re
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
    library_only = "from hf_accum.losses.token_loss import token_loss_sum\nfrom . import schedule\n"
    assert kit_imports("hf_accum/loop_probe.py", library_only) == []


def test_a_front_door_may_import_the_kit_only_inside_a_function():
    lazy = "def plan():\n    from hf_accum.recipe import config\n"
    assert kit_imports("hf_accum/cli.py", lazy) == []
    assert kit_imports("hf_accum/verify.py", lazy) == ["hf_accum/verify.py:2: hf_accum.recipe",
                                                       "hf_accum/verify.py:2: hf_accum.recipe.config"]
    eager = "from hf_accum.recipe import config\n"
    assert kit_imports("hf_accum/cli.py", eager) == ["hf_accum/cli.py:1: hf_accum.recipe",
                                                     "hf_accum/cli.py:1: hf_accum.recipe.config"]


# -- the import graph: no cycle, lazy imports included ------------------------------------------------

MAX_MODULE_LINES = 500
# "hf_accum.recipe.data:check_data_section": a callable named by a string, resolved with importlib.
_NAMED_CALLABLE = re.compile(r"(hf_accum(?:\.\w+)+):\w+")


def package_modules() -> dict[str, Path]:
    """Every module of ``hf_accum/`` (the kit included) by its dotted name."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def module_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` imports: top-level, function-level and ``TYPE_CHECKING``
    ``import`` / ``from ... import`` (relative ones resolved; ``from pkg import sub`` is an edge to ``pkg.sub``,
    ``from pkg import name`` one to ``pkg``), literal ``import_module``/``__import__`` calls and
    ``"module:callable"`` strings."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {_nearest_module(alias.name, known) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            found.add(_nearest_module(node.args[0].value, known))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = _NAMED_CALLABLE.fullmatch(node.value)
            if named:
                found.add(named.group(1))
    return {name for name in found if name in known and name != module}


def _nearest_module(name: str, known: set[str]) -> str:
    """``import a.b.c`` of a name that is not a module file: the closest enclosing module."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: module_imports(path.read_text(), name, path.name == "__init__.py", known)
            for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path ``a -> b -> ... -> a``) per strongly connected component of more than one module
    (Tarjan's algorithm, iterative), and every module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_through(component, graph) for component in components]


def _cycle_through(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first module back to itself (breadth first inside it)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {sorted(component)}")


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40 and "hf_accum.checkpointing.checkpoint" in graph["hf_accum.checkpointing.loop_checkpoint"]  # the walk sees edges
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (lazy and TYPE_CHECKING imports included), one per tangle of modules:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize(
    "importer",
    [
        "from hf_accum.b import thing\n",
        "def f():\n    from hf_accum import b\n",
        "def f():\n    from . import b\n",
        "import importlib\nimportlib.import_module('hf_accum.b')\n",
        "CHECK = 'hf_accum.b:check'\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hf_accum.b import B\n",
    ],
)
def test_the_cycle_walk_finds_a_cycle_through_every_kind_of_import(importer):
    known = {"hf_accum", "hf_accum.a", "hf_accum.b"}
    graph = {"hf_accum": set(), "hf_accum.b": {"hf_accum.a"},
             "hf_accum.a": module_imports(importer, "hf_accum.a", False, known)}
    assert import_cycles(graph) == [["hf_accum.a", "hf_accum.b", "hf_accum.a"]]


def test_the_cycle_walk_skips_logger_names():
    known = {"hf_accum", "hf_accum.a", "hf_accum.b"}
    source = "import logging\nlogger = logging.getLogger('hf_accum.b')\n"
    assert module_imports(source, "hf_accum.a", False, known) == set()


# The recipe config kit points one way: the components (data, modeling, preference, the checks) import it, it
# imports none of them. Its only other recipe modules: the argv parser and the embedded defaults' paths.
CONFIG_KIT = "hf_accum.recipe.config"
CONFIG_KIT_MAY_IMPORT = {"hf_accum.recipe", "hf_accum.recipe.command_line", "hf_accum.recipe.embedded"}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (any kind of import)."""
    seen: set[str] = set()
    frontier = [start]
    while frontier:
        for name in graph[frontier.pop()] - seen:
            seen.add(name)
            frontier.append(name)
    return seen


def test_the_config_kit_imports_no_component_of_the_recipe():
    graph = import_graph()
    kit = [name for name in graph if name == CONFIG_KIT or name.startswith(CONFIG_KIT + ".")]
    assert len(kit) >= 4 and "hf_accum.recipe.config.schema" in graph["hf_accum.recipe.preference_section"]
    reached = set().union(*(reachable(graph, name) for name in kit))
    components = sorted(name for name in reached if name.startswith("hf_accum.recipe.") and name not in kit
                        and name not in CONFIG_KIT_MAY_IMPORT)
    assert not components, f"the config kit imports components of the recipe: {components}"


def test_the_component_walk_sees_a_kit_that_imports_a_component():
    graph = {"hf_accum.recipe.config": {"hf_accum.recipe.config.schema"},
             "hf_accum.recipe.config.schema": {"hf_accum.recipe.command_line"},
             "hf_accum.recipe.command_line": {"hf_accum.recipe.data"}, "hf_accum.recipe.data": set()}
    assert reachable(graph, "hf_accum.recipe.config") == {"hf_accum.recipe.config.schema",
                                                          "hf_accum.recipe.command_line", "hf_accum.recipe.data"}


def test_the_trainer_side_never_imports_the_loop_package():
    graph = import_graph()
    bad = {f"{module} -> {name}" for module, names in graph.items() if module.startswith("hf_accum.trainer")
           for name in names if name == "hf_accum.loop" or name.startswith("hf_accum.loop.")}
    assert not bad, "the Trainer side imports the loop package:\n" + "\n".join(sorted(bad))


def test_no_module_is_longer_than_500_lines():
    lengths = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
               for path in package_modules().values()}
    long = sorted(f"{name}: {count} lines" for name, count in lengths.items() if count > MAX_MODULE_LINES)
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


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


def _imports_by_computed_name(function: ast.FunctionDef) -> list[str]:
    """Calls in ``function`` that import a module whose name is not a literal (``importlib.import_module(f"...")``,
    ``__import__(name)``)."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                                                      "__import__"):
            if not (node.args and isinstance(node.args[0], ast.Constant)):
                found.append(ast.unparse(node))
    return found


def test_no_module_level_getattr_imports_by_computed_name():
    """A module-level ``__getattr__`` that imports by computed name hides import edges from the graph tests and
    from type checkers (a compatibility shim of that kind once hid a cycle); lazy names use static imports."""
    bad = []
    for name, path in package_modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                bad += [f"{name}: {call}" for call in _imports_by_computed_name(node)]
    assert not bad, "module-level __getattr__ importing by computed name:\n" + "\n".join(bad)
