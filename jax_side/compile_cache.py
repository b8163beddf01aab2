"""JAX's persistent compilation cache in the user's cache directory, so a second launch starts
warm (the first step of a GPT-2 124M run spends most of its time compiling the linear programs).

``enable_compilation_cache()`` points JAX at ``$MXFP8_JAX_CACHE``, else
``$XDG_CACHE_HOME/mxfp8-fsdp/jax`` (default ``~/.cache/mxfp8-fsdp/jax``), and caches every
program that took at least ``min_compile_s`` to compile. ``MXFP8_JAX_CACHE=off`` disables it.
Call it before the first compilation (the training command and the benchmarks do).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

__all__ = ["ENV_VAR", "default_cache_dir", "enable_compilation_cache"]

ENV_VAR = "MXFP8_JAX_CACHE"


def default_cache_dir() -> Path | None:
    """Where the cache goes (None when ``MXFP8_JAX_CACHE=off``)."""
    env = os.environ.get(ENV_VAR, "")
    if env.lower() == "off":
        return None
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mxfp8-fsdp" / "jax"


def enable_compilation_cache(
    path: str | os.PathLike | None = None, *, min_compile_s: float = 0.2
) -> Path | None:
    """Turn on JAX's persistent compilation cache at ``path`` (default: ``default_cache_dir``).
    Returns the directory used, or None if disabled or not writable (a warning is not raised:
    the cache is an optimisation; the caller may report the None)."""
    where = Path(path) if path is not None else default_cache_dir()
    if where is None:
        return None
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where
