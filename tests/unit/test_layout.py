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


# -- structure: small functions, small classes, few parameters ------------------------------------------------
#
# The 500-line module cap alone is met by squeezing (joined argument lines, a module cut at 499); what keeps code
# readable is the size of its units. Every function and method of the package, the recipe scripts and the
# benchmarks: at most 60 lines (decorators aside, docstring included), every class at most 300, and at most 10
# parameters (``self`` / ``cls`` not counted; ``*args`` and ``**kwargs`` count one each). Options that travel
# together are one frozen dataclass (e.g. hf_accum.fused.loss._ChunkOptions, one argument of an autograd.Function).

MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
MAX_PARAMETERS = 10
STRUCTURE_ROOTS = ("hf_accum", "recipes", "benchmarks")


def structure_sources() -> list[Path]:
    return sorted(path for root in STRUCTURE_ROOTS for path in (ROOT / root).rglob("*.py"))


def parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    arguments = function.args
    names = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    count = len(names) + (arguments.vararg is not None) + (arguments.kwarg is not None)
    return count - (1 if names and names[0].arg in ("self", "cls") else 0)


def structure_violations(source: str, relative: str) -> list[str]:
    """``path::qualified.name: what`` for every function longer than :data:`MAX_FUNCTION_LINES`, with more than
    :data:`MAX_PARAMETERS` parameters, and every class longer than :data:`MAX_CLASS_LINES`, nested ones included."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                where = f"{relative}::{name} (line {child.lineno})"
                if isinstance(child, ast.ClassDef) and lines > MAX_CLASS_LINES:
                    found.append(f"{where}: class of {lines} lines (max {MAX_CLASS_LINES})")
                if not isinstance(child, ast.ClassDef):
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{where}: function of {lines} lines (max {MAX_FUNCTION_LINES})")
                    if (count := parameter_count(child)) > MAX_PARAMETERS:
                        found.append(f"{where}: {count} parameters (max {MAX_PARAMETERS})")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _structure_report(kind: str) -> list[str]:
    """The violations of one kind ("function of", "class of", "parameters") over every source."""
    return [entry for path in structure_sources()
            for entry in structure_violations(path.read_text(), path.relative_to(ROOT).as_posix()) if kind in entry]


def test_no_function_is_longer_than_60_lines():
    assert len(structure_sources()) > 100  # the walk sees the package, the recipe and the benchmarks
    bad = _structure_report("function of")
    assert not bad, "functions over 60 lines (split them: one job each):\n" + "\n".join(bad)


def test_no_class_is_longer_than_300_lines():
    bad = _structure_report("class of")
    assert not bad, "classes over 300 lines (move a concern into its own class or module):\n" + "\n".join(bad)


def test_no_function_takes_more_than_10_parameters():
    bad = _structure_report("parameters")
    assert not bad, "functions over 10 parameters (group the options that travel together):\n" + "\n".join(bad)


def _function(name: str, parameters: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}({parameters}):\n{body}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (_function("f", "", 59), []),  # 60 lines: the limit
        (_function("f", "", 60), ["planted.py::f (line 1): function of 61 lines (max 60)"]),
        ("class C:\n" + _function("g", "self", 60, "    "),
         ["planted.py::C.g (line 2): function of 61 lines (max 60)"]),  # a method, by its qualified name
        ("class C:\n" + "".join(_function(f"m{i}", "self", 9, "    ") for i in range(29)) + "    y = 1\n" * 9,
         []),  # 300 lines: the limit
        ("class C:\n" + "".join(_function(f"m{i}", "self", 9, "    ") for i in range(30)),
         ["planted.py::C (line 1): class of 301 lines (max 300)"]),
        (_function("f", ", ".join(f"a{i}" for i in range(10)), 1), []),
        (_function("f", ", ".join(f"a{i}" for i in range(11)), 1), ["planted.py::f (line 1): 11 parameters (max 10)"]),
        (_function("f", "a, /, b, *args, c, d=1, **kwargs", 1), []),  # 6: posonly, *args, kwonly, **kwargs
        (_function("f", "a0, a1, a2, a3, a4, a5, a6, a7, /, b, *args, c", 1),
         ["planted.py::f (line 1): 11 parameters (max 10)"]),
        ("class C:\n" + _function("m", "self, " + ", ".join(f"a{i}" for i in range(10)), 1, "    "), []),  # self free
        ("class C:\n" + _function("m", "cls, " + ", ".join(f"a{i}" for i in range(11)), 1, "    "),
         ["planted.py::C.m (line 2): 11 parameters (max 10)"]),
        ("def outer():\n" + _function("inner", ", ".join(f"a{i}" for i in range(11)), 1, "    "),
         ["planted.py::outer.inner (line 2): 11 parameters (max 10)"]),  # nested functions are walked
    ],
)
def test_the_structure_walk_finds_each_planted_violation(source, expected):
    assert structure_violations(source, "planted.py") == expected


# -- the layout table: one row per module, kept complete ------------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
_LAYOUT_ROW = re.compile(r"^\| `([^`]+)` \|")


def layout_table_modules(text: str) -> list[str]:
    """The module named by each row of the table under ``## Layout`` (its first cell: one backticked path)."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [match.group(1) for line in section.splitlines() if (match := _LAYOUT_ROW.match(line))]


def layout_table_problems(named: list[str], modules: set[str]) -> list[str]:
    duplicated = sorted({name for name in named if named.count(name) > 1})
    return ([f"missing from the table: {name}" for name in sorted(modules - set(named))]
            + [f"in the table but no such module: {name}" for name in sorted(set(named) - modules)]
            + [f"more than one row: {name}" for name in duplicated])


def test_the_layout_table_names_every_module_once():
    named = layout_table_modules(ARCHITECTURE.read_text())
    modules = {path.relative_to(ROOT).as_posix() for path in package_modules().values()}
    assert len(modules) > 100 and "hf_accum/boundary.py" in named  # the walk and the parser see both sides
    problems = layout_table_problems(named, modules)
    assert not problems, "docs/architecture.md's layout table (one row per module of hf_accum/):\n" + "\n".join(problems)


def test_the_layout_check_finds_a_missing_a_stale_and_a_repeated_row():
    text = ("# A\n\n## Layout\n\n| module | owns |\n| --- | --- |\n| `hf_accum/a.py` | a |\n| `hf_accum/gone.py` | g |\n"
            "| `hf_accum/a.py` | again |\n\n## Next\n\n| `hf_accum/b.py` | not the layout table |\n")
    named = layout_table_modules(text)
    assert named == ["hf_accum/a.py", "hf_accum/gone.py", "hf_accum/a.py"]
    assert layout_table_problems(named, {"hf_accum/a.py", "hf_accum/b.py"}) == [
        "missing from the table: hf_accum/b.py", "in the table but no such module: hf_accum/gone.py",
        "more than one row: hf_accum/a.py"]
