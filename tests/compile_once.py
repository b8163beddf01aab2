"""One compilation per program across the processes of a test session (CI time on a 2-core box).

The ranks of a spawned world run the same code in lockstep, so they ask XLA for the same programs
at the same moment: with only a shared persistent cache (``jax_compilation_cache_dir``) every
rank misses it and compiles each program itself. ``install()`` makes the processes that share a
cache directory take turns per program: a process compiles a program under a file lock named by
its cache key and writes it to the cache; the others wait on that lock and then load the
executable from the cache (milliseconds) instead of compiling it again. What runs is the same
executable either way (the cache holds exactly what XLA compiled for that key).

It wraps two private functions of ``jax._src.compiler`` (``_cache_read``,
``_compile_and_write_cache``), and only where both have exactly the parameters the wrappers were
written for (``EXPECTED``: jax 0.10.x). Where a JAX version lacks them or changed either
signature (jax 0.11 added ``host_callbacks`` to ``_cache_read``), ``install()`` changes nothing
and every process compiles for itself: slower, never wrong.
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import os

# The parameter names of the wrapped functions, in order, as of jax 0.10.x (the versions tested).
EXPECTED = {
    "_cache_read": ("module_name", "cache_key", "compile_options", "backend",
                    "executable_devices"),
    "_compile_and_write_cache": ("backend", "computation", "executable_devices",
                                 "compile_options", "host_callbacks", "module_name", "cache_key"),
}


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


def _parameters(fn) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def compatible(compiler) -> bool:
    """Whether ``compiler`` has both functions with exactly the ``EXPECTED`` parameters."""
    return all(
        callable(getattr(compiler, name, None))
        and _parameters(getattr(compiler, name)) == params
        for name, params in EXPECTED.items()
    )


def install(compiler=None) -> bool:
    """Wrap JAX's persistent-cache read and compile-and-write (of ``compiler``, by default
    ``jax._src.compiler``) in a per-key file lock, once per process. Returns whether it did:
    False, changing nothing, where JAX lacks the functions or their signatures differ from
    ``EXPECTED`` (``compatible``)."""
    if compiler is None:
        from jax._src import compiler

    if getattr(compiler, "_compile_once_installed", False):
        return True  # twice would wait on its own lock
    if not compatible(compiler):
        return False
    read = compiler._cache_read
    compile_and_write = compiler._compile_and_write_cache

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
