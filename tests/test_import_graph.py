"""No import circles between the package's modules, and imports only down the floors.

The graph is read from the source with ``ast``: an edge ``a -> b`` for every
``import`` of a ``mosaic`` module in ``a``, plus the packages ``b`` lives in
(importing ``x.y.z`` runs ``x/__init__`` and ``x/y/__init__``), except the
importer's own enclosing packages, which are already initialising. A function
body's import hides a circle rather than removing it, so those count too. The floors are
``mosaic.FLOORS`` (bottom first): a module may import its own area or a lower one, never a higher.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "mosaic").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _graph(mods: dict[str, Path], *, function_level: bool) -> dict[str, set[str]]:
    def ours(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        stack = [(node, False) for node in ast.iter_child_nodes(ast.parse(path.read_text()))]
        while stack:
            node, in_fn = stack.pop()
            in_fn = in_fn or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            stack += [(child, in_fn) for child in ast.iter_child_nodes(node)]
            if in_fn and not function_level or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(filter(None, [pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg, base]))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for name in names:
                target = ours(name)
                if target is None or target == mod:
                    continue
                graph[mod].add(target)
                parts = target.split(".")
                for i in range(1, len(parts)):
                    parent = ".".join(parts[:i])
                    if parent in mods and not mod.startswith(parent + "."):
                        graph[mod].add(parent)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_circles_among_module_level_imports():
    assert _cycles(_graph(_modules(), function_level=False)) == []


def test_no_circles_hidden_in_function_bodies():
    assert _cycles(_graph(_modules(), function_level=True)) == []


def test_the_graph_sees_a_circle(tmp_path, monkeypatch):
    """The check itself: a two-module circle written into a fake package is found."""
    (tmp_path / "mosaic" / "agent").mkdir(parents=True)
    (tmp_path / "mosaic" / "__init__.py").write_text("")
    (tmp_path / "mosaic" / "agent" / "__init__.py").write_text("")
    (tmp_path / "mosaic" / "agent" / "a.py").write_text("from mosaic.agent.b import X\n")
    (tmp_path / "mosaic" / "agent" / "b.py").write_text("def f():\n    from mosaic.agent import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    mods = _modules()
    assert _cycles(_graph(mods, function_level=False)) == []
    assert _cycles(_graph(mods, function_level=True)) == [["mosaic.agent.a", "mosaic.agent.b"]]


def _area(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def _upward(graph: dict[str, set[str]], floors: tuple[str, ...]) -> list[str]:
    """Every import from a lower floor to a higher one, as ``'a -> b'``."""
    rank = {area: i for i, area in enumerate(floors)}
    out = []
    for mod, targets in graph.items():
        for target in targets:
            a, b = _area(mod), _area(target)
            if a is None or b is None or a == b:
                continue
            if rank[b] > rank[a]:
                out.append(f"{mod} ({a}) -> {target} ({b})")
    return sorted(out)


def test_every_area_has_a_floor():
    import mosaic

    areas = {_area(m) for m in _modules()} - {None, "assets"}  # assets: model files (a saved tokenizer's code)
    assert areas == set(mosaic.FLOORS), f"areas without a floor: {areas - set(mosaic.FLOORS)}; " \
                                        f"floors without an area: {set(mosaic.FLOORS) - areas}"


def test_the_package_docstring_lists_the_floors_in_order():
    import mosaic

    listed = [line.split("``")[1].split(".")[1] for line in mosaic.__doc__.splitlines()
              if line.startswith("- ``mosaic.")]
    assert listed == list(mosaic.FLOORS)


def test_imports_only_go_down_the_floors():
    import mosaic

    assert _upward(_graph(_modules(), function_level=True), mosaic.FLOORS) == []


def test_the_floor_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself: ``core`` importing ``train`` (even inside a function) is found."""
    for area in ("core", "train"):
        (tmp_path / "mosaic" / area).mkdir(parents=True)
        (tmp_path / "mosaic" / area / "__init__.py").write_text("")
    (tmp_path / "mosaic" / "__init__.py").write_text("")
    (tmp_path / "mosaic" / "train" / "t.py").write_text("from mosaic.core.c import X\n")
    (tmp_path / "mosaic" / "core" / "c.py").write_text("def f():\n    from mosaic.train import t\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = _graph(_modules(), function_level=True)
    assert _upward(graph, ("core", "train")) == ["mosaic.core.c (core) -> mosaic.train (train)",
                                                  "mosaic.core.c (core) -> mosaic.train.t (train)"]
    assert _upward(graph, ("train", "core")) == ["mosaic.train.t (train) -> mosaic.core (core)",
                                                  "mosaic.train.t (train) -> mosaic.core.c (core)"]


def test_every_registered_command_module_exists_and_registers():
    """No dead registration: each module ``mosaic.cli`` lists imports and has ``register``."""
    import importlib

    from mosaic.cli import COMMAND_MODULES

    for name in COMMAND_MODULES:
        assert callable(getattr(importlib.import_module(name), "register", None)), name
