"""The package layout keeps its promises: no import cycle between modules, files stay small,
and nothing outside `drafters/` names a drafter kind."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "specdraft"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdraft"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("specdraft"))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_cycle_between_modules():
    graph, state, cycle = _imports(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph[node]:
            if cycle:
                return
            if state.get(nxt) == "open":
                cycle.extend(stack[stack.index(nxt):] + [nxt])
                return
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in graph:
        if node not in state and not cycle:
            visit(node, [node])
    assert not cycle, " -> ".join(cycle)


def test_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert {f: n for f, n in sizes.items() if n > 420} == {}


def test_only_the_drafter_package_names_drafter_kinds():
    from specdraft.drafters.registry import KINDS

    kinds = "|".join(KINDS)
    pattern = re.compile(rf"""(==|!=|in|kind\s*=)\s*\(?\s*["']({kinds})["']""")
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if "drafters" not in p.parts and pattern.search(p.read_text())]
    assert offenders == []
