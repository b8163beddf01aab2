"""Spawned gloo worlds shared by the torch_side tests: one spawn per world size per session."""

from __future__ import annotations

import pytest

from tests.torch_side import (
    cases_collective_check,
    cases_exceptions,
    cases_grad_norm,
    cases_init_sync,
    cases_quantize,
    cases_reliability,
    cases_training,
    cases_wire,
)
from tests.torch_side.multiprocess import CaseOutcome, run_cases

# Every case module registers {"module:function": world sizes}; a world size is spawned once and
# runs all of its cases. SLOW_CASES (tests marked slow) run in a second spawn of their world, so
# `make test` (-m "not slow") never pays for them.
_MODULES = (
    cases_collective_check, cases_exceptions, cases_grad_norm, cases_init_sync, cases_quantize,
    cases_reliability, cases_training, cases_wire,
)
REGISTRY: dict[str, tuple[int, ...]] = {k: v for m in _MODULES for k, v in m.CASES.items()}
SLOW_REGISTRY: dict[str, tuple[int, ...]] = {
    k: v for m in _MODULES for k, v in getattr(m, "SLOW_CASES", {}).items()
}


@pytest.fixture(scope="session")
def spawned():
    """``spawned(world_size, slow)[case_name] -> CaseOutcome``, computed on first use."""
    cache: dict[tuple[int, bool], dict[str, CaseOutcome]] = {}

    def get(world_size: int, slow: bool = False) -> dict[str, CaseOutcome]:
        if (world_size, slow) not in cache:
            registry = SLOW_REGISTRY if slow else REGISTRY
            names = [n for n, sizes in registry.items() if world_size in sizes]
            cache[world_size, slow] = run_cases(world_size, names)
        return cache[world_size, slow]

    return get


def check_case(spawned, module, fn, world_size: int) -> None:
    name = f"{module.__name__}:{fn.__name__}"
    slow = world_size in SLOW_REGISTRY.get(name, ())
    assert slow or world_size in REGISTRY.get(name, ()), (
        f"{name} is not registered for world size {world_size}"
    )
    outcome = spawned(world_size, slow)[name]
    assert outcome.ok, outcome.detail
