"""No import cycle among quantlab's modules (quantlab/ and kernels/, installed as quantlab.kernels).

The graph is read from the sources with `ast`; nothing is imported. Every `import` and
`from ... import` counts, module-level or inside a function (lazy), except those under
`if TYPE_CHECKING:` (never executed). `importlib.import_module("a.b")` with a literal name
counts too; a computed name (an f-string) cannot be resolved and does not. Edges:
`import a.b.c` → the module a.b.c (a package: its __init__); `from P import x` → P.x when x is
a submodule, else P; relative imports are resolved against the importing module's package.

Run as a script (`python tests/test_import_graph.py`) to print the graph's cycles, if any.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Source directory → the package name it installs as (pyproject's package-dir).
ROOTS = {REPO / "quantlab": "quantlab", REPO / "kernels": "quantlab.kernels"}


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name → (source file, is a package)."""
    found: dict[str, tuple[Path, bool]] = {}
    for root, pkg in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            found[".".join([pkg, *parts])] = (path, is_pkg)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom / literal importlib.import_module call, skipping TYPE_CHECKING blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield ast.Import(names=[ast.alias(name=node.args[0].value)])
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, mods: dict) -> str | None:
    """`name` or its longest prefix that is one of our modules."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [_known(a.name, mods) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else _known(base, mods))
            edges[mod].update(t for t in targets if t is not None and t != mod)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def shortest_cycle(edges: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One shortest cycle through the component's first module, as a path a → ... → a."""
    start, members = comp[0], set(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def describe(edges: dict[str, set[str]], found: list[list[str]]) -> str:
    lines = []
    for comp in found:
        lines.append(f"cycle of {len(comp)} modules: {', '.join(comp)}")
        lines.append("  e.g. " + " -> ".join(shortest_cycle(edges, comp)))
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    edges = graph()
    assert "quantlab.recipe" in edges and "quantlab.kernels.ops" in edges  # the walk found the sources
    found = cycles(edges)
    assert not found, "import cycles among quantlab modules:\n" + describe(edges, found)


if __name__ == "__main__":
    g = graph()
    c = cycles(g)
    print(f"{len(g)} modules, {sum(map(len, g.values()))} import edges, {len(c)} cycle(s)")
    if c:
        print(describe(g, c))
