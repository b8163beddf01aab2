"""Run test cases in spawned process groups: the cases that need real processes
(``tests/torch_side/conftest.py`` says which), the NCCL pass and the benchmarks' parity pass.

Each case is a function ``case(ctx: WorkerContext) -> None`` that raises on a mismatch; a spawn
runs a list of them ("module:function"). All ranks run the cases in the same order through
``torch_side.launch.run_local_ranks``, which stops the world the moment one rank raises: the
failing case is reported at once with that rank's traceback (never as a collective timeout), the
cases that completed on every rank before it passed, and the rest are reported as not run.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import tempfile
import time
from pathlib import Path

from torch_side.launch import LaunchError, run_local_ranks

__all__ = ["CaseOutcome", "WorkerContext", "run_cases"]

COLLECTIVE_TIMEOUT_S = 60.0  # a rank that stalls makes the others fail within this
WORLD_TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    device: str  # "cpu" (gloo) or "cuda:0" (nccl: each rank sees only its own GPU)
    # world-size-1 CUDA copies through the communication streams (Overlap.streams_at_world_1),
    # asked for by the test that spawned the world with MXFP8_FSDP_COMM_STREAMS=1 (test_nccl.py)
    comm_streams: bool = False


@dataclasses.dataclass(frozen=True)
class CaseOutcome:
    ok: bool
    detail: str  # the failing rank's traceback, or why the case did not run; "" when it passed


class CaseFailed(AssertionError):
    """Raised on a rank when one of its cases fails; the message names the case."""


def _worker(cases: list[str], progress_dir: str, cache_dir: str) -> None:
    import jax
    import torch
    import torch.distributed as dist

    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as in tests/conftest.py
    if cache_dir:  # later spawns load the programs an earlier one compiled (same shapes)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda:0" if dist.get_backend() == "nccl" else "cpu"
    if device != "cpu":
        # the cases compare bytes: no atomics (Torch's embedding backward, XLA reductions) and
        # the same XLA kernel choice for the same program (bridge.determinism)
        from bridge.determinism import make_deterministic

        make_deterministic()
        torch.cuda.set_device(0)
    ctx = WorkerContext(rank, world, device, os.environ.get("MXFP8_FSDP_COMM_STREAMS") == "1")
    done: list[str] = []
    seconds: dict[str, float] = {}
    for name in cases:
        module, fn = name.split(":")
        start = time.perf_counter()
        try:
            getattr(importlib.import_module(module), fn)(ctx)
        except BaseException as e:  # noqa: BLE001 -- becomes this rank's failure, case named
            raise CaseFailed(f"case {name} failed on rank {rank}/{world}") from e
        done.append(name)
        seconds[name] = round(time.perf_counter() - start, 2)
        Path(progress_dir, f"rank{rank}.json").write_text(json.dumps(done))
        Path(progress_dir, f"seconds{rank}.json").write_text(json.dumps(seconds))


_JAX_CACHE: tempfile.TemporaryDirectory | None = None


def _jax_cache_dir() -> str:
    """One persistent JAX compilation cache per parent process (removed when it exits)."""
    global _JAX_CACHE
    if os.environ.get("TORCH_SIDE_TEST_JAX_CACHE") == "off":
        return ""
    if _JAX_CACHE is None:
        _JAX_CACHE = tempfile.TemporaryDirectory(prefix="torch_side_jax_cache_")
    return _JAX_CACHE.name


def _report_seconds(progress_dir: str, world_size: int, wall: float) -> None:
    """Append rank 0's seconds per case to $TORCH_SIDE_CASE_SECONDS (a file), if set: where a
    world's time goes, for keeping the CI suite inside its budget."""
    out = os.environ.get("TORCH_SIDE_CASE_SECONDS")
    path = Path(progress_dir, "seconds0.json")
    if not out or not path.exists():
        return
    seconds = json.loads(path.read_text())
    with open(out, "a") as f:
        f.write(f"world {world_size}: {wall:.1f} s wall, {sum(seconds.values()):.1f} s in cases\n")
        for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
            f.write(f"  {s:7.2f}  {name}\n")


def _failed_case(error: LaunchError, cases: list[str]) -> str | None:
    text = str(error)
    return next((c for c in cases if f"case {c} failed" in text), None)


def run_cases(world_size: int, cases: list[str], backend: str = "gloo") -> dict[str, CaseOutcome]:
    """Spawn ``world_size`` ranks on 127.0.0.1, run ``cases`` ("module:function") on each.

    backend: "gloo" (CPU tensors) or "nccl" (rank r on GPU r, which it sees as cuda:0).
    """
    device = "cuda" if backend == "nccl" else "cpu"
    with tempfile.TemporaryDirectory(prefix="run_cases_") as progress:
        start = time.perf_counter()
        try:
            run_local_ranks(
                _worker, world_size, (cases, progress, _jax_cache_dir()), device=device,
                timeout=WORLD_TIMEOUT_S, collective_timeout=COLLECTIVE_TIMEOUT_S,
            )
            _report_seconds(progress, world_size, time.perf_counter() - start)
            return {name: CaseOutcome(True, "") for name in cases}
        except LaunchError as e:
            error = e
        done_per_rank = []
        for r in range(world_size):
            path = Path(progress, f"rank{r}.json")
            done_per_rank.append(set(json.loads(path.read_text())) if path.exists() else set())
    done_everywhere = set.intersection(*done_per_rank)
    failed = _failed_case(error, cases)
    outcomes = {}
    for name in cases:
        if name in done_everywhere:
            outcomes[name] = CaseOutcome(True, "")
        elif name == failed or failed is None:
            outcomes[name] = CaseOutcome(False, str(error))
        else:
            outcomes[name] = CaseOutcome(
                False, f"not run: the world stopped at case {failed} (see its test)"
            )
    return outcomes
