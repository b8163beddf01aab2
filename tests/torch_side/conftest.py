"""Spawned gloo worlds shared by the torch_side tests: one spawn per world size per session."""

from __future__ import annotations

import pytest

from tests.torch_side import cases_quantize, cases_reliability, cases_training, cases_wire
from tests.torch_side.multiprocess import CaseOutcome, run_cases

# Every case module registers {"module:function": world sizes}; a world size is spawned once and
# runs all of its cases.
REGISTRY: dict[str, tuple[int, ...]] = {
    **cases_quantize.CASES,
    **cases_reliability.CASES,
    **cases_training.CASES,
    **cases_wire.CASES,
}


@pytest.fixture(scope="session")
def spawned():
    """``spawned(world_size)[case_name] -> CaseOutcome``, computed on first use."""
    cache: dict[int, dict[str, CaseOutcome]] = {}

    def get(world_size: int) -> dict[str, CaseOutcome]:
        if world_size not in cache:
            names = [n for n, sizes in REGISTRY.items() if world_size in sizes]
            cache[world_size] = run_cases(world_size, names)
        return cache[world_size]

    return get


def check_case(spawned, module, fn, world_size: int) -> None:
    name = f"{module.__name__}:{fn.__name__}"
    assert world_size in REGISTRY[name], f"{name} is not registered for world size {world_size}"
    outcome = spawned(world_size)[name]
    assert outcome.ok, outcome.detail
