"""Compile the MXFP8 linear op's JAX programs ahead of the first step, in parallel.

A cold first training step spends most of its time compiling: each distinct linear shape has a
forward and a backward program (GPT-2 124M: 10 programs, ~13 s of XLA compilation on the H200,
one after another, because the step runs them one after another). ``compile_ahead()`` collects
the programs of a dry forward + backward instead of running them and compiles them concurrently
in worker threads (XLA releases the GIL while it compiles); JAX's jit cache then holds the
executables, so the real step that follows runs without compiling.

While a ``compile_ahead()`` block is active, ``mxfp8_linear`` (both modes) called by the code
inside it does not run its JAX programs: for each call it
- submits the program -- the jitted function, the shapes, dtypes and placements of its arguments
  and its static arguments, i.e. exactly the jit cache key of the real call -- to the pool, once
  per distinct program (layers of equal shape share one), and
- returns **zeros** of the right shapes and dtypes (from ``jax.eval_shape``: traced, not run).

"The code inside it" is the thread (more exactly, the ``contextvars`` context) that opened the
block, and the backward of every linear call made there: the op's forward records the block on
its autograd context (``run_in``), because Torch runs CUDA backward nodes on its own device
threads, which do not share the caller's context. (An activation recompute that runs inside
such a backward runs its forward for real: correct, only not compiled ahead.) Linear calls in any
other thread -- a data loader, an evaluation thread, a second model -- run normally while the
block is active, and each thread may hold a block of its own.

So the results computed inside the block are meaningless and must be thrown away, and so must any
gradient the dry backward produced. ``torch_side.precompile`` does that for a model (dry forward +
backward, then gradients cleared, RNG states restored, FSDP's wire log trimmed); use this module
directly only around code whose results you discard.

Errors: a program that fails to compile is re-raised by ``wait()`` (and on leaving the block)
with the program named. Programs keep their placement: argument shardings (the device each
rank's tensors are on) and the calling thread's ``jax.default_device`` are carried into the
worker, so the worker compiles the very program the real call will look up.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax

__all__ = ["AheadReport", "CompileAhead", "active", "compile_ahead", "run_in", "run_or_compile"]


@dataclasses.dataclass(frozen=True)
class AheadReport:
    """What a ``compile_ahead`` block compiled."""

    programs: int  # distinct programs compiled (equal-shape layers share one)
    calls: int  # op calls intercepted (one per linear forward / backward)
    wall_s: float  # from the first submission until the last compile finished
    compile_s: float  # sum of the programs' own lower + compile times (> wall_s when parallel)
    workers: int


def _default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


class CompileAhead:
    """The program pool of one ``compile_ahead()`` block (see the module docstring)."""

    def __init__(self, max_workers: int | None = None):
        if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 1):
            raise ValueError(
                f"compile_ahead: max_workers must be a positive int or None, got {max_workers!r}"
            )
        self.workers = max_workers or _default_workers()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="mxfp8-compile")
        self._futures: dict[tuple, tuple[str, Future]] = {}
        self._lock = threading.Lock()
        self._calls = 0
        self._t0: float | None = None
        self._report: AheadReport | None = None

    def call(self, fn: Callable[..., Any], *args: Any, **static: Any) -> Any:
        """Submit ``fn(*args, **static)``'s program (once per distinct program); return its
        abstract result (a pytree of ``jax.ShapeDtypeStruct``). ``fn`` must be jitted (have
        ``lower``); ``static`` are its static keyword arguments."""
        if not hasattr(fn, "lower"):
            raise TypeError(f"compile_ahead: {fn!r} is not a jitted function (no .lower)")
        if self._report is not None:
            raise RuntimeError("compile_ahead: this block has ended; open a new compile_ahead()")
        spec = _abstract(args)
        key = (fn, jax.tree.structure(spec), tuple(_leaf_key(a) for a in jax.tree.leaves(spec)),
               tuple(sorted(static.items())))
        device = jax.config.jax_default_device
        with self._lock:
            self._calls += 1
            if self._t0 is None:
                self._t0 = time.perf_counter()
            if key not in self._futures:
                name = getattr(fn, "__qualname__", repr(fn))
                self._futures[key] = (
                    name, self._pool.submit(_compile, fn, spec, static, device)
                )
        return jax.eval_shape(functools.partial(fn, **static), *spec)

    def wait(self) -> AheadReport:
        """Block until every submitted program has compiled; re-raise a failure (named)."""
        if self._report is not None:
            return self._report
        compile_s = 0.0
        try:
            for name, fut in list(self._futures.values()):
                try:
                    compile_s += fut.result()
                except Exception as e:
                    raise RuntimeError(
                        f"compile_ahead: the JAX program {name} failed to compile ahead ({e}); "
                        f"run the step without precompiling to see where it comes from"
                    ) from e
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
        wall = 0.0 if self._t0 is None else time.perf_counter() - self._t0
        self._report = AheadReport(len(self._futures), self._calls, wall, compile_s, self.workers)
        return self._report

    def abandon(self) -> None:
        """Stop: cancel programs not started, wait for running ones, raise nothing (the block
        is being left by an exception of its own)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._report = AheadReport(len(self._futures), self._calls, 0.0, 0.0, self.workers)


