"""The layer rules of DESIGN.md 2, enforced: an import graph over the source, and real imports in
fresh interpreters asserting which frameworks each package pulls in.

Layers (lowest first): ``common`` (framework-free facts) <- ``jax_side`` (numerics) <- ``bridge``
(the only library package importing torch and jax) <- ``torch_side`` (FSDP; JAX only through
``bridge``) <- ``models`` (the GPT twins) <- ``apps`` (training, parity, command lines). Every
import anywhere in a file counts, also inside functions ("not even lazily"), and so does an import
made from a string: ``importlib.import_module("a.b")`` (or ``__import__``) is an edge to ``a.b``;
where the name is not a literal (a table of module names), every string in the file that names a
project module counts. No circle between files, and none between packages or sub-packages.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = ("common", "jax_side", "bridge", "torch_side", "models", "apps")
FRAMEWORKS = ("torch", "jax", "jaxlib", "flax")

# What each top-level package may import: project packages and frameworks.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "jax_side": {"common", "jax", "jaxlib", "flax"},
    "bridge": {"common", "jax_side", "jax", "jaxlib", "torch"},
    "torch_side": {"common", "bridge", "torch"},
    "models": {"common", "jax_side", "bridge", "torch_side", "jax", "jaxlib", "flax", "torch"},
    "apps": {"common", "jax_side", "bridge", "torch_side", "models", "jax", "jaxlib", "flax",
             "torch"},
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {
        _module_name(p): p
        for top in PROJECT
        for p in sorted((ROOT / top).rglob("*.py"))
    }


MODULES = _modules()


def _resolve(base: str, name: str | None) -> str:
    """``from base import name``: the submodule if ``name`` is one, else ``base``."""
    if name and f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    return base


_STRING_IMPORTERS = {"import_module", "__import__"}  # importlib.import_module, __import__


def _string_imports(tree: ast.AST) -> set[str]:
    """Modules imported by name from a string: literal arguments of import_module/__import__;
    where an argument is not a literal, every string constant of the file naming a project
    module (the table the name comes from)."""
    out: set[str] = set()
    dynamic = False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in _STRING_IMPORTERS:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            out.add(arg.value)
        else:
            dynamic = True
    if dynamic:
        out.update(
            n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in MODULES
        )
    return out


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """Every module ``module`` imports (project modules by full name, others by top level)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = _string_imports(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            out.update(_resolve(base, a.name) for a in node.names)
    return {m if m.split(".")[0] in PROJECT else m.split(".")[0] for m in out}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_package_imports_only_the_layers_below_it():
    bad = []
    for module, deps in GRAPH.items():
        top = module.split(".")[0]
        for dep in deps:
            dep_top = dep.split(".")[0]
            if dep_top == top:
                continue
            if (dep_top in PROJECT or dep_top in FRAMEWORKS) and dep_top not in ALLOWED[top]:
                bad.append(f"{module} imports {dep}")
    assert not bad, "layer violations (DESIGN.md 2):\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_files():
    graph = {m: {d for d in deps if d in GRAPH and d != m} for m, deps in GRAPH.items()}
    assert _cycles(graph) == []


def test_no_import_circle_between_packages():
    def package(m: str) -> str:
        return m if MODULES[m].name == "__init__.py" else m.rpartition(".")[0]

    graph: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        graph.setdefault(package(m), set()).update(
            package(d) for d in deps if d in MODULES and package(d) != package(m)
        )
    # a package's __init__ re-exporting its own sub-packages is containment, not a circle
    for p, deps in graph.items():
        graph[p] = {d for d in deps if not d.startswith(p + ".") and not p.startswith(d + ".")}
    assert _cycles(graph) == []


# The environment is read in ``apps`` only (issue 31, item 5): the library takes every switch as
# an argument or a dataclass field, which ``apps.environment`` fills from the documented
# variables. The exceptions are variables that JAX, XLA, CUDA, cuBLAS or NCCL read from the
# environment themselves, with no API to set them, each set inside a function (never at import):
_JAX_ALLOC = ("JAX reads it, and no API sets it, when it creates its GPU client: without it JAX "
              "preallocates most of a GPU that Torch shares (DESIGN.md 6)")
ENVIRONMENT_ALLOWED: dict[str, dict[str, str]] = {
    "bridge.devices": {"XLA_PYTHON_CLIENT_PREALLOCATE": _JAX_ALLOC + "; start_jax_backend"},
    "common.shared_pool": {
        "XLA_PYTHON_CLIENT_ALLOCATOR": "JAX reads it, and no API sets it, when it creates its "
                                       "GPU client; use_shared_pool sets it before that",
        "PYTORCH_CUDA_ALLOC_CONF": "Torch reads its allocator backend from the environment "
                                   "only, when torch is imported; use_shared_pool sets it before",
    },
    "bridge.determinism": {
        "XLA_FLAGS": "XLA takes its deterministic-kernel flags from the environment only, read "
                     "when JAX's backend starts; make_deterministic merges them in and "
                     "xla_deterministic_ops reads them back (bridge.units asks it)",
        "CUBLAS_WORKSPACE_CONFIG": "cuBLAS reads its deterministic workspace from the "
                                   "environment only",
    },
    "torch_side.launch": {  # the per-rank bootstrap, before the rank imports JAX or starts CUDA
        "XLA_FLAGS": "one simulated XLA host device per rank: XLA reads the flag when JAX starts",
        "XLA_PYTHON_CLIENT_PREALLOCATE": _JAX_ALLOC,
        "CUDA_VISIBLE_DEVICES": "the rank's one GPU: CUDA reads it when it starts",
        "NCCL_NVLS_ENABLE": "NCCL reads it when it creates a communicator",
        "JAX_PLATFORMS": "JAX reads it when imported: a CPU rank's JAX stays on the CPU",
    },
}
_ENV_FUNCTIONS = {"getenv", "putenv", "unsetenv"}


def _environment_uses(tree: ast.AST) -> list[tuple[int, str | None, bool]]:
    """(line, variable name or None when not a literal, at module level) of every read or write
    of the process environment: ``os.environ`` (any use), ``os.getenv`` / ``putenv`` /
    ``unsetenv``, and those names imported from ``os``."""
    parent: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[child] = node

    def in_function(node: ast.AST) -> bool:
        while node in parent:
            node = parent[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                return True
        return False

    def literal(node: ast.AST | None) -> str | None:
        is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
        return node.value if is_text else None

    out: list[tuple[int, str | None, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in {"environ", *_ENV_FUNCTIONS} for a in node.names):
            out.append((node.lineno, None, not in_function(node)))
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "os" and node.attr in {"environ", *_ENV_FUNCTIONS}):
            continue
        up = parent.get(node)
        name = None
        if node.attr in _ENV_FUNCTIONS and isinstance(up, ast.Call) and up.args:
            name = literal(up.args[0])  # os.getenv("X")
        elif isinstance(up, ast.Subscript):
            name = literal(up.slice)  # os.environ["X"]
        elif isinstance(up, ast.Attribute) and isinstance(parent.get(up), ast.Call):
            call = parent[up]
            name = literal(call.args[0]) if call.args else None  # os.environ.get("X", ...)
        out.append((node.lineno, name, not in_function(node)))
    return out


def test_the_library_reads_no_environment_but_what_a_framework_requires():
    bad = []
    for module, path in MODULES.items():
        if module.split(".")[0] == "apps":
            continue
        allowed = ENVIRONMENT_ALLOWED.get(module, {})
        for line, name, at_import in _environment_uses(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{line}"
            if name is None or name not in allowed:
                bad.append(f"{where}: {name or 'the environment'} (make it an argument that "
                           f"apps.environment fills)")
            elif at_import:
                bad.append(f"{where}: {name} at import (set it inside the function that needs it)")
    assert not bad, "environment reads or writes in the library:\n" + "\n".join(bad)


def test_every_allowed_environment_variable_is_used():
    used = {module: {n for _, n, _ in _environment_uses(ast.parse(MODULES[module].read_text()))}
            for module in ENVIRONMENT_ALLOWED}
    stale = [f"{m}: {n}" for m, names in ENVIRONMENT_ALLOWED.items() for n in names
             if n not in used[m]]
    assert not stale, f"allowed but no longer used (drop them): {stale}"


def _uses_private_jax(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        )
        if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
            return True
    return False


# ``jax._src`` changes without notice: the modules allowed to use it, each with its fallback.
PRIVATE_JAX_USERS = {
    "bridge.jax_fastpath": "the CUDA fast path of to_jax; the public path where it changed",
    "bridge.determinism": "whether JAX's backend started; 'not started' where it changed",
}


def test_private_jax_internals_are_used_only_where_a_fallback_is():
    users = {m for m, p in MODULES.items() if _uses_private_jax(p)}
    assert users == set(PRIVATE_JAX_USERS), "register the module here, with its fallback"


def test_the_graph_sees_the_known_edges():
    """The checker itself: it must see real edges (else every rule above passes vacuously)."""
    assert "jax_side.mxfp8.quantize" in GRAPH["jax_side.linear"] or (
        "jax_side.mxfp8" in GRAPH["jax_side.linear"]
    )
    assert "torch" in GRAPH["bridge.dlpack"] and "jax" in GRAPH["bridge.dlpack"]
    assert "bridge.mxfp8_slices" in GRAPH["torch_side.fsdp.distributed_quantize"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # imports made from strings: TE's GEMM primitive, and torch_side's table of lazy exports
    assert "transformer_engine" in GRAPH["jax_side.mxfp8.te_backend"]
    assert "torch_side.fsdp.fsdp_model" in GRAPH["torch_side"]


def test_string_imports_count_as_edges():
    literal = ast.parse("import importlib\nimportlib.import_module('jax_side.mxfp8.backends')")
    assert _string_imports(literal) == {"jax_side.mxfp8.backends"}
    table = ast.parse(
        "from importlib import import_module\n"
        "T = {'x': 'jax_side.mxfp8.xla_backend', 'y': 'not a module'}\n"
        "def load(k):\n    return import_module(T[k])\n"
    )
    assert _string_imports(table) == {"jax_side.mxfp8.xla_backend"}
    assert _string_imports(ast.parse("x = 'jax_side.mxfp8.xla_backend'")) == set()


def test_backends_reach_their_modules_without_a_circle():
    """The backend table sees every backend module, and no backend module imports the table."""
    table = GRAPH["jax_side.mxfp8.backends"]
    for name in ("xla_backend", "pallas_backend", "te_backend"):
        module = f"jax_side.mxfp8.{name}"
        assert module in table
        assert "jax_side.mxfp8.backends" not in GRAPH[module]
        assert "jax_side.mxfp8.kernels" not in GRAPH[module]


# ``torch.distributed``'s collectives, in every spelling (async, object, coalesced, point to point).
COLLECTIVE_NAMES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_single", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "send_object_list",
    "recv_object_list", "batch_isend_irecv", "gather", "gather_object", "scatter",
    "scatter_object_list", "all_to_all", "all_to_all_single", "reduce",
})
# The one file that calls them (its module note), and where else they may be called, with why.
COLLECTIVES_HOME = "torch_side/comm/collectives.py"
COLLECTIVE_EXCEPTIONS: dict[str, str] = {}
# What the rule reads: the library, the applications, the benchmarks and the GPU scripts. Not
# the tests: they check the wire against raw collectives of their own.
COLLECTIVE_SCOPE = (*PROJECT, "benchmarks", "scripts")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _collective_uses(tree: ast.AST) -> list[str]:
    """Where a file names a ``torch.distributed`` collective: an attribute of the module under
    any alias (``dist.all_reduce``, ``torch.distributed.barrier``, ``c10d.broadcast``), a
    ``getattr`` of it by a literal name, or an import of the function itself."""
    aliases: dict[str, str] = {}  # local name -> the torch.distributed module it is bound to
    uses: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full.startswith("torch.distributed") and a.name in COLLECTIVE_NAMES:
                    uses.append(f"{node.lineno}: from {node.module} import {a.name}")
                aliases[a.asname or a.name] = full

    def distributed(node: ast.AST) -> bool:
        name = _dotted(node)
        if name is None:
            return False
        head, _, rest = name.partition(".")
        full = aliases.get(head, head) + (f".{rest}" if rest else "")
        return full == "torch.distributed" or full.startswith("torch.distributed.")

    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in COLLECTIVE_NAMES
                and distributed(node.value)):
            uses.append(f"{node.lineno}: {_dotted(node)}")
        elif (isinstance(node, ast.Call) and _dotted(node.func) == "getattr"
              and len(node.args) >= 2 and distributed(node.args[0])
              and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in COLLECTIVE_NAMES):
            uses.append(f"{node.lineno}: getattr(..., {node.args[1].value!r})")
    return sorted(set(uses), key=lambda u: int(u.split(":")[0]))


def test_only_collectives_py_calls_torch_distributed_collectives():
    """``torch_side/comm/collectives.py`` is the only place that moves bytes (its module note):
    FSDP's collectives through a ``Communicator`` (wire log, collective check), the others
    (checkpoint agreement, a stand-alone quantize, applications' metrics) through its functions on a
    process
    group. Creating process groups and asking ranks and sizes are not collectives."""
    found = {}
    for top in COLLECTIVE_SCOPE:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if uses := _collective_uses(ast.parse(path.read_text(), rel)):
                found[rel] = uses
    assert found.keys() >= {COLLECTIVES_HOME}, "the rule no longer sees collectives.py's calls"
    allowed = {COLLECTIVES_HOME, *COLLECTIVE_EXCEPTIONS}
    bad = {f: u for f, u in found.items() if f not in allowed}
    assert not bad, (
        "call torch.distributed's collectives through torch_side.comm.collectives (a "
        "Communicator, or its functions on a process group), or list the file in "
        "COLLECTIVE_EXCEPTIONS with why:\n"
        + "\n".join(f"{f}:{u}" for f, us in sorted(bad.items()) for u in us)
    )


def test_the_collective_rule_sees_every_spelling():
    code = (
        "import torch\nimport torch.distributed as dist\nimport torch.distributed\n"
        "from torch import distributed as d2\nfrom torch.distributed import broadcast\n"
        "from torch.distributed import distributed_c10d as c10d\n"
        "dist.all_reduce(t)\ntorch.distributed.barrier()\nd2.gather_object(o, out)\n"
        "c10d.all_to_all(a, b)\nf = getattr(dist, 'all_gather_single', None)\n"
        "dist.get_rank(); dist.init_process_group('gloo'); dist.new_group([0])\n"
        "x.all_reduce(t); dist.fsdp.fully_shard(m)\n"
    )
    assert [u.split(": ", 1)[1] for u in _collective_uses(ast.parse(code))] == [
        "from torch.distributed import broadcast", "dist.all_reduce", "torch.distributed.barrier",
        "d2.gather_object", "c10d.all_to_all", "getattr(..., 'all_gather_single')",
    ]


# (import statement, modules that must NOT be loaded afterwards, modules that must be)
IMPORTS = [
    ("import common", ("torch", "jax", "flax"), ()),
    ("import common.model_config, common.kernels", ("torch", "jax", "flax"), ()),
    ("import jax_side.mxfp8", ("torch", "flax", "bridge"), ("jax",)),
    ("import jax_side.linear", ("torch", "bridge", "torch_side", "flax"), ("jax",)),
    ("import models", ("torch", "jax", "flax"), ()),
    ("import models.flax_gpt", ("torch", "bridge", "torch_side"), ("flax",)),
    ("import models.torch_gpt", ("flax", "apps"), ("torch", "bridge")),
    ("import torch_side.fsdp.strategy, torch_side.fsdp.policy", ("jax", "flax", "bridge"),
     ("torch",)),
    ("import torch_side", ("jax", "flax", "bridge"), ()),
    ("import bridge", ("torch_side", "apps", "flax"), ("torch", "jax")),
    ("from torch_side import fully_shard", ("apps", "flax"), ("bridge", "jax")),
]


@pytest.mark.parametrize(("statement", "absent", "present"), IMPORTS, ids=[i[0] for i in IMPORTS])
def test_a_fresh_import_loads_only_its_layers(statement, absent, present):
    code = (
        f"{statement}\nimport json, sys\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not loaded & set(absent), f"{statement!r} loaded {sorted(loaded & set(absent))}"
    assert set(present) <= loaded, f"{statement!r} did not load {set(present) - loaded}"
