"""Every function in the package fits on one screen (≤ 60 lines, def to last line, docstring
included), so each one still reads top to bottom in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"
MAX_LINES = 60


def long_functions(source: str, filename: str) -> list[str]:
    """`file:line name (N lines)` for each function or method in `source` longer than MAX_LINES."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES:
                found.append(f"{filename}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_the_package_is_longer_than_60_lines():
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py"))
                 for hit in long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert offenders == []


def test_the_check_counts_methods_and_stops_at_the_limit():
    def function(name: str, lines: int, indent: str = "") -> str:
        return f"{indent}def {name}():\n" + "".join(f"{indent}    x = {i}\n" for i in range(lines - 1))

    source = function("fits", MAX_LINES) + "class C:\n" + function("method", MAX_LINES + 1, indent="    ")
    assert long_functions(source, "m.py") == [f"m.py:{MAX_LINES + 2} method ({MAX_LINES + 1} lines)"]
