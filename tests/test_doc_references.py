"""Every dotted reference to a project module in the docs, the README, the notebooks and the
docstrings/comments of the source names real code (issue 18: no stale ``jax_side.models.linear``).

A reference is a word like ``torch_side.fsdp.fsdp_model.FSDPModel`` or ``bridge.compile_ahead``
starting with one of the project's packages. It resolves, statically (nothing is imported), when
its longest prefix that is a module file or package is followed by names defined in that module:
a top-level def/class/assignment/import (or a name re-exported by a package ``__init__``, also
through a lazy ``_EXPORTS`` table), then attributes defined in that class's body.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "jax_side", "bridge", "torch_side", "models", "apps", "benchmarks",
            "tests")
# word boundary, a package, then one or more .identifier parts
REF = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = (".py", ".md", ".ipynb", ".sh", ".json", ".toml", ".txt", ".png", ".jsonl")


def _module_path(parts: tuple[str, ...]) -> Path | None:
    base = ROOT.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


@functools.cache
def _definitions(path: Path) -> dict[str, ast.AST | None]:
    """Top-level names of a module: name -> the node defining it (None for imports etc.)."""
    tree = ast.parse(path.read_text())
    names: dict[str, ast.AST | None] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = None
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and isinstance(
                node.value, ast.Dict
            ):
                for k in node.value.keys:
                    if isinstance(k, ast.Constant) and isinstance(k.value, str):
                        names[k.value] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
    return names


def _class_attrs(node: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def resolves(ref: str) -> bool:
    parts = tuple(ref.split("."))
    for cut in range(len(parts), 0, -1):
        path = _module_path(parts[:cut])
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        defs = _definitions(path)
        if rest[0] not in defs:
            return False
        node = defs[rest[0]]
        for attr in rest[1:]:
            if not isinstance(node, ast.ClassDef):
                return True  # an attribute of a value or an import: not checked further
            if attr not in _class_attrs(node):
                return False
            node = next((n for n in node.body if getattr(n, "name", None) == attr), None)
        return True
    return False


def _texts():
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield p, p.read_text()
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        yield p, "\n".join("".join(c["source"]) for c in cells)
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            if p != Path(__file__).resolve():  # its own examples of stale references
                yield p, p.read_text()


def _references():
    seen = {}
    for path, text in _texts():
        for m in REF.finditer(text):
            ref = m.group(1).rstrip(".")
            tail = text[m.end():m.end() + 1]
            if tail == "/" or ref.endswith(FILE_SUFFIXES) or any(
                ref.endswith(s[1:]) and ref.rsplit(".", 1)[-1] == s[1:] for s in FILE_SUFFIXES
            ):
                continue  # a path such as docs/x.md or a file name, not a dotted reference
            seen.setdefault(ref, str(path.relative_to(ROOT)))
    return seen


def test_every_dotted_reference_names_real_code():
    stale = {ref: where for ref, where in _references().items() if not resolves(ref)}
    assert not stale, "dotted references that name no code (reference: first file):\n" + "\n".join(
        f"  {ref}  ({where})" for ref, where in sorted(stale.items())
    )


@pytest.mark.parametrize("ref, ok", [
    ("torch_side.fsdp.fsdp_model.FSDPModel", True),
    ("torch_side.fsdp.fsdp_model.FSDPModel.zero_grad", True),
    ("torch_side.fsdp.fsdp_model.NoSuchThing", False),
    ("jax_side.models.linear", False),
    ("torch_side.training", False),
    ("common.kernels.KernelConfig", True),
])
def test_the_resolver_tells_real_from_stale(ref, ok):
    assert resolves(ref) is ok


# A path in backquotes in the README or the docs (`tests/bridge/test_dlpack.py`, `scripts/gpu/`).
PATH_REF = re.compile(
    r"`((?:common|jax_side|bridge|torch_side|models|apps|benchmarks|tests|scripts|docs|notebooks)"
    r"/[\w./-]*)`"
)


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_path_in_the_docs_exists():
    missing = [f"{p.name}: {m.group(1)}" for p in _doc_pages()
               for m in PATH_REF.finditer(p.read_text()) if not (ROOT / m.group(1)).exists()]
    assert not missing, "paths in the docs that name nothing:\n" + "\n".join(missing)


def test_every_walkthrough_of_the_extending_guide_names_the_test_that_performs_it():
    """docs/extending.md: each section ("A weight format", ...) names a test file, and it exists
    (the previous test); the page's opening says what that test does."""
    sections = re.split(r"^## ", (ROOT / "docs" / "extending.md").read_text(), flags=re.M)[1:]
    assert len(sections) >= 6
    untested = [s.splitlines()[0] for s in sections
                if not re.search(r"`tests/[\w/]+/test_\w+\.py`", s)]
    assert not untested, f"walkthroughs naming no test file: {untested}"


def test_test_files_sit_in_the_folder_of_the_package_they_test():
    """README, "Layout": one tests folder per source package, project-wide checks at the top."""
    top = {"test_architecture.py", "test_code_size.py",
           "test_doc_references.py", "test_types.py"}
    misplaced = []
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = p.relative_to(ROOT / "tests")
        if len(rel.parts) == 1:
            ok = rel.name in top
        else:
            folder = ROOT / Path(*rel.parts[:-1])
            # test_<module>.py sits in the folder of the module of that name, where it has one
            homes = [m.parent for m in (ROOT / rel.parts[0]).rglob(f"{rel.stem[5:]}.py")]
            ok = folder.is_dir() and (not homes or folder in homes)
        if not ok:
            misplaced.append(str(rel))
    assert not misplaced, f"test files outside a folder that mirrors a package: {misplaced}"
