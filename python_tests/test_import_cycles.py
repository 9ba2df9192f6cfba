"""No import cycle between needle's modules at module level.

The graph is read from the source with ``ast``: an edge ``a -> b`` for every ``import`` that
runs when module ``a`` is imported (module body, class bodies, ``if``/``try``/``with`` blocks;
not function bodies, which run later). ``from pkg import name`` points at ``pkg.name`` when that
is a module, else at ``pkg``. A parent package's ``__init__`` is not counted as imported by its
submodules: that edge exists for every module and is not what the layer rule is about.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "needle"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _module_level(body):
    """Statements that run at import time (function bodies excluded)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _module_level(inner)


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in _module_level(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_the_detector_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_and_from_imports():
    graph = import_graph()
    assert "needle.autograd.value" in graph["needle.autograd.tensor"]
    assert "needle.autograd" in graph["needle.ops"]  # from ..autograd import Op, ...


def test_needle_has_no_module_level_import_cycle():
    cycles = find_cycles(import_graph())
    assert cycles == [], f"import cycles between needle modules: {cycles}"
