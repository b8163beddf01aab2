"""Spawned gloo worlds shared by the torch_side tests: one spawn per world size per session,
started ahead (worlds_ahead.py), running the cases the collected tests read (one selected test
spawns its world for its own case: seconds, not the whole registry)."""

from __future__ import annotations

import ast
import functools
import inspect
import os
import textwrap

import pytest

from tests.torch_side import (
    cases_collective_check,
    cases_overlap,
    worlds_ahead,
)
from tests.torch_side.multiprocess import CaseOutcome, run_cases

# Every case module registers {"module:function": world sizes}; a world size is spawned once and
# runs all of its cases. SLOW_CASES (tests marked slow) run in a second spawn of their world, so
# `make test` (-m "not slow") never pays for them; when the session reads both lists of a world
# (`make test-all`), they share one spawn (``spawned``). The worlds the collected tests need start
# at the end of collection, in a helper process (worlds_ahead.py), and run while pytest runs the
# tests before them; a test waits for its world's outcomes only if the world is still running.
_MODULES = (
    cases_collective_check, cases_overlap,
)
REGISTRY: dict[str, tuple[int, ...]] = {k: v for m in _MODULES for k, v in m.CASES.items()}
SLOW_REGISTRY: dict[str, tuple[int, ...]] = {
    k: v for m in _MODULES for k, v in getattr(m, "SLOW_CASES", {}).items()
}


# (world size, slow) -> the cases the collected tests read, where every check_case call of the
# session resolved statically; a world missing here runs all of its registered cases.
_SELECTED: dict[tuple[int, bool], set[str]] = {}


def _names(world_size: int, slow: bool) -> list[str]:
    """The cases a spawn of ``world_size`` runs: those the collected tests read (selecting one
    test spawns its world for its own case only), else every registered one."""
    registry = SLOW_REGISTRY if slow else REGISTRY
    chosen = _SELECTED.get((world_size, slow))
    return [n for n, sizes in registry.items()
            if world_size in sizes and (chosen is None or n in chosen)]


def _plan(needed: set[tuple[int, bool]]) -> list[tuple[int, list[str]]]:
    """One spawn per world size the session needs, its fast cases first, then its slow ones.
    World 2 first: it is the longest, and world 1, run after it, loads most of its programs
    from the shared compilation cache."""
    sizes = sorted({w for w, _ in needed}, key=lambda w: (w != 2, w))
    return [(w, [n for slow in (False, True) if (w, slow) in needed for n in _names(w, slow)])
            for w in sizes]


_AHEAD: worlds_ahead.WorldsAhead | None = None


def pytest_collection_finish(session):
    """Start the worlds the collected tests read in a helper process now (worlds_ahead.py), so
    they run while pytest runs the tests before them. TORCH_SIDE_WORLDS_AHEAD=0: spawn each
    world in this process when a test first needs it, as before."""
    global _AHEAD
    if session.config.option.collectonly or os.environ.get("TORCH_SIDE_WORLDS_AHEAD") == "0":
        return
    needed = _worlds_needed(session.items)
    if needed and _AHEAD is None:
        _AHEAD = worlds_ahead.WorldsAhead(_plan(needed))


def pytest_sessionfinish(session):
    global _AHEAD
    if _AHEAD is not None:
        _AHEAD.stop()
        _AHEAD = None


@pytest.fixture(scope="session")
def spawned(request):
    """``spawned(world_size, slow)[case_name] -> CaseOutcome``, computed on first use (or read
    from the helper that ran the world ahead). When the session's tests read both the fast and
    the slow cases of a world size (``make test-all``), both lists run in one spawn of that
    world (fast cases first): one start-up instead of two."""
    cache: dict[tuple[int, bool], dict[str, CaseOutcome]] = {}
    needed = _worlds_needed(request.session.items)
    ahead = {w: i for i, (w, _) in enumerate(_AHEAD.plan)} if _AHEAD is not None else {}

    def get(world_size: int, slow: bool = False) -> dict[str, CaseOutcome]:
        if (world_size, slow) not in cache:
            if (world_size, slow) in needed and world_size in ahead:
                both = _AHEAD.outcomes(ahead[world_size])
                for s in (False, True):
                    if (world_size, s) in needed:
                        cache[world_size, s] = {n: both[n] for n in _names(world_size, s)}
            elif {(world_size, False), (world_size, True)} <= needed:
                fast, slow_names = _names(world_size, False), _names(world_size, True)
                both = run_cases(world_size, fast + slow_names)
                cache[world_size, False] = {n: both[n] for n in fast}
                cache[world_size, True] = {n: both[n] for n in slow_names}
            else:
                cache[world_size, slow] = run_cases(world_size, _names(world_size, slow))
        return cache[world_size, slow]

    return get


def _worlds_needed(items) -> set[tuple[int, bool]]:
    """(world size, slow) of every case the collected tests read (where it resolves statically);
    records the cases themselves in ``_SELECTED`` when every call resolved."""
    selected: dict[tuple[int, bool], set[str]] = {}
    complete = True
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None or "spawned" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        calls = _check_case_calls(fn)
        complete &= bool(calls)
        for args in calls:
            try:
                module, case, world_size = (_value(a, params, item.module.__dict__)
                                            for a in args[1:])
            except (KeyError, AttributeError):
                complete = False
                continue
            name = f"{module.__name__}:{case.__name__}"
            key = (world_size, world_size in SLOW_REGISTRY.get(name, ()))
            selected.setdefault(key, set()).add(name)
    _SELECTED.clear()
    if complete:
        _SELECTED.update(selected)
    return set(selected)


@functools.cache
def _check_case_calls(test_fn) -> tuple[tuple[ast.expr, ...], ...]:
    """The argument expressions of the ``check_case(...)`` calls in a test function's body."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(test_fn)))
    except (OSError, TypeError, SyntaxError):
        return ()
    return tuple(
        tuple(node.args) for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_case"
        and len(node.args) == 4
    )


def _value(expr: ast.expr, params: dict, namespace: dict):
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.Name):
        return params[expr.id] if expr.id in params else namespace[expr.id]
    if isinstance(expr, ast.Attribute):
        return getattr(_value(expr.value, params, namespace), expr.attr)
    raise KeyError(ast.dump(expr))


@pytest.fixture(autouse=True)
def _spawn_worlds_in_setup(request):
    """Spawn the worlds a test reads in its setup, so that ``--durations`` shows a world's spawn
    as the setup of the first test that needs it, not as that test's own work."""
    if "spawned" not in request.fixturenames:
        return
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    for args in _check_case_calls(request.function):
        try:
            module, fn, world_size = (_value(a, params, request.module.__dict__) for a in args[1:])
        except (KeyError, AttributeError):
            continue  # not resolvable statically: the world spawns when check_case runs
        name = f"{module.__name__}:{fn.__name__}"
        request.getfixturevalue("spawned")(world_size, world_size in SLOW_REGISTRY.get(name, ()))


def check_case(spawned, module, fn, world_size: int) -> None:
    name = f"{module.__name__}:{fn.__name__}"
    slow = world_size in SLOW_REGISTRY.get(name, ())
    assert slow or world_size in REGISTRY.get(name, ()), (
        f"{name} is not registered for world size {world_size}"
    )
    outcome = spawned(world_size, slow)[name]
    assert outcome.ok, outcome.detail
