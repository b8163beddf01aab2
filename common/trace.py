"""A per-step timeline of FSDP's collectives, bucket memory and unit programs (Chrome trace JSON).

Framework-free: everything is recorded as host times (``time.perf_counter_ns``) unless the
caller hands in a completion time of its own (a collective completing on a communication thread,
or on a GPU stream resolved through CUDA events by the caller). Nothing is recorded unless a
``Recorder`` is active (``recording``), and the inactive checks cost one global lookup, so the
hooks stay in the hot path.

Tracks (Chrome "threads") name where the work ran -- the host thread that issued it, a
communication stream, JAX's compute stream:

- ``span(track, name, **args)``: a complete event around a block of host work (a unit's
  forward, a program dispatch);
- ``begin(track, name, **args)`` -> ``Pending``; ``Pending.end(ts_us=None)``: an interval that
  ends later or elsewhere (an async all-gather from issue to completion);
- ``counter(name, **values)``: a counter sample (bucket bytes live / reserved).

``Recorder.write(path)`` writes ``{"traceEvents": [...]}``, which chrome://tracing and
ui.perfetto.dev open; ``events()`` gives the same list for tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

__all__ = ["Pending", "Recorder", "active", "begin", "counter", "recording", "span"]

_active: Recorder | None = None


def active() -> Recorder | None:
    return _active


class Recorder:
    """The events of one process (``pid``: its rank), times in microseconds from creation."""

    def __init__(self, pid: int = 0, label: str = "mxfp8-fsdp"):
        self.pid, self.label = pid, label
        self._t0 = time.perf_counter_ns()
        self._events: list[dict] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()  # completion callbacks run on communication threads
        # callables that record an event once its times are known
        self._deferred: list[Callable[[], None]] = []

    def now_us(self) -> float:
        return (time.perf_counter_ns() - self._t0) / 1000.0

    def _tid(self, track: str) -> int:
        with self._lock:
            tid = self._tracks.get(track)
            if tid is None:
                tid = self._tracks[track] = len(self._tracks) + 1
            return tid

    def add(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)

    def complete(
        self, track: str, name: str, start_us: float, end_us: float, args: dict
    ) -> None:
        self.add({"ph": "X", "name": name, "cat": track, "pid": self.pid, "tid": self._tid(track),
                  "ts": start_us, "dur": max(end_us - start_us, 0.0), "args": args})

    def defer(self, resolve: Callable[[], None]) -> None:
        """``resolve()`` records an event whose times are known only later (GPU times through
        CUDA events); run when the events are read."""
        with self._lock:
            self._deferred.append(resolve)

    def events(self) -> list[dict]:
        """The recorded events plus the track-name metadata, sorted by time."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        for resolve in deferred:
            resolve()
        with self._lock:
            evs = sorted(self._events, key=lambda e: e["ts"])
            names = [{"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid,
                      "ts": 0, "args": {"name": track}} for track, tid in self._tracks.items()]
        proc = {"ph": "M", "name": "process_name", "pid": self.pid, "ts": 0,
                "args": {"name": f"{self.label} rank {self.pid}"}}
        return [proc, *names, *evs]

    def write(self, path: str | os.PathLike) -> None:
        """Chrome trace JSON (written to a temporary file, then renamed into place)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Make ``recorder`` the active one inside the ``with`` (the previous one after)."""
    global _active
    if not isinstance(recorder, Recorder):
        raise TypeError(f"trace.recording: expected a Recorder, got {recorder!r}")
    before, _active = _active, recorder
    try:
        yield recorder
    finally:
        _active = before


class Pending:
    """An interval begun now and ended later (``end``), possibly on another thread."""

    __slots__ = ("_args", "_name", "_rec", "_start", "_track")

    def __init__(self, rec: Recorder, track: str, name: str, args: dict):
        self._rec, self._track, self._name, self._args = rec, track, name, args
        self._start = rec.now_us()

    def end(self, ts_us: float | None = None, **more: Any) -> None:
        end = self._rec.now_us() if ts_us is None else ts_us
        self._rec.complete(self._track, self._name, self._start, end, {**self._args, **more})


def begin(track: str, name: str, **args: Any) -> Pending | None:
    """An interval that ends later (None when nothing records)."""
    rec = _active
    return None if rec is None else Pending(rec, track, name, args)


class _Span:
    __slots__ = ("_pending",)

    def __init__(self, pending: Pending):
        self._pending = pending

    def __enter__(self) -> _Span:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self._pending.end()
        return False


_NULL = contextlib.nullcontext()


def span(track: str, name: str, **args: Any) -> contextlib.AbstractContextManager[Any]:
    """A context manager recording the block as one complete event (a no-op when inactive)."""
    rec = _active
    return _NULL if rec is None else _Span(Pending(rec, track, name, args))


def counter(name: str, **values: float) -> None:
    rec = _active
    if rec is not None:
        rec.add({"ph": "C", "name": name, "pid": rec.pid, "ts": rec.now_us(), "args": values})
