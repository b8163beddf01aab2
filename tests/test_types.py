"""Types are part of the test command (STYLE.md; issue 31, item 5).

- ``mypy`` over the library and applications (``[tool.mypy]`` in pyproject.toml: every function
  that annotates any parameter annotates all of them and its return; the frameworks' own types
  are not analysed, so a run takes seconds) reports nothing;
- every public function -- a module-level function or a method of a public class, whose name
  has no leading underscore, in ``common``, ``jax_side``, ``bridge``, ``torch_side`` or ``apps``
  -- annotates every parameter and its return (``__init__``: its parameters), so the surfaces
  between the layers say what they take and give.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "jax_side", "bridge", "torch_side", "apps")
_SPECIAL = {"__init__", "__call__"}  # the dunders that are a public signature


def test_mypy_reports_nothing(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: pip install -e '.[dev]' (it is in the dev extra)")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"mypy found problems:\n{done.stdout}{done.stderr}"


def _missing(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if method and not static and params:
        params = params[1:]  # self / cls
    out = [p.arg for p in params if p.annotation is None]
    out += [f"*{v.arg}" for v in (a.vararg, a.kwarg) if v is not None and v.annotation is None]
    if fn.returns is None and fn.name != "__init__":
        out.append("return")
    return out


def _public_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node, False
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{sub.name}", sub, True


def test_every_public_function_is_annotated():
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for name, fn, method in _public_functions(ast.parse(path.read_text())):
                if fn.name.startswith("_") and fn.name not in _SPECIAL:
                    continue
                if missing := _missing(fn, method):
                    found.append(f"{path.relative_to(ROOT)}:{fn.lineno} {name}: {missing}")
    assert not found, "annotate these public functions:\n" + "\n".join(found)
