"""Run registered test cases in spawned gloo process groups, one spawn per world size.

Spawning a process and importing JAX costs seconds on a small CPU box, so every world size is
spawned once and runs the whole list of cases (``CASES``); the pytest tests then read each case's
outcome. Each case is a function ``case(ctx: WorkerContext) -> None`` that raises on a mismatch.
All ranks run the cases in the same order; a rank stops at its first failure (the others then fail
at their next collective, after the gloo timeout), so the first failure is the one to read.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import os
import socket
import tempfile
import traceback
from pathlib import Path

__all__ = ["CaseOutcome", "WorkerContext", "run_cases"]

_GLOO_TIMEOUT = datetime.timedelta(seconds=90)


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    device: str  # "cpu" (gloo) or "cuda:0" (nccl: each rank sees only its own GPU)


@dataclasses.dataclass(frozen=True)
class CaseOutcome:
    ok: bool
    detail: str  # traceback of the first failing rank, or "" when every rank passed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    cases: list[str],
    out_dir: str,
    backend: str,
    cache_dir: str,
) -> None:
    # Each rank's JAX work is single-device; strict promotion as in tests/conftest.py.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    if backend == "nccl":  # before CUDA starts: Torch's cuda:0 and JAX's GPU are this rank's GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import torch
    import torch.distributed as dist

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    if cache_dir:  # ranks and later spawns reuse each other's compiled kernels (same shapes)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    torch.set_num_threads(1)
    device = "cuda:0" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=_GLOO_TIMEOUT,
    )
    ctx = WorkerContext(rank, world_size, device)
    results: dict[str, str] = {}
    for name in cases:
        module, fn = name.split(":")
        try:
            getattr(importlib.import_module(module), fn)(ctx)
            results[name] = ""
        except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the test
            results[name] = f"rank {rank}/{world_size}:\n{traceback.format_exc()}"
            break
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


_JAX_CACHE: tempfile.TemporaryDirectory | None = None


def _jax_cache_dir() -> str:
    """One persistent JAX compilation cache per parent process (removed when it exits)."""
    global _JAX_CACHE
    if os.environ.get("TORCH_SIDE_TEST_JAX_CACHE") == "off":
        return ""
    if _JAX_CACHE is None:
        _JAX_CACHE = tempfile.TemporaryDirectory(prefix="torch_side_jax_cache_")
    return _JAX_CACHE.name


def run_cases(world_size: int, cases: list[str], backend: str = "gloo") -> dict[str, CaseOutcome]:
    """Spawn ``world_size`` ranks on 127.0.0.1, run ``cases`` ("module:function") on each.

    backend: "gloo" (CPU tensors) or "nccl" (rank r on GPU r, which it sees as cuda:0).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, _free_port(), cases, out_dir, backend, _jax_cache_dir()),
            nprocs=world_size,
            start_method="spawn",
            join=False,
        )
        spawn_error = ""
        try:
            while not ctx.join():
                pass
        except Exception as e:  # noqa: BLE001 -- a crashed rank is reported per case below
            spawn_error = f"worker process failed: {e}"
        per_rank = []
        for r in range(world_size):
            path = Path(out_dir, f"rank{r}.json")
            per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    outcomes = {}
    for name in cases:
        errors = [
            res.get(name, f"rank {r}: case did not run. {spawn_error}")
            for r, res in enumerate(per_rank)
        ]
        errors = [e for e in errors if e]
        outcomes[name] = CaseOutcome(not errors, errors[0] if errors else "")
    return outcomes
