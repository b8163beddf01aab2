"""In-process worlds: ``run_world(world_size, fn, *args)`` runs ``fn(ctx, *args)`` on
``world_size`` threads of this process, rank r of one process group each, so a multi-rank test
is a plain pytest function (no spawned process, no JAX import per rank: milliseconds of setup).

The process group is PyTorch's threaded one (``backend="threaded"``), the one FSDP2's own
``MultiThreadedTestCase`` runs on: every thread sees its own default group (``dist.get_rank()``,
``dist.new_group``, ``dist.all_gather_object`` ... are per thread), and a collective completes
when every rank of its group has joined, rank 0's thread doing the copies and the reduction
(in rank order: the sums are exact functions of the ranks' inputs). It lives in a private torch
module, so this file is the only user, through the entry points that test case uses
(``_install_threaded_pg`` / ``_uninstall_threaded_pg``, ``ProcessLocalGroup.reset`` /
``exception_handle``, and c10d's thread isolation mode: group names registered per thread),
run here on torch 2.13 and on the GPU machine's 2.11; where a torch lacks one, the worlds skip
naming it (``_NEEDED``). Torch 2.11's ``destroy_process_group`` reads ``_world.comms``, which
that version's threaded world lacks (2.13 has it): ``_comms_shim`` gives it an empty list for
the time of a world (the threaded group makes no torchcomms communicators).

- ``ctx`` is the ``WorkerContext`` the spawned worlds give (``tests/torch_side/multiprocess.py``),
  device "cpu"; JAX runs with ``jax_numpy_dtype_promotion`` strict, as in every test.
- Torch runs one intra-op thread during a world, as a spawned CPU rank does
  (``torch_side.launch.bootstrap_rank``); the previous count is restored after.
- A rank that raises fails the test with that rank's traceback, the rank named; the other
  ranks are released from the collective they wait in (they stop there) and the test ends.
- A rank waiting in one collective for ``stall_s`` seconds fails the world, naming the ranks
  that never joined (they stalled, or finished early) with where each one is.
- Process-wide state is shared by the ranks: Torch's default random generator
  (``toy_models.seeded`` serializes seeding and module construction), the JAX compilation cache
  (each program compiles once for all ranks), ``common.trace``'s recorder, and the warnings
  filters (``warnings.catch_warnings`` saves and restores them for the whole process: a rank
  cannot use it; ``RankWarnings`` records each rank's warnings instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg as _threaded

from tests.torch_side.multiprocess import WorkerContext

__all__ = ["MAX_WORLD", "RankFailed", "RankWarnings", "WorldStalled", "run_ranks", "run_world"]

MAX_WORLD = 8  # threads of one process (tiny models: HSDP meshes of 2 x 4 and 4 x 2 fit)
STALL_S = 60.0  # a rank waiting this long in one collective fails the world
_POLL_S = 0.05

_ONE_WORLD = threading.Lock()  # the threaded group's collectives are process-wide: one world
_LEFT: list[threading.Thread] = []  # ranks of failed worlds that never stopped


class RankFailed(AssertionError):
    """A rank of an in-process world raised; the rank's exception is the cause."""


class WorldStalled(AssertionError):
    """A rank waited ``stall_s`` seconds in a collective that some ranks never joined."""


@dataclasses.dataclass
class _Rank:
    thread: threading.Thread | None = None
    error: BaseException | None = None
    failed_at: float = 0.0
    done: bool = False


def _secondary(e: BaseException) -> bool:
    """Raised in a rank released from a collective after another rank failed."""
    return isinstance(e, SystemExit) and "termination" in str(e)


def _rank_main(ranks: list[_Rank], rank: int, store: dist.Store, stall_s: float,
               fn: Callable[..., Any], args: tuple) -> None:
    me = ranks[rank]
    try:
        dist.init_process_group("threaded", rank=rank, world_size=len(ranks), store=store,
                                timeout=datetime.timedelta(seconds=stall_s))
        try:
            fn(WorkerContext(rank, len(ranks), "cpu"), *args)
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 -- reported by run_world, the rank named
        me.error, me.failed_at = e, time.monotonic()
        _threaded.ProcessLocalGroup.exception_handle(e)  # release the ranks that wait
    finally:
        me.done = True


