"""Run one function on N local ranks (spawned processes, one process group) and collect results.

``run_local_ranks(fn, world_size, args)`` spawns ``world_size`` processes ("spawn" start method:
no forked JAX or CUDA state), joins them into one ``torch.distributed`` group on 127.0.0.1 (gloo
on CPU, NCCL on CUDA), calls ``fn(*args)`` on every rank and returns the per-rank return values
(rank order). ``fn`` must be importable (a module-level function) and its result picklable.

Per-rank environment (set before the rank imports JAX): one simulated XLA host device, and on CUDA
``CUDA_VISIBLE_DEVICES=<rank>`` so that Torch's ``cuda:0`` and JAX's only GPU are the same device
(DESIGN.md 6: each rank's JAX work stays on that rank's device), with JAX preallocation off.
"""

from __future__ import annotations

import enum
import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["LaunchDevice", "run_local_ranks"]


class LaunchDevice(enum.Enum):
    CPU = "cpu"  # gloo
    CUDA = "cuda"  # nccl, one GPU per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, device, fn, args, out_dir):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if device is LaunchDevice.CUDA:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    if device is LaunchDevice.CPU:
        torch.set_num_threads(1)
    backend = "nccl" if device is LaunchDevice.CUDA else "gloo"
    kwargs = {"device_id": torch.device("cuda", 0)} if device is LaunchDevice.CUDA else {}
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    try:
        result = fn(*args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_local_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    device: LaunchDevice | str = LaunchDevice.CPU,
) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``, each rank in its own process."""
    device = LaunchDevice(device) if not isinstance(device, LaunchDevice) else device
    if world_size < 1:
        raise ValueError(f"run_local_ranks: world_size must be >= 1, got {world_size}")
    if device is LaunchDevice.CUDA:
        import torch

        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"run_local_ranks: world_size={world_size} CUDA ranks need {world_size} GPUs, "
                f"{torch.cuda.device_count()} visible; lower --world-size or use device='cpu'"
            )
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank_main,
            args=(world_size, _free_port(), device, fn, args, out_dir),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results
