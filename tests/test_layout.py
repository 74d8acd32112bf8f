"""The package layout keeps its promises: imports only point down the layers, no import
cycle between modules, files and functions stay small, and nothing outside `drafters/`
names a drafter kind."""

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


# The layers, bottom first: a module may import its own package and the ones below it.
LAYERS = (
    ("specdraft", "errors", "storage"),  # the package's version; error types; the cache root and writing files whole
    ("learning",),  # feedback, policies, the planner, the driver: plain Python
    ("config",),  # the TOML table reader, the model spec, in-place edits
    ("core",),  # sampling transforms, lossless verification, the stopwatch
    ("models",),  # loading, caches, kernels, the forward
    ("drafters",),  # the drafter interface and one module per kind
    ("decoding",),  # the round (engine) and live evaluation
    ("profile",),  # a whole profile: drafters and policies named and checked
    ("runtime",),  # profile -> target, pool, policy, engine
    ("session",),  # one prompt as a user sees it
    ("serving",),  # the pool as a serving engine's proposer, per request; starting vLLM
    ("ui",),  # panel, tables, progress on stderr
    ("measurement",),  # datasets, bench, baselines, traces, replay
    ("training",),  # corpora, features, the training loop
    ("commands",),  # what each command does
    ("cli",),  # the options of every command
    ("launch", "__main__"),  # the command's start: the process's memory settings, then cli
)


def _layer(module: str) -> int:
    unit = module.split(".")[1] if "." in module else module
    return next(i for i, names in enumerate(LAYERS) if unit in names)


def test_imports_only_point_down_the_layers():
    upward = sorted(f"{a} -> {b}" for a, targets in _imports().items() for b in targets
                    if "." in a and _layer(b) > _layer(a))
    assert upward == []


# Inside models/, by job, bottom first: a subpackage imports its own modules, the ones below
# it, and the top-level models modules that import nothing else of models (devices, hub, the
# KV caches); the top-level modules (loading, CachedLM, CUDA graphs, width costs) import any.
MODEL_PACKAGES = ("kernels", "gguf", "lean")  # C kernels and products; GGUF files; the lean forward


def test_models_subpackages_import_only_down():
    graph = _imports()
    models = {m for m in graph if m.startswith("specdraft.models.")}
    base = {m for m in models if m.count(".") == 2 and not any(d.startswith("specdraft.models.") for d in graph[m])}
    assert {m.split(".")[2] for m in models if m.count(".") >= 3} == set(MODEL_PACKAGES)
    wrong = []
    for module in sorted(models):
        if module.count(".") < 3:
            continue
        rank = MODEL_PACKAGES.index(module.split(".")[2])
        for target in graph[module]:
            if not target.startswith("specdraft.models.") or target in base:
                continue
            inside = target.count(".") >= 3 and MODEL_PACKAGES.index(target.split(".")[2]) <= rank
            if not inside:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_every_module_has_a_layer():
    units = {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in ROOT.rglob("*.py")} - {"__init__"}
    assert units <= {name for names in LAYERS for name in names}


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
    assert {f: n for f, n in sizes.items() if n > 350} == {}


def test_functions_stay_short():
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 50:
                long.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_only_the_drafter_package_names_drafter_kinds():
    from specdraft.drafters.registry import KINDS

    kinds = "|".join(KINDS)
    pattern = re.compile(rf"""(==|!=|in|kind\s*=)\s*\(?\s*["']({kinds})["']""")
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if "drafters" not in p.parts and pattern.search(p.read_text())]
    assert offenders == []
