"""Small rooms: no module over 450 lines and no function over 60 without a one-line reason, and no
private name (``_x``) imported from another module of the package.

A reason is a comment line ``# long: <why>`` among the first lines of the module (for its length) or
right under the function's ``def`` line (before or after its docstring).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE, MAX_FN = 450, 60


def _sources():
    for p in sorted((ROOT / "mosaic").rglob("*.py")):
        if "assets" not in p.relative_to(ROOT).parts:
            yield p, p.read_text()


def _reason(lines: list[str], start: int, stop: int) -> bool:
    return any(ln.strip().startswith("# long:") and len(ln.strip()) > len("# long:") + 3
               for ln in lines[start:stop])


def oversized_files(sources) -> list[str]:
    out = []
    for p, text in sources:
        lines = text.splitlines()
        if len(lines) > MAX_FILE and not _reason(lines, 0, 40):
            out.append(f"{p.relative_to(ROOT)}: {len(lines)} lines")
    return out


def long_functions(sources) -> list[str]:
    out = []
    for p, text in sources:
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            n = node.end_lineno - node.lineno + 1
            body_start = node.body[0].lineno - 1
            first = node.body[1].lineno - 1 if len(node.body) > 1 else body_start + 1
            if n > MAX_FN and not _reason(lines, node.lineno, max(first, body_start + 1) + 1):
                out.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    return out


def private_imports(sources) -> list[str]:
    out = []
    for p, text in sources:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mosaic"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        out.append(f"{p.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}")
    return out


def test_no_module_over_450_lines_without_a_reason():
    assert oversized_files(_sources()) == []


def test_no_function_over_60_lines_without_a_reason():
    assert long_functions(_sources()) == []


def test_no_private_name_crosses_a_module():
    assert private_imports(_sources()) == []


def test_the_checks_see_what_they_look_for(tmp_path):
    long_body = "\n".join(f"    x{i} = {i}" for i in range(70))
    ok_body = "    # long: one table, one place\n" + long_body
    src = [(ROOT / "mosaic" / "fake.py", "from mosaic.trace.graph import _kind\n"
                                         f"def f():\n{long_body}\n\ndef g():\n    '''doc'''\n{ok_body}\n"
                                         + "\n" * 400)]
    assert oversized_files(src) == ["mosaic/fake.py: 546 lines"]
    assert long_functions(src) == ["mosaic/fake.py:2 f: 71 lines"]
    assert private_imports(src) == ["mosaic/fake.py:1 imports mosaic.trace.graph._kind"]
