"""One compilation per program across the processes of a test session (CI time on a 2-core box).

The ranks of a spawned world run the same code in lockstep, so they ask XLA for the same programs
at the same moment: with only a shared persistent cache (``jax_compilation_cache_dir``) every
rank misses it and compiles each program itself. ``install()`` makes the processes that share a
cache directory take turns per program: a process compiles a program under a file lock named by
its cache key and writes it to the cache; the others wait on that lock and then load the
executable from the cache (milliseconds) instead of compiling it again. What runs is the same
executable either way (the cache holds exactly what XLA compiled for that key).

It wraps two private functions of ``jax._src.compiler`` (``_cache_read``,
``_compile_and_write_cache``); where a JAX version lacks them, ``install()`` changes nothing and
every process compiles for itself, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os


@contextlib.contextmanager
def _key_lock(cache_key: str):
    from jax._src import config

    directory = config.compilation_cache_dir.value
    if not directory or not cache_key:
        yield
        return
    try:
        fd = os.open(os.path.join(directory, f"{cache_key}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:  # not a local folder: compile without taking turns
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        yield
    finally:
        os.close(fd)


def install(compiler=None) -> bool:
    """Wrap JAX's persistent-cache read and compile-and-write (of ``compiler``, by default
    ``jax._src.compiler``) in a per-key file lock, once per process. Returns whether JAX has the
    functions this relies on."""
    if compiler is None:
        from jax._src import compiler

    read = getattr(compiler, "_cache_read", None)
    compile_and_write = getattr(compiler, "_compile_and_write_cache", None)
    if read is None or compile_and_write is None:
        return False
    if getattr(compiler, "_compile_once_installed", False):
        return True  # twice would wait on its own lock

    def locked_read(module_name, cache_key, *args, **kwargs):
        # waits while another process compiles this program, then finds it in the cache
        with _key_lock(cache_key):
            return read(module_name, cache_key, *args, **kwargs)

    def compile_once(backend, computation, executable_devices, compile_options, host_callbacks,
                     module_name, cache_key):
        with _key_lock(cache_key):
            # another process may have compiled it between our miss and taking the lock
            executable, _ = read(module_name, cache_key, compile_options, backend,
                                 executable_devices)
            if executable is not None:
                return executable
            return compile_and_write(backend, computation, executable_devices, compile_options,
                                     host_callbacks, module_name, cache_key)

    compiler._cache_read = locked_read
    compiler._compile_and_write_cache = compile_once
    compiler._compile_once_installed = True
    return True
