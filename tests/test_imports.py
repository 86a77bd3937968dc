"""The package's shape, as tests (issue 54's targets): its modules import each other without a
circle, and no file of it is over `MAX_LINES` lines.

The graph is read from the source (`ast`), never by importing: an arrow for every import of a
package module, at the top of a module or deferred inside a function (an import moved into a
function is where a circle hides: it only moves the failure from import time to call time),
and none for an import under `if TYPE_CHECKING:` (types only, never run). `from pkg import
name` is an arrow to the module `pkg.name` where there is one, else to `pkg`. A package's
`__init__` importing its own modules is an arrow like any other; a module importing its parent
package is not implied (Python runs the parent's `__init__` first, whichever module asks).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "extensible_kv"
# issue 54: no package file over ~900 lines.
MAX_LINES = 900
# Circles tolerated for now, each as the sorted modules of one strongly connected component,
# with the reason and who removes it. Empty: keep it so.
ALLOWED_CIRCLES: list[tuple[str, ...]] = []


def module_names(root: Path) -> dict[str, Path | None]:
    """Dotted name -> source file, for every module under `root` (a package directory); an
    extension module known by its stub (`_native.pyi`) maps to None."""
    base = root.parent
    names: dict[str, Path | None] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    for stub in sorted(root.rglob("*.pyi")):
        names.setdefault(".".join(stub.relative_to(base).with_suffix("").parts), None)
    return names


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth, less those under `if
    TYPE_CHECKING:` (their `else:` branch counts)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            for branch in child.orelse:
                found.extend(_imports(ast.Module(body=[branch], type_ignores=[])))
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            found.append(child)
        found.extend(_imports(child))
    return found


def _targets(
    name: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: set[str]
) -> set[str]:
    """The package modules one import statement of module `name` reaches."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:
        parts = name.split(".") if is_package else name.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        source = ".".join([*parts, node.module] if node.module else parts)
    else:
        source = node.module or ""
    if source not in modules:
        return set()
    return {
        f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
        for alias in node.names
    }


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (the module's docstring says which arrows)."""
    names = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        graph[name] = set()
        if path is None:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            graph[name] |= _targets(name, path.name == "__init__.py", node, set(names))
        graph[name].discard(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: each strongly connected component of more than one module, as one
    circle through all of them (Tarjan's algorithm, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, arrows = work[-1]
            step = next(arrows, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(_cycle_through(sorted(component), graph))
    return sorted(components)


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A circle from the component's first module back to it, for the message: a path by
    breadth-first search inside the component."""
    inside, first = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for step in sorted(graph[node] & inside):
                if step == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), first]
                if step not in came_from:
                    came_from[step] = node
                    following.append(step)
        frontier = following
    raise AssertionError(f"{component} is not a circle")


def test_the_package_has_no_import_circle() -> None:
    found = circles(import_graph(PACKAGE))
    unexpected = [c for c in found if tuple(sorted(set(c))) not in ALLOWED_CIRCLES]
    assert not unexpected, "import circles: " + "; ".join(" -> ".join(c) for c in unexpected)
    stale = [c for c in ALLOWED_CIRCLES if c not in {tuple(sorted(set(f))) for f in found}]
    assert not stale, f"allowed circles that are gone (take them off ALLOWED_CIRCLES): {stale}"


def test_the_graph_sees_the_package_and_its_deferred_imports() -> None:
    """The graph is not empty by mistake: the package's known arrows are in it, a deferred
    one among them, and the native module is a node."""
    graph = import_graph(PACKAGE)
    assert {"extensible_kv.kv_cache", "extensible_kv.footprint"} <= graph["extensible_kv.sizing"]
    assert "extensible_kv.footprint" in graph["extensible_kv.kv_cache"]
    assert "extensible_kv.shape" in graph["extensible_kv.tensor"]  # inside borrow_dealt
    assert graph["extensible_kv._native"] == set()
    assert "extensible_kv.pool.member" in graph["extensible_kv.pool"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "pkg"


def test_the_checker_finds_a_circle_however_it_is_imported(tmp_path: Path) -> None:
    """At the top, deferred in a function, relative, through a package: a circle; under
    `TYPE_CHECKING`: none."""
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    from .sub import c\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "import pkg.a\n",
            "pkg/d.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n"
            ),
            "pkg/e.py": "from pkg.d import x\n",
        },
    )
    graph = import_graph(pkg)
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.d"] == set()
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_no_package_file_is_too_long() -> None:
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py*"))
        if path.suffix in (".py", ".pyi")
        and (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by subject): {long}"
