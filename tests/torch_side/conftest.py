"""Spawned gloo worlds, for the few multi-rank cases that need real processes.

Every other multi-rank test runs in-process (``threaded_world.run_world``: ranks as threads of
torch's threaded process group). Two kinds of case stay in spawned processes, each saying why in
its module: ``cases_overlap.py`` (gloo's own asynchronous worker thread: buckets released late,
peak bytes against timing, the trace of a gather issued during the previous unit; the threaded
group completes an asynchronous collective at once) and ``cases_collective_check.py`` (a
collective that fails by a real gloo timeout; the threaded group has none). The NCCL pass
(``test_nccl.py``) and the benchmarks spawn their own ranks through ``run_cases`` too.

``check_case(module, fn, world_size)`` spawns ``world_size`` gloo ranks that run that one case
(``multiprocess.run_cases``) and fails the test with the failing rank's traceback. One spawn per
test: a selected test starts only its own world (seconds: the ranks import Torch and JAX), and
the worlds of a session share one persistent JAX compilation cache, so a later world loads the
programs an earlier one compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from tests.torch_side.multiprocess import run_cases


def check_case(module: ModuleType, fn: Callable, world_size: int) -> None:
    """Run case ``fn`` of ``module`` on ``world_size`` spawned gloo ranks; raise on failure."""
    name = f"{module.__name__}:{fn.__name__}"
    outcome = run_cases(world_size, [name])[name]
    assert outcome.ok, outcome.detail
