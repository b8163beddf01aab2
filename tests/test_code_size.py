"""Size limits of the library and application code (STYLE.md habit 1, issue 18): no file over
500 lines, no function over 60 lines, no class with more than 16 methods. A file or function that
grows past them is split by job before it lands."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "jax_side", "bridge", "torch_side", "models", "apps")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_METHODS = 500, 60, 16


def _sources():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _violations() -> list[str]:
    out = []
    for path in _sources():
        text = path.read_text()
        where = path.relative_to(ROOT)
        if (n := len(text.splitlines())) > MAX_FILE_LINES:
            out.append(f"{where}: {n} lines (max {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{where}:{node.lineno} {node.name}(): {n} lines "
                               f"(max {MAX_FUNCTION_LINES})")
            elif isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n > MAX_METHODS:
                    out.append(f"{where}:{node.lineno} class {node.name}: {n} methods "
                               f"(max {MAX_METHODS})")
    return out


def test_no_file_function_or_class_is_over_the_limits():
    found = _violations()
    assert not found, "split these by job (STYLE.md habit 1):\n" + "\n".join(found)
