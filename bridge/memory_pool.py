"""The device's default CUDA memory pool: its counters, and whether Torch and JAX share it.

With ``common.shared_pool.use_shared_pool()`` (called before Torch is imported and before JAX
starts its GPU backend; ``bench_train_step --shared-pool`` and ``mxfp8-train --shared-pool`` call
it before their ranks start) Torch and JAX allocate from one pool, the CUDA driver's default pool
of the device (``cudaMallocAsync``), instead of each keeping its own cache (that module's note
says why it matters). Here:

- ``shared_pool_active()`` checks, in the process that does the work, that both really allocate
  from the pool: Torch's allocator backend is ``cudaMallocAsync`` and a JAX allocation shows in
  the pool's use (``require_shared_pool()``: the same, as an error that says what to do -- the
  check ``--shared-pool``'s ranks make);
- ``pool_stats()`` reads the pool's counters from the CUDA driver (``cuMemPoolGetAttribute``):
  bytes in use and reserved, and their high-water marks since ``reset_pool_peak()`` -- with the
  shared pool, the whole process's GPU memory, both frameworks together.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

__all__ = ["PoolStats", "pool_stats", "require_shared_pool", "reset_pool_peak",
           "shared_pool_active"]

# CUmemPool_attribute (cuda.h)
_RESERVED_MEM_CURRENT, _RESERVED_MEM_HIGH, _USED_MEM_CURRENT, _USED_MEM_HIGH = 5, 6, 7, 8


class PoolStats(NamedTuple):
    """The default pool's counters, in bytes (high-water marks since ``reset_pool_peak``)."""

    used: int
    used_high: int
    reserved: int
    reserved_high: int


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(
            f"bridge.memory_pool: the CUDA driver (libcuda.so.1) is not loadable here ({e}); "
            f"the pool statistics exist on a machine with an NVIDIA GPU only"
        ) from e


def _pool(index: int) -> tuple[ctypes.CDLL, ctypes.c_void_p]:
    lib = _driver()
    dev, pool = ctypes.c_int(), ctypes.c_void_p()
    for name, rc in (("cuInit", lib.cuInit(0)),
                     ("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), index)),
                     ("cuDeviceGetDefaultMemPool",
                      lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev))):
        if rc != 0:
            raise RuntimeError(f"bridge.memory_pool: {name} failed with CUresult {rc} "
                               f"(device {index})")
    return lib, pool


def pool_stats(index: int = 0) -> PoolStats:
    """The default pool's counters of CUDA device ``index`` (module note)."""
    lib, pool = _pool(index)
    out = []
    for attr in (_USED_MEM_CURRENT, _USED_MEM_HIGH, _RESERVED_MEM_CURRENT, _RESERVED_MEM_HIGH):
        value = ctypes.c_uint64()
        rc = lib.cuMemPoolGetAttribute(pool, attr, ctypes.byref(value))
        if rc != 0:
            raise RuntimeError(f"bridge.memory_pool: cuMemPoolGetAttribute({attr}) failed with "
                               f"CUresult {rc}")
        out.append(int(value.value))
    return PoolStats(*out)


def reset_pool_peak(index: int = 0) -> None:
    """Reset the default pool's high-water marks (used and reserved) to the current values."""
    lib, pool = _pool(index)
    for attr in (_USED_MEM_HIGH, _RESERVED_MEM_HIGH):
        zero = ctypes.c_uint64(0)  # the driver takes 0 only: the mark restarts from now
        rc = lib.cuMemPoolSetAttribute(pool, attr, ctypes.byref(zero))
        if rc != 0:
            raise RuntimeError(f"bridge.memory_pool: cuMemPoolSetAttribute({attr}) failed with "
                               f"CUresult {rc}")


def shared_pool_active(index: int = 0) -> bool:
    """Whether Torch and JAX both allocate from device ``index``'s default pool: Torch's
    allocator backend is ``cudaMallocAsync``, and a 64 MiB JAX array shows in the pool's use.
    Starts JAX (``start_jax_backend``) and Torch's CUDA if they are not yet."""
    import jax
    import numpy as np
    import torch

    from bridge.devices import start_jax_backend

    if not torch.cuda.is_available() or torch.cuda.get_allocator_backend() != "cudaMallocAsync":
        return False
    gpus = [d for d in start_jax_backend() if d.platform == "gpu"]
    if index >= len(gpus):
        return False
    torch.cuda.synchronize(index)
    before = pool_stats(index).used
    probe = jax.device_put(np.zeros((16, 2**20), np.float32), gpus[index]).block_until_ready()
    grew = pool_stats(index).used - before
    del probe
    return grew >= 64 * 2**20


def require_shared_pool(index: int = 0) -> None:
    """``shared_pool_active``, or a RuntimeError that names Torch's allocator backend and what
    to do (the check the commands' ranks make for ``--shared-pool``)."""
    if shared_pool_active(index):
        return
    import torch

    backend = torch.cuda.get_allocator_backend() if torch.cuda.is_available() else "no CUDA"
    raise RuntimeError(
        f"--shared-pool: Torch (allocator backend {backend!r}) and JAX do not both allocate from "
        f"device {index}'s default CUDA pool here; common.shared_pool.use_shared_pool() must run "
        f"before torch is imported and before JAX starts its GPU backend (bridge.memory_pool)")