def _waiting_in(frame) -> object | None:
    """The threaded group's collective this thread waits in, if it does."""
    while frame is not None:
        if frame.f_code is _threaded.Collective.join.__code__:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def _where(frame) -> str:
    return "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "  (finished)\n"


def _stall(ranks: list[_Rank], seen: weakref.WeakKeyDictionary, stall_s: float) -> str | None:
    """A description of the stall, once a collective has been in flight for ``stall_s``. (The
    threads' frames are read only then: a frame object made for a running function keeps its
    locals -- the collective's tensors -- alive past its return, which the release wait of
    ``torch_side.comm.collectives`` would see as held.)"""
    now = time.monotonic()
    inflight = list(_threaded.ProcessLocalGroup._cur_coll_on_pgs.values())
    if not any(now - seen.setdefault(c, now) >= stall_s for c in inflight):
        return None
    frames = sys._current_frames()
    waiting, others = [], []
    for r, rk in enumerate(ranks):
        frame = None if rk.done else frames.get(rk.thread.ident)
        (waiting if _waiting_in(frame) is not None else others).append((r, frame))
    where = "".join(f"rank {r}:\n{_where(f)}" for r, f in others or waiting)
    return (f"ranks {[r for r, _ in waiting]} of {len(ranks)} waited {stall_s:g} s in a "
            f"collective that ranks {[r for r, _ in others]} did not join (stalled, or "
            f"finished early):\n{where}")


# The private entry points this file uses, checked before a world starts: torch versions that
# lack one make every in-process world test skip, naming what is missing (never a hang or an
# obscure error). Checked present in torch 2.13 and 2.11 (the GPU machine's).
_NEEDED = {
    "torch._C._distributed_c10d._set_thread_isolation_mode":
        lambda: torch._C._distributed_c10d._set_thread_isolation_mode,
    "multi_threaded_pg._install_threaded_pg": lambda: _threaded._install_threaded_pg,
    "multi_threaded_pg._uninstall_threaded_pg": lambda: _threaded._uninstall_threaded_pg,
    "multi_threaded_pg.ProcessLocalGroup.reset / exception_handle / _cur_coll_on_pgs":
        lambda: (_threaded.ProcessLocalGroup.reset, _threaded.ProcessLocalGroup.exception_handle,
                 _threaded.ProcessLocalGroup._cur_coll_on_pgs),
    "multi_threaded_pg.Collective.join": lambda: _threaded.Collective.join,
}


def missing_entry_points() -> list[str]:
    """The private torch names of ``_NEEDED`` this torch lacks (empty: in-process worlds run)."""
    missing = []
    for name, get in _NEEDED.items():
        try:
            get()
        except AttributeError:
            missing.append(name)
    return missing


@contextlib.contextmanager
def _comms_shim() -> Iterator[None]:
    """``ThreadLocalWorld.comms`` (an empty list) for a torch whose threaded world lacks it."""
    if hasattr(_threaded.ThreadLocalWorld, "comms"):
        yield
        return
    _threaded.ThreadLocalWorld.comms = property(lambda self: [])
    try:
        yield
    finally:
        del _threaded.ThreadLocalWorld.comms


def _isolate_threads(on: bool) -> None:
    """Process-group names registered per thread (each rank's default group is "0")."""
    torch._C._distributed_c10d._set_thread_isolation_mode(on)


