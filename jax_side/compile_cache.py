"""JAX's persistent compilation cache in the user's cache directory, so a second launch starts
warm (the first step of a GPT-2 124M run spends most of its time compiling the linear programs).

``enable_compilation_cache(path)`` points JAX at ``path`` (None: no cache) and caches every
program that took at least ``min_compile_s`` to compile. Call it before the first compilation
(the training command and the benchmarks do). The training command takes the directory from
``$MXFP8_JAX_CACHE``, else ``$XDG_CACHE_HOME/mxfp8-fsdp/jax`` (default
``~/.cache/mxfp8-fsdp/jax``); ``MXFP8_JAX_CACHE=off`` disables it (``apps.environment``: the
library reads no environment).

The cache holds executables that every later process loads and runs, so whoever can write to the
directory can run code in those processes: it is created ``0700``, and an existing one that
another user owns, or that its group or others may write to, is refused (``UnsafeCacheDir``,
naming the directory, its owner and mode, and the fix) instead of used.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["ENV_VAR", "UnsafeCacheDir", "check_private", "enable_compilation_cache",
           "prepare_cache_dir"]

ENV_VAR = "MXFP8_JAX_CACHE"  # the training command's name for the directory (messages)


class UnsafeCacheDir(PermissionError):
    """A compilation cache directory that someone else could write executables into."""


def check_private(where: Path) -> None:
    """Refuse ``where`` unless this user owns it and neither its group nor others may write."""
    st = where.stat()
    mode = stat.S_IMODE(st.st_mode)
    problems = []
    if st.st_uid != os.getuid():
        problems.append(f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"its mode {mode:04o} lets its group or others write to it")
    if problems:
        raise UnsafeCacheDir(
            f"the JAX compilation cache {where} is not private: {'; '.join(problems)}. Every "
            f"training process loads and runs the executables cached there, so whoever can "
            f"write to it can run code in them. Use a directory of your own (chmod 700 {where}, "
            f"or {ENV_VAR}=<a private directory>), or run without the cache ({ENV_VAR}=off)")


def prepare_cache_dir(path: str | os.PathLike | None) -> Path | None:
    """The cache directory ``enable_compilation_cache(path)`` would use, created ``0700`` if
    missing and checked (``check_private``), without touching JAX; None when ``path`` is None
    (no cache) or not creatable. A launcher calls it to refuse an unsafe directory before any
    rank starts."""
    if path is None:
        return None
    where = Path(path)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        where.mkdir(mode=0o700, exist_ok=True)  # the mode applies when it is created here
    except OSError:
        return None
    check_private(where)
    return where


def enable_compilation_cache(
    path: str | os.PathLike | None, *, min_compile_s: float = 0.2
) -> Path | None:
    """Turn on JAX's persistent compilation cache at ``path`` (None: leave it off).
    Returns the directory used, or None if disabled or not creatable (a warning is not raised:
    the cache is an optimisation; the caller may report the None). A directory it creates is
    ``0700``; an existing one that is not private raises ``UnsafeCacheDir`` (module note)."""
    where = prepare_cache_dir(path)
    if where is None:
        return None
    import jax  # here, so that checking the directory (prepare_cache_dir) needs no JAX

    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where
