"""The import graph keeps one direction: kernels <- engines <- harness.pipeline <- harness.commands <- cli / plugin;
harness.build (the zoo's builders) reads spec only and only the CLI imports it.

Every .py under kernels/, engines/, harness/, suites/ and tests/ is parsed (not imported): ``import`` and ``from``
statements at any depth, ``importlib.import_module("...")`` / ``pytest.importorskip("...")`` with a literal name,
and registry strings such as ``"lpdiff.engines.vllm:VLLMEngine"``. Each failure names file:line and the rule.
The same parse checks the tests: every product module is imported by some test, and no test file imports another.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kernels": "lpdiff.kernels",
    "engines": "lpdiff.engines",
    "harness": "lpdiff.harness",
    "suites": "suites",
    "tests": "tests",
}
REGISTRY_STRING = re.compile(r"((?:lpdiff|tests)(?:\.\w+)+):\w+")  # "module:Class", built in a lane or by the registry
STRING_TARGETS: list[tuple[str, str]] = []  # (file:line, module) of every "module:Class" string
IMPORT_CALLS = ("import_module", "importorskip", "__import__")


@dataclass(frozen=True, slots=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (a submodule where ``from pkg import sub`` names one)
    path: Path
    line: int
    top_level: bool  # executed on import (not inside a function or class body, not under TYPE_CHECKING)
    type_only: bool = False  # under ``if TYPE_CHECKING:``: never executed

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    prefix = PACKAGES[parts[0]]
    rest = parts[1:-1] if parts[-1] == "__init__" else parts[1:]
    return ".".join([prefix, *rest])


def source_files() -> list[Path]:
    return sorted(p for d in PACKAGES for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


MODULES = {module_name(p): p for p in source_files()}


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, path: Path):
        self.module, self.path, self.depth, self.edges, self.type_only = module, path, 0, [], False
        self.is_package = path.name == "__init__.py"

    def _add(self, target: str, node: ast.AST) -> None:
        if target:
            self.edges.append(Edge(self.module, target, self.path, node.lineno, self.depth == 0, self.type_only))

    def _nested(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _nested

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if "TYPE_CHECKING" in test:  # never executed: still an import of the file, not a runtime edge
            self.type_only = True
            self._nested(node)
            self.type_only = False
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve_from(node, self.module, self.is_package)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in MODULES else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if (
            name in IMPORT_CALLS
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            self._add(node.args[0].value, node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            m = REGISTRY_STRING.fullmatch(node.value)
            if m:
                self._add(m.group(1), node)
                STRING_TARGETS.append((f"{self.path.relative_to(ROOT)}:{node.lineno}", m.group(1)))


def _edges() -> list[Edge]:
    out = []
    for module, path in MODULES.items():
        c = _Collector(module, path)
        c.visit(ast.parse(path.read_text(), filename=str(path)))
        out += c.edges
    return out


EDGES = _edges()


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(sources: tuple[str, ...], allowed, rule: str) -> list[str]:
    """Edges from modules under ``sources`` to lpdiff modules that ``allowed(target)`` refuses."""
    return [
        f"{e.where()}: {rule}: {e.source} imports {e.target}"
        for e in EDGES
        if _under(e.source, *sources) and _under(e.target, "lpdiff") and not allowed(e.target)
    ]


def _assert_none(bad: list[str]) -> None:
    bad = list(dict.fromkeys(bad))  # `from x import a, b` is one line
    assert not bad, f"{len(bad)} import(s) break the layer rules:\n" + "\n".join(bad)


def test_the_parser_sees_every_kind_of_import():
    """The rules are only as good as the edges: each kind the docstring names is found somewhere."""
    by_source = {}
    for e in EDGES:
        by_source.setdefault(e.source, set()).add(e.target)
    assert "lpdiff.engines.vllm" in by_source["lpdiff.engines.registry"]  # registry string
    assert any(not e.top_level for e in EDGES if e.source.startswith("lpdiff.harness"))  # inside functions
    assert len(MODULES) > 90 and "lpdiff.engines.triton" in MODULES and "lpdiff.kernels" in MODULES
    tree = ast.parse("import importlib\nimportlib.import_module('lpdiff.kernels.x')\ndef f():\n    from .y import z\n")
    c = _Collector("lpdiff.engines.triton.a", ROOT / "engines/triton/a.py")
    c.visit(tree)
    assert [(e.target, e.top_level) for e in c.edges] == [
        ("importlib", True),
        ("lpdiff.kernels.x", True),
        ("lpdiff.engines.triton.y", False),
    ]


def test_kernels_import_nothing_else_of_lpdiff():
    _assert_none(
        _violations(
            ("lpdiff.kernels",), lambda t: _under(t, "lpdiff.kernels"), "lpdiff.kernels imports nothing else of lpdiff"
        )
    )


def test_engines_import_only_the_shared_vocabulary():
    ok = ("lpdiff.kernels", "lpdiff.engines", "lpdiff.harness.types", "lpdiff.harness.spec")
    _assert_none(
        _violations(
            ("lpdiff.engines",),
            lambda t: t == "lpdiff" or _under(t, *ok),
            "engines import only kernels, engines, harness.types and harness.spec",
        )
    )


def test_spec_imports_only_types_and_spec():
    ok = ("lpdiff.harness.types", "lpdiff.harness.spec")
    _assert_none(
        _violations(
            ("lpdiff.harness.spec", "lpdiff.harness.types"),
            lambda t: t in ("lpdiff", "lpdiff.harness") or _under(t, *ok),
            "harness.spec / harness.types import only types and spec",
        )
    )


def test_build_imports_only_spec_and_only_the_cli_imports_build():
    """harness/build/ (the zoo's builders) sits beside engines, above spec: it reads spec and types; of the product
    only the CLI faces import it, so nothing a run executes depends on a builder (its docstring says why)."""
    ok = ("lpdiff.harness.types", "lpdiff.harness.spec", "lpdiff.harness.build")
    bad = _violations(
        ("lpdiff.harness.build",),
        lambda t: t in ("lpdiff", "lpdiff.harness") or _under(t, *ok),
        "harness.build imports only spec, types and build",
    )
    cli = tuple(m for m in MODULES if m.startswith(("lpdiff.harness.cli", "lpdiff.harness.plugin")))
    bad += [
        f"{e.where()}: only the CLI imports harness.build: {e.source} imports {e.target}"
        for e in EDGES
        if _under(e.target, "lpdiff.harness.build")
        and _under(e.source, "lpdiff")
        and not _under(e.source, "lpdiff.harness.build", *cli)
    ]
    _assert_none(bad)


def test_pipeline_and_commands_import_no_layer_above():
    above = {
        "lpdiff.harness.pipeline": ("lpdiff.harness.commands", "lpdiff.harness.cli", "lpdiff.harness.plugin"),
        "lpdiff.harness.commands": ("lpdiff.harness.cli", "lpdiff.harness.plugin"),
    }
    bad = []
    for layer, refused in above.items():
        bad += _violations((layer,), lambda t, r=refused: not _under(t, *r), f"{layer} imports no layer above it")
    _assert_none(bad)


ENGINE_API = ("lpdiff.engines", "lpdiff.engines.base", "lpdiff.engines.capabilities")


def test_harness_never_reaches_into_an_engine():
    _assert_none(
        _violations(
            ("lpdiff.harness",),
            lambda t: not _under(t, "lpdiff.engines") or t in ENGINE_API,
            f"harness uses only the public engine API {', '.join(ENGINE_API)}",
        )
    )


def test_tests_and_suites_never_import_benchmarks():
    bad = [
        f"{e.where()}: tests and suites never import benchmarks/: {e.source} imports {e.target}"
        for e in EDGES
        if _under(e.source, "tests", "suites") and _under(e.target, "benchmarks")
    ]
    _assert_none(bad)


def _cycles(prefix: str, edges: list[Edge] | None = None) -> list[list[Edge]]:
    """Cycles among the modules under ``prefix``, one per strongly connected component. Imports inside functions
    count too: a lazy import is how such a circle is hidden (kernels' fused_moe_lora importing moe_grouped, which
    builds on it; engines/triton's engine -> tp -> runtime -> engine), and it still ties the modules together.
    Only ``if TYPE_CHECKING:`` imports, never executed, are left out."""
    graph: dict[str, dict[str, Edge]] = {m: {} for m in MODULES if _under(m, prefix)}
    for e in EDGES if edges is None else edges:
        if not e.type_only and e.source in graph and e.target in graph and e.target != e.source:
            graph[e.source].setdefault(e.target, e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    comps: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [[e for s in comp for t, e in graph[s].items() if t in comp] for comp in comps]


@pytest.mark.parametrize("prefix", ["lpdiff.kernels", "lpdiff.engines.triton"])
def test_no_import_cycles(prefix):
    found = _cycles(prefix)
    lines = [f"  {e.where()}: {e.source} -> {e.target}" for cycle in found for e in cycle]
    assert not found, (
        f"{len(found)} import cycle(s) among {prefix} modules (rule: no cycles, lazy imports "
        "included):\n" + "\n".join(lines)
    )


def test_cycle_finder_finds_a_cycle():
    a, b = "lpdiff.kernels.logprob", "lpdiff.kernels.attention"
    edges = [
        Edge(a, b, ROOT / "kernels/logprob.py", 1, True),
        Edge(b, a, ROOT / "kernels/attention.py", 2, True),
        Edge(a, b, ROOT / "kernels/logprob.py", 3, False, True),
    ]
    assert [[(e.source, e.target) for e in c] for c in _cycles("lpdiff.kernels", edges)] == [[(b, a), (a, b)]]
    edges = edges[1:]  # a lazy import closes a cycle as well; a TYPE_CHECKING one does not
    assert _cycles("lpdiff.kernels", edges) == []
    edges = [*edges, Edge(a, b, ROOT / "kernels/logprob.py", 4, False)]
    assert len(_cycles("lpdiff.kernels", edges)) == 1


# -- every product module is imported by a test ----------------------------------------------------------------------


def _is_test(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return _under(module, "tests") and (last.startswith("test_") or last == "conftest")


def _exports() -> dict[tuple[str, str], tuple[str, str]]:
    """(module, name) -> (module, name) it was imported from, for the top-level ``from lpdiff... import`` lines of
    product modules: how a package's face re-exports what its submodules define."""
    out = {}
    for module, path in MODULES.items():
        if not _under(module, "lpdiff"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                base = _resolve_from(node, module, path.name == "__init__.py")
                if _under(base, "lpdiff"):
                    for a in node.names:
                        out[(module, a.asname or a.name)] = (base, a.name)
    return out


EXPORTS = _exports()


def _defining(module: str, name: str) -> str:
    """The module that ``module.name`` lives in: the submodule of that name, or the end of the re-export chain."""
    seen = set()
    while f"{module}.{name}" not in MODULES:
        nxt = EXPORTS.get((module, name))
        if nxt is None or nxt in seen:
            return module
        seen.add(nxt)
        module, name = nxt
    return f"{module}.{name}"


class _TestUses(ast.NodeVisitor):
    """What one test file reaches of lpdiff: the modules it imports, the modules that define the names it imports
    from a package's face, and ``alias.name`` attributes of a module it imported under an alias."""

    def __init__(self, module: str, path: Path):
        self.module, self.is_package, self.aliases, self.used = module, path.name == "__init__.py", {}, set()

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if _under(a.name, "lpdiff"):
                self.used.add(a.name)
                if a.asname:
                    self.aliases[a.asname] = a.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve_from(node, self.module, self.is_package)
        if not _under(base, "lpdiff"):
            return
        self.used.add(base)
        for a in node.names:
            target = _defining(base, a.name)
            self.used.add(target)
            if target in MODULES and target.endswith("." + a.name):
                self.aliases[a.asname or a.name] = target

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases:
            self.used.add(_defining(self.aliases[node.value.id], node.attr))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        arg = node.args[0] if node.args else None
        literal = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""
        if name in IMPORT_CALLS and _under(literal, "lpdiff"):
            self.used.add(literal)
        self.generic_visit(node)


def _tested() -> set[str]:
    used = set()
    for module, path in MODULES.items():
        if _is_test(module):
            v = _TestUses(module, path)
            v.visit(ast.parse(path.read_text(), filename=str(path)))
            used |= v.used
    return used


def _untested(used: set[str]) -> list[str]:
    """Product modules no test reaches; a package counts as reached when a test reaches it or anything in it."""
    out = []
    for module, path in MODULES.items():
        if not _under(module, "lpdiff"):
            continue
        package = path.name == "__init__.py"
        if not (module in used or (package and any(_under(u, module) for u in used))):
            out.append(f"{path.relative_to(ROOT)} ({module})")
    return sorted(out)


def test_every_product_module_is_imported_by_a_test():
    """Each .py under harness/, engines/, kernels/ is imported by some tests/**/test_*.py or conftest.py: directly,
    or by a name imported from a package that re-exports it from there (lpdiff/__init__.py is the version only).
    A new module comes with its test."""
    missing = _untested(_tested())
    assert not missing, f"{len(missing)} product module(s) no test imports (add a test beside its mirror in " + (
        "tests/):\n" + "\n".join(missing)
    )


def test_the_test_rule_sees_names_through_a_face_and_aliases():
    tree = ast.parse(
        "from lpdiff.harness.spec.adapters import convert_adapter\n"
        "from lpdiff.harness.spec import validate as v\n"
        "def t():\n    v.adapters\n"
    )
    uses = _TestUses("tests.harness.spec.test_x", ROOT / "tests/harness/spec/test_x.py")
    uses.visit(tree)
    assert "lpdiff.harness.spec.adapters.convert" in uses.used  # the face re-exports it from there
    assert "lpdiff.harness.spec.validate.adapters" in uses.used  # a submodule reached through an alias
    assert "lpdiff.kernels.ssd" not in uses.used
    assert _untested(set()), "with no test at all, every module is missing"
    assert _is_test("tests.engines.triton.conftest") and _is_test("tests.kernels.test_moe")
    assert not _is_test("tests.helpers.moe") and not _is_test("suites.test_bug_zoo")


def test_no_test_file_imports_another():
    """Shared code lives in tests/helpers/: a test file imported by another runs its module-level code twice and
    ties the two together (a fixture re-exported from one test module to another ran in both). The GPU suites in
    suites/ are the product's own test plans: tests of their grid and helpers read them, as tests read any module."""
    bad = [
        f"{e.where()}: a test imports no test file (shared code goes to tests/helpers/): {e.source} imports {e.target}"
        for e in EDGES
        if _under(e.source, "tests", "suites")
        and _under(e.target, "tests")
        and _is_test(e.target)
        and e.target != e.source  # a lane child building a class of the test file that starts it
    ]
    _assert_none(bad)


def test_module_class_strings_name_a_module_that_exists():
    """The "module:Class" strings (the engine registry, a subprocess lane's target) are imported by name in another
    process: a module moved or renamed must fail here, not there."""
    bad = [
        f"{where}: {target} is no module of the checkout"
        for where, target in STRING_TARGETS
        if target not in MODULES and not target.rsplit(".", 1)[-1].startswith("no_such")  # missing on purpose
    ]
    assert len(STRING_TARGETS) > 5, STRING_TARGETS  # the registry's four engines at least
    _assert_none(bad)
