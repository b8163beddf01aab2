"""One GPU memory pool for Torch and JAX: the device's default CUDA pool (``cudaMallocAsync``).

By default each framework keeps its own cache of GPU memory: Torch's caching allocator and XLA's
BFC allocator. Neither gives memory to the other, so a process needs the sum of both peaks even
when they happen at different times -- in a training step JAX's peak is the unit programs'
residuals at the start of the backward, while Torch's memory grows during the backward (the main
grads, which ``zero_grad()`` releases: ``torch_side.fsdp.grad_reducer``). ``use_shared_pool()``
makes both allocate from the same pool instead, the CUDA driver's default pool of the device,
through its stream-ordered allocator:

- Torch: ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` (its ``CudaMallocAsyncAllocator``);
- JAX: ``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async`` (XLA's ``GpuCudaMallocAsyncAllocator``).

**When to call it.** No API sets either choice: Torch reads its variable when ``torch`` is
imported (the allocator backend is picked as its CUDA library loads), JAX when it creates its GPU
backend. So call it before the process imports Torch -- or in a launcher before it starts the
processes that do the work (``bench_train_step --shared-pool`` and ``mxfp8-train --shared-pool``
call it before their ranks start; the ranks inherit the environment) -- or set the two variables
in the shell. ``bridge.memory_pool.shared_pool_active()`` checks, where the work runs, that both
frameworks really allocate from the pool.

Memory freed by one framework is then reused by the other; the driver orders the reuse after the
free (a free on one stream and an allocation on another: it waits for the free's stream, or takes
memory whose free has completed). Cross-framework lifetimes are unchanged: a buffer freed while
the other framework still reads it was unsafe before too (the bridge's events guard those).

This module imports neither framework (``common``'s rule).
"""

from __future__ import annotations

import os
import sys

__all__ = ["SHARED_POOL_ENV", "use_shared_pool"]

SHARED_POOL_ENV = {
    "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async",
    "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync",
}


def _conf_backend(conf: str) -> str | None:
    """The ``backend`` entry of a ``PYTORCH_CUDA_ALLOC_CONF`` value (``key:value`` pairs joined
    by commas), or None."""
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "backend":
            return value.strip()
    return None


def use_shared_pool() -> None:
    """Ask Torch and JAX to allocate GPU memory from the device's default CUDA pool, for this
    process if it has not imported Torch yet and for the processes it starts (module note).

    Raises RuntimeError when this process has already started CUDA through Torch, and ValueError
    when the environment already asks for another allocator (naming the variable); nothing is
    set then. Other ``PYTORCH_CUDA_ALLOC_CONF`` entries are kept."""
    torch = sys.modules.get("torch")  # never imported here: importing it fixes its allocator
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(
            "use_shared_pool: Torch has already started CUDA in this process, so its allocator "
            "is chosen; call use_shared_pool() before importing torch (or in the launcher, "
            "before the ranks start), or set "
            + " ".join(f"{k}={v}" for k, v in SHARED_POOL_ENV.items()) + " in the shell"
        )
    xla = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR")
    if xla not in (None, "", SHARED_POOL_ENV["XLA_PYTHON_CLIENT_ALLOCATOR"]):
        raise ValueError(
            f"use_shared_pool: XLA_PYTHON_CLIENT_ALLOCATOR={xla!r} asks JAX for another "
            f"allocator; the shared pool needs 'cuda_async': unset it or set it to that"
        )
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    backend = _conf_backend(conf)
    if backend not in (None, "cudaMallocAsync"):
        raise ValueError(
            f"use_shared_pool: PYTORCH_CUDA_ALLOC_CONF={conf!r} asks Torch for the {backend!r} "
            f"allocator backend; the shared pool needs 'backend:cudaMallocAsync': remove the "
            f"backend entry or set it to that"
        )
    # Torch and JAX read them when they start, and no API sets them (module note).
    os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = SHARED_POOL_ENV["XLA_PYTHON_CLIENT_ALLOCATOR"]
    if backend is None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
            x for x in (SHARED_POOL_ENV["PYTORCH_CUDA_ALLOC_CONF"], conf) if x
        )