def _compile(fn: Any, spec: tuple, static: dict[str, Any], device: jax.Device | None) -> float:
    t0 = time.perf_counter()
    ctx = jax.default_device(device) if device is not None else contextlib.nullcontext()
    with ctx:
        fn.lower(*spec, **static).compile()
    return time.perf_counter() - t0


def _abstract(args):
    """Arguments as ShapeDtypeStructs that give the real call's jit cache key: a committed array
    (e.g. one ``to_jax`` imported) keeps its sharding, an uncommitted one gets none; an abstract
    leaf (an earlier intercepted call's result) gets the sharding of the committed arrays among
    the arguments, if any (jit's results are committed where its inputs were)."""
    leaves = jax.tree.leaves(args)
    committed = next(
        (a.sharding for a in leaves if isinstance(a, jax.Array) and a.committed), None
    )

    def one(a):
        if isinstance(a, jax.Array):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                        sharding=a.sharding if a.committed else None)
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding or committed,
                                        weak_type=a.weak_type)
        return a

    return jax.tree.map(one, args)


def _leaf_key(a):
    if isinstance(a, jax.ShapeDtypeStruct):
        return (a.shape, a.dtype, a.sharding, a.weak_type)
    return a


# The block of this thread / context (module docstring).
_POOL: contextvars.ContextVar[CompileAhead | None] = contextvars.ContextVar(
    "bridge.compile_ahead", default=None
)


def active() -> CompileAhead | None:
    """The block the calling code runs inside, or None (the op runs its programs)."""
    return _POOL.get()


def run_in(ahead: CompileAhead | None, fn: Callable[..., Any], *args: Any, **static: Any) -> Any:
    """``fn(*args, **static)``, or, for a block, its program submitted to that block and its
    abstract result returned (the backward of an op whose forward ran in the block)."""
    if ahead is None:
        return fn(*args, **static)
    return ahead.call(fn, *args, **static)


def run_or_compile(fn: Callable[..., Any], *args: Any, **static: Any) -> Any:
    """``run_in(active(), fn, *args, **static)``: the calling code's block, if any."""
    return run_in(active(), fn, *args, **static)


@contextlib.contextmanager
def compile_ahead(max_workers: int | None = None) -> Iterator[CompileAhead]:
    """Inside the block the MXFP8 linear op compiles instead of running (module docstring).
    Leaving the block waits for every compile (``CompileAhead.wait()``: its report). Only the
    code inside the block (its thread, and the backward it starts) is affected."""
    if active() is not None:
        raise RuntimeError("compile_ahead: blocks do not nest; one is already active")
    ahead = CompileAhead(max_workers)
    token = _POOL.set(ahead)
    try:
        yield ahead
    except BaseException:
        _POOL.reset(token)
        ahead.abandon()
        raise
    _POOL.reset(token)
    ahead.wait()