def run_world(world_size: int, fn: Callable[..., Any], *args: Any,
              stall_s: float = STALL_S) -> None:
    """Run ``fn(WorkerContext(rank, world_size, "cpu"), *args)`` on ``world_size`` threads, one
    rank of a threaded process group each; return when every rank has returned. Raises
    ``RankFailed`` (from the first rank's exception) or ``WorldStalled`` (module note)."""
    assert 1 <= world_size <= MAX_WORLD, f"in-process worlds have 1..{MAX_WORLD} ranks"
    if missing := missing_entry_points():
        import pytest

        pytest.skip(f"in-process worlds need torch's threaded process group; torch "
                    f"{torch.__version__} lacks {missing}")
    left = [t.name for t in _LEFT if t.is_alive()]
    assert not left, f"ranks of an earlier in-process world never stopped: {left}"
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as in tests/conftest.py
    threads = torch.get_num_threads()
    with _ONE_WORLD, torch.autograd.set_multithreading_enabled(False), _comms_shim():
        _threaded.ProcessLocalGroup.reset()
        _isolate_threads(True)
        _threaded._install_threaded_pg()
        torch.set_num_threads(1)
        try:
            ranks = [_Rank() for _ in range(world_size)]
            store = dist.HashStore()
            for r, rk in enumerate(ranks):
                rk.thread = threading.Thread(
                    target=_rank_main, args=(ranks, r, store, stall_s, fn, args),
                    name=f"rank {r}/{world_size}", daemon=True)
                rk.thread.start()
            stalled = _watch(ranks, stall_s)
        finally:
            torch.set_num_threads(threads)
            _threaded._uninstall_threaded_pg()
            _isolate_threads(False)
            _threaded.ProcessLocalGroup.reset()
    _report(ranks, stalled, stall_s)


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = ()) -> list[Any]:
    """``torch_side.launch.run_local_ranks``' contract in threads: ``[fn(*args) on rank r]``,
    ``fn`` run on each rank of an in-process world (``run_world``) instead of a spawned
    process (for a rank function that needs no process of its own: no signal handlers, no
    per-process environment)."""
    results: list[Any] = [None] * world_size

    def rank_main(ctx: WorkerContext, *a: Any) -> None:
        results[ctx.rank] = fn(*a)

    run_world(world_size, rank_main, *args)
    return results


def _watch(ranks: list[_Rank], stall_s: float) -> str | None:
    """Wait for the ranks; a stall's description, if one stopped the world."""
    seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    stalled = None
    while not all(rk.done for rk in ranks):
        if stalled is None and any(rk.error is not None for rk in ranks):
            break
        stalled = _stall(ranks, seen, stall_s)
        if stalled is not None:
            _threaded.ProcessLocalGroup.exception_handle(WorldStalled(stalled))
            break
        time.sleep(_POLL_S)
    deadline = time.monotonic() + stall_s  # a failure released the waiting ranks; the others
    for rk in ranks:  # stop at their next collective
        rk.thread.join(max(0.0, deadline - time.monotonic()))
    _LEFT.extend(rk.thread for rk in ranks if not rk.done)
    return stalled


def _report(ranks: list[_Rank], stalled: str | None, stall_s: float) -> None:
    n = len(ranks)
    alive = [r for r, rk in enumerate(ranks) if not rk.done]
    note = (f" Ranks {alive} were still running {stall_s:g} s later (left running: later "
            f"in-process worlds of this process refuse to start)." if alive else "")
    failed = sorted((rk.failed_at, r) for r, rk in enumerate(ranks)
                    if rk.error is not None and not _secondary(rk.error))
    if failed:
        _, first = failed[0]
        error = ranks[first].error
        also = ", ".join(f"rank {r}: {type(ranks[r].error).__name__}" for _, r in failed[1:])
        raise RankFailed(
            f"rank {first}/{n} failed: {type(error).__name__}: {error}"
            + (f" (also {also})" if also else "") + note
        ) from error
    if stalled is not None:
        raise WorldStalled(stalled + note)
    if alive:
        raise WorldStalled(f"ranks {alive} of {n} did not finish.{note}")


class RankWarnings:
    """The warnings raised in ``record()``'s block, per thread (a rank: its thread's name,
    ``"rank r/n"``): ``mine()`` in a rank, ``by_thread`` after the world."""

    def __init__(self) -> None:
        self.by_thread: dict[str, list[warnings.WarningMessage]] = {}

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        name = threading.current_thread().name
        self.by_thread.setdefault(name, []).append(
            warnings.WarningMessage(message, category, filename, lineno, file, line))

    def mine(self) -> list[warnings.WarningMessage]:
        """The calling thread's warnings so far (a copy)."""
        return list(self.by_thread.get(threading.current_thread().name, []))

    @contextlib.contextmanager
    def record(self) -> Iterator[RankWarnings]:
        """Run the worlds in this block (from the test's thread): every warning is recorded
        (filter "always": the registry that shows a repeated warning once is per module, shared
        by the ranks), none is raised or printed -- the test asserts on what was recorded."""
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = self._show
            yield self
