"""The environment variables of the library's switches, read here and nowhere else.

The library (``common``, ``jax_side``, ``bridge``, ``torch_side``) takes every switch as an
argument or a dataclass field; the applications fill those from the environment with the
functions below, so the documented variables keep working from the command line
(``tests/test_architecture.py`` keeps the library free of environment reads):

- ``MXFP8_BACKEND``, ``MXFP8_GEMM``: the ``None`` fields of a ``KernelConfig`` (``kernels``);
- ``MXFP8_FSDP_CHECK_COLLECTIVES=1``: ``fully_shard(..., check_collectives=True)``
  (``check_collectives``; docs/fsdp.md, "Checking that ranks issue the same collectives");
- ``MXFP8_FSDP_COMM_STREAMS=1``: ``Overlap(streams_at_world_1=True)`` (``comm_streams``);
- ``MXFP8_JAX_CACHE`` (``off``, or a directory; default ``$XDG_CACHE_HOME/mxfp8-fsdp/jax``,
  ``~/.cache/mxfp8-fsdp/jax``): the JAX compilation cache (``jax_cache_dir``).
"""

from __future__ import annotations

import os
from pathlib import Path

from common.kernels import Backend, GemmImpl, KernelConfig

__all__ = [
    "BACKEND",
    "CHECK_COLLECTIVES",
    "COMM_STREAMS",
    "GEMM",
    "JAX_CACHE",
    "check_collectives",
    "comm_streams",
    "jax_cache_dir",
    "kernels",
]

BACKEND = "MXFP8_BACKEND"
GEMM = "MXFP8_GEMM"
CHECK_COLLECTIVES = "MXFP8_FSDP_CHECK_COLLECTIVES"
COMM_STREAMS = "MXFP8_FSDP_COMM_STREAMS"
JAX_CACHE = "MXFP8_JAX_CACHE"


def _switch(name: str, what: str) -> bool:
    value = os.environ.get(name, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{name}={value!r}: expected 1 ({what}) or 0 / unset (off)")


def kernels(config: KernelConfig | None) -> KernelConfig | None:
    """``config`` with its ``None`` fields filled from ``MXFP8_BACKEND`` / ``MXFP8_GEMM`` (None
    when neither the config nor the environment names anything). ``MXFP8_GEMM`` does not apply
    where the backend is ``te`` (it runs its own GEMM)."""
    config = KernelConfig() if config is None else config
    backend = config.backend
    if backend is None and os.environ.get(BACKEND, ""):
        backend = Backend.parse(os.environ[BACKEND])
    gemm = config.gemm
    if gemm is None and os.environ.get(GEMM, "") and backend is not Backend.TE:
        gemm = GemmImpl.parse(os.environ[GEMM])
    filled = KernelConfig(backend, gemm)
    return None if filled == KernelConfig() else filled


def check_collectives() -> bool:
    """``MXFP8_FSDP_CHECK_COLLECTIVES``: whether to check that every rank issues the same FSDP
    collectives (``fully_shard(..., check_collectives=...)``)."""
    return _switch(CHECK_COLLECTIVES, "check that every rank issues the same FSDP collectives")


def comm_streams() -> bool:
    """``MXFP8_FSDP_COMM_STREAMS``: whether world-size-1 collectives run on the communication
    streams too (``Overlap(streams_at_world_1=...)``)."""
    return _switch(COMM_STREAMS, "send world-size-1 copies through the communication streams")


def jax_cache_dir() -> Path | None:
    """``MXFP8_JAX_CACHE``: the JAX compilation cache directory (None for ``off``)."""
    value = os.environ.get(JAX_CACHE, "")
    if value.lower() == "off":
        return None
    if value:
        return Path(value)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mxfp8-fsdp" / "jax"
