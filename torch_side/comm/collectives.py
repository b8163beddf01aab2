"""The only place that calls ``torch.distributed``'s collectives (``tests/test_architecture.py``
holds every other library and application file to it): FSDP's through a :class:`Communicator`,
with a wire log, and the few outside any FSDP model through the functions at the end.

Every FSDP collective -- the gathers, reductions and refreshes of a step, and the wrap-time
broadcast of ``torch_side.fsdp.init_sync`` -- goes through a :class:`Communicator`, which records
what it sent (:class:`WireRecord`: operation, phase, group label, dtype, element count, bytes per
rank) so tests can assert what goes over the wire -- e.g. that a forward all-gather of an MXFP8
group moves 1 byte per element and no scales. torch 2.13 renamed ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` to ``all_gather_single`` / ``reduce_scatter_single``; both spellings are
supported so the same code runs on the GPU machine's torch 2.11.

With ``check=True`` every collective is preceded by the collective-consistency check
(``torch_side.comm.collective_check``): the ranks all-gather a fixed-size descriptor of what they
are about to run and raise ``CollectiveMismatchError``, naming each rank's unit, when they disagree.
Without it, a failing collective (a timeout, a closed connection) gets a note pointing at the
switch.

Asynchronous collectives (``async_op=True``) return a :class:`Handle`; ``wait()`` it before
reading the output, and keep the input unchanged until then. Where they run:

- **CUDA**: on a communication stream of the communicator's own, one per kind (all-gathers and
  reduce-scatters / all-reduces on separate streams, as FSDP2 does, so a gradient reduction never
  queues behind the next unit's gather). The stream first waits for the current stream (the
  input and the output bucket are ready: the shard was written, the pooled bucket's previous
  readers are done), the collective is issued on it, and an event is recorded after it;
  ``wait()`` makes the *current* stream wait for that event (the host does not block), so every
  later kernel -- Torch's, and JAX's, which the bridge orders after Torch's current stream at
  each import (DESIGN.md 6) -- sees the result.
- **CPU (gloo)**: on gloo's own thread; ``wait()`` blocks the host until it completes and
  gloo's thread has let go of the tensors (``_await_release``: the bucket pool reuses a bucket
  only once nothing else references it, so its memory bound rests on this wait).

A synchronous collective runs on the current stream, and so does every collective at world size
1, where it is a copy and a stream hand-off would only cost host time (measured on the H200:
BENCHMARKS.md, "Overlap"); ``Overlap.streams_at_world_1`` sends world-size-1 copies through the
communication streams anyway, so that one GPU tests the stream ordering (test_nccl.py). With a
``common.trace`` recorder active, each collective is recorded from issue to completion on the
track of its stream (GPU times through CUDA events; on the CPU, gloo's completion callback).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias, TypeVar

import torch
import torch.distributed as dist

from common import trace
from torch_side.comm.collective_check import (
    CHECK_ENV,
    DESCRIPTOR_INTS,
    CollectiveMismatchError,
    Descriptor,
    mismatch_message,
)

__all__ = ["Collective", "Communicator", "Handle", "Phase", "WireRecord", "all_gather_objects",
           "all_reduce_on", "barrier", "broadcast_object", "gather_objects"]
T = TypeVar("T")
Group: TypeAlias = "dist.ProcessGroup | None"  # a process group; None: the default one
_What: TypeAlias = "tuple[Collective, Phase, str]"  # which collective: (op, phase, label)

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collective(enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE_SUM = "all_reduce_sum"
    ALL_REDUCE_MAX = "all_reduce_max"
    BROADCAST = "broadcast"


class Phase(enum.Enum):
    """Why a collective ran (the training phase that asked for it)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    GRAD_REDUCE = "grad_reduce"
    OPTIMIZER = "optimizer"
    STATE = "state"


@dataclasses.dataclass(frozen=True)
class WireRecord:
    op: Collective
    phase: Phase
    label: str  # e.g. "blocks.0/mxfp8_e4m3/rowwise"
    dtype: torch.dtype
    numel: int  # elements of the full (gathered / reduced) tensor
    bytes_sent: int  # bytes this rank contributes


WIRE_LOG_LIMIT = 4096  # records kept per communicator (oldest dropped): bounded in long runs

_VERB = {
    Collective.ALL_GATHER: "all-gather",
    Collective.REDUCE_SCATTER: "reduce-scatter",
    Collective.ALL_REDUCE_SUM: "all-reduce (sum)",
    Collective.ALL_REDUCE_MAX: "all-reduce (max)",
    Collective.BROADCAST: "broadcast",
}

# The last communicator's ordinal per process group (the default one by its object: each rank of
# an in-process world has its own); the same on every rank, as building one is collective.
_ORDINALS: dict[object, int] = {}

_STREAM_OF = {  # which communication stream (and trace track) each collective runs on
    Collective.ALL_GATHER: "all-gather",
    Collective.REDUCE_SCATTER: "reduce",
    Collective.ALL_REDUCE_SUM: "reduce",
    Collective.ALL_REDUCE_MAX: "reduce",
    Collective.BROADCAST: "all-gather",  # (synchronous only: the trace track of its kind)
}


# At most this long for gloo's thread to let go of a finished collective (a runnable thread's
# delay measured up to 64 ms on a busy 2-core box). 0.1 s gave issue 30 item 13's failure; 2 s
# ran out once in the whole suite on that box (docs/fsdp.md). The wait ends when they let go.
RELEASE_WAIT_S = 10.0
_FIRST_SLEEP_S, _MAX_SLEEP_S = 1e-5, 1e-3  # the wait sleeps (backing off), never spins


def _counts(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """TensorImpl, storage and Python references of each tensor, now (flattened). (Torch
    drops a C++ holder's last extra reference before the Python one it kept for it, which
    needs the GIL: a wait that looked at the C++ counts only could return in between.)"""
    out: list[int] = []
    for t in tensors:
        out += (t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata),
                sys.getrefcount(t))
    return tuple(out)


def _await_release(tensors: Sequence[torch.Tensor], limit: tuple[int, ...]) -> bool:
    """Wait until every reference count of ``tensors`` is at most ``limit`` (``_counts``);
    whether they got there within ``RELEASE_WAIT_S``.

    gloo completes a collective (``work.wait()`` returns) before its worker thread drops the
    work, which still holds the bucket (the tensor, and views of it); until then the bucket
    looks referenced to the pool (``bucket_allocator._sole_owner``), which then makes a new
    bucket instead of reusing it -- a memory bound that held or not by thread timing. Callers
    wait here, after dropping their own reference to the work, until the counts are down by
    what the work added at issue. The wait sleeps between looks (it leaves the CPU and the GIL
    to that thread) and is bounded by ``RELEASE_WAIT_S``, a safety net that no scheduling delay
    reaches: the pool never reuses a bucket someone holds, so giving up costs memory only, and
    the caller warns (``_release_or_warn``)."""
    deadline, delay = None, _FIRST_SLEEP_S
    while any(c > m for c, m in zip(_counts(tensors), limit, strict=True)):
        now = time.perf_counter()
        deadline = deadline or now + RELEASE_WAIT_S
        if now > deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, _MAX_SLEEP_S)
    return True


def _release_or_warn(tensors: Sequence[torch.Tensor], limit: tuple[int, ...], what: _What) -> None:
    """``_await_release``, and a warning naming the collective when it gave up."""
    if _await_release(tensors, limit):
        return
    op, phase, label = what
    rank = dist.get_rank() if dist.is_initialized() else 0
    warnings.warn(
        f"rank {rank}: gloo still held the tensors of the finished {_VERB[op]} of {label!r} "
        f"({phase.value}) {RELEASE_WAIT_S} s after it completed. FSDP's bucket pool does not "
        f"reuse a bucket something still holds, so this step may take more bucket memory than "
        f"the bound in docs/fsdp.md ('Memory that is known'); results are not affected. A "
        f"thread not scheduled for that long points at an overloaded machine",
        RuntimeWarning, stacklevel=3,
    )


class Handle:
    """An issued asynchronous collective (module note). ``wait()`` is idempotent; a failure of
    the collective surfaces there with the communicator's note. gloo: the wait also lets go of
    the work and returns once gloo's thread has (``_await_release``)."""

    def __init__(self, comm: Communicator, what: _What, work: dist.Work | None = None,
                 event: torch.cuda.Event | None = None,
                 held: tuple[Sequence[torch.Tensor], tuple[int, ...]] = ((), ())):
        self._comm, self._what, self._work, self._event = comm, what, work, event
        self._held = held  # gloo: (tensors, the references its work added to each at issue)
        self.done = False
        self.on_wait: Callable[[], None] | None = None  # called once the wait returns (trace)

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        if self._event is not None:  # CUDA: the current stream waits, the host does not
            torch.cuda.current_stream(self._event.device).wait_event(self._event)
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as e:
                e.add_note(self._comm._failure_note(*self._what, checking=False))
                raise
            tensors, added = self._held
            limit = tuple(c - a for c, a in zip(_counts(tensors), added, strict=True))
            self._work, self._held = None, ((), ())  # (the work lived until here: its references)
            _release_or_warn(tensors, limit, self._what)
        if self.on_wait is not None:
            self.on_wait()


class Communicator:
    """Collectives on one process group; ``records`` is the wire log (the most recent
    ``WIRE_LOG_LIMIT`` collectives; cleared by the caller). ``check``: run the
    collective-consistency check before each collective (module note). The ranks agree on it
    before the first collective (one rank asking turns it on for all), on that collective's
    device, so building a communicator moves nothing; ``streams_at_world_1``: module note."""

    def __init__(self, group: dist.ProcessGroup | None, name: str, check: bool = False,
                 streams_at_world_1: bool = False):
        self.group = group
        self.name = name
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.records: collections.deque[WireRecord] = collections.deque(maxlen=WIRE_LOG_LIMIT)
        self.check = bool(check)
        self.streams_at_world_1 = bool(streams_at_world_1)
        self._agreed = self.world_size == 1
        key = group if group is not None or not dist.is_initialized() else dist.group.WORLD
        self.ordinal = _ORDINALS[key] = _ORDINALS.get(key, -1) + 1
        self.seq = 0  # collectives issued so far (the check compares it across ranks)
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
        self._anchor: tuple[trace.Recorder, torch.cuda.Event, float] | None = None  # GPU clock

    def _agree(self, device: torch.device) -> None:
        """Once, before the first collective: the switch is on if any rank asked for it."""
        flag = torch.tensor([int(self.check)], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.check, self._agreed = bool(flag.item()), True

    def _log(self, op: Collective, phase: Phase, label: str, t: torch.Tensor, sent: int) -> None:
        self.records.append(WireRecord(op, phase, label, t.dtype, t.numel(), sent))

    def _before(self, op: Collective, phase: Phase, label: str, t: torch.Tensor) -> None:
        """Count the collective and, with the check on, compare it across ranks first."""
        seq, self.seq = self.seq, self.seq + 1
        if not self._agreed:
            self._run(op, phase, label, lambda: self._agree(t.device))
        if not self.check or self.world_size == 1:
            return
        mine = Descriptor(
            self.ordinal, seq, _VERB[op], phase.value, label,
            str(t.dtype).removeprefix("torch."), t.numel(),
        ).encode().to(t.device)
        rows = torch.empty(self.world_size * DESCRIPTOR_INTS, dtype=torch.int64, device=t.device)
        self._run(op, phase, label, lambda: _all_gather(rows, mine, group=self.group), True)
        message = mismatch_message(rows.view(self.world_size, -1).cpu(), self.rank, self.name)
        if message is not None:
            raise CollectiveMismatchError(message)

    def _failure_note(self, op: Collective, phase: Phase, label: str, checking: bool) -> str:
        what = f"the FSDP {_VERB[op]} of {label!r} ({phase.value}) on process group {self.name!r}"
        if checking:
            return (
                f"rank {self.rank}: this failed in check_collectives' descriptor all-gather "
                f"before {what}: some rank did not reach another FSDP collective on this group "
                f"(it failed, stalled, or finished while this rank still had collectives to run, "
                f"e.g. a unit that ran on this rank only at the end of the step)."
            )
        head = f"rank {self.rank}: this failed in {what}. "
        if self.check and self._agreed:
            return head + (
                "Every rank was about to run this same collective (check_collectives), so the "
                "failure is not a mismatch of FSDP collectives: look for a rank that died, "
                "stalled or ran a collective of its own on this group."
            )
        return head + (
            "If the ranks issued different collectives (an FSDP unit that ran on some ranks "
            f"only), rerun with check_collectives=True ({CHECK_ENV}=1 for mxfp8-train) to "
            "get an error naming what each rank was about to run."
        )

    def _run(self, op: Collective, phase: Phase, label: str, call: Callable[[], T],
             checking: bool = False) -> T:
        """call(), adding a note that names the collective (and the switch) to its failure."""
        try:
            return call()
        except RuntimeError as e:
            e.add_note(self._failure_note(op, phase, label, checking))
            raise

    def stream(self, kind: str, device: torch.device) -> torch.cuda.Stream:
        """The communication stream of ``kind`` ("all-gather" or "reduce") on ``device``."""
        s = self._streams.get((kind, device))
        if s is None:
            s = self._streams[(kind, device)] = torch.cuda.Stream(device)
        return s

    def _issue(self, op: Collective, phase: Phase, label: str, t: torch.Tensor, call: Callable,
               async_op: bool, tensors: Sequence[torch.Tensor] = ()) -> Handle | None:
        """Run call(async_op) on the right stream (module note); a Handle when async_op.
        tensors: those the collective reads or writes (gloo holds them: ``_await_release``)."""
        kind = _STREAM_OF[op]
        gloo = self.world_size > 1 and not t.is_cuda
        before = _counts(tensors) if gloo else ()
        what = (op, phase, label)
        rec = trace.active()
        args: dict[str, Any] = {} if rec is None else {
            "phase": phase.value, "bytes": t.numel() * t.element_size()}
        if not async_op or (self.world_size == 1 and not (t.is_cuda and self.streams_at_world_1)):
            if rec is None:  # (the hot path: no trace names or arguments built)
                self._run(op, phase, label, lambda: call(False))
            else:
                with trace.span(f"comm: {kind} (sync)", f"{_VERB[op]} {label}", **args):
                    self._run(op, phase, label, lambda: call(False))
            if gloo:  # nothing else ran meanwhile: what is above ``before`` is gloo's
                _release_or_warn(tensors, before, what)
            return Handle(self, what) if async_op else None
        if gloo:  # its own thread; the host blocks at wait()
            pending = None if rec is None else trace.begin(f"comm: {kind} (gloo)",
                                                           f"{_VERB[op]} {label}", **args)
            work = self._run(op, phase, label, lambda: call(True))
            added = tuple(a - b for a, b in zip(_counts(tensors), before, strict=True))
            handle = Handle(self, what, work=work, held=(tensors, added))
            if pending is not None:
                try:  # completion time from gloo's callback where its work has a future
                    work.get_future().add_done_callback(lambda _f: pending.end())
                except RuntimeError:  # (gloo's reduce-scatter has none): seen at wait()
                    handle.on_wait = lambda: pending.end(completion="observed at wait()")
            return handle
        current = torch.cuda.current_stream(t.device)
        stream = self.stream(kind, t.device)
        stream.wait_stream(current)
        timing = self._cuda_timing(rec, stream, f"comm: {kind} stream", f"{_VERB[op]} {label}",
                                   args)
        with torch.cuda.stream(stream):
            self._run(op, phase, label, lambda: call(False))
        event = torch.cuda.Event()
        event.record(stream)
        if timing is not None:
            timing()
        return Handle(self, what, event=event)

    def _cuda_timing(self, rec: trace.Recorder | None, stream: torch.cuda.Stream, track: str,
                     name: str, args: dict) -> Callable[[], None] | None:
        """With a recorder: a start event on ``stream`` now, and a function of the end event
        that records the interval on the trace clock when the trace is read (CUDA events)."""
        if rec is None:
            return None
        if self._anchor is None or self._anchor[0] is not rec:
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(torch.cuda.current_stream(stream.device))
            self._anchor = (rec, anchor, rec.now_us())
        _, anchor, anchor_us = self._anchor
        args = {**args, "issued_us": rec.now_us()}  # the host's issue time (ts: the GPU's)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)

        def finish():
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)

            def resolve():
                end.synchronize()
                rec.complete(track, name, anchor_us + 1000 * anchor.elapsed_time(start),
                             anchor_us + 1000 * anchor.elapsed_time(end), args)

            rec.defer(resolve)

        return finish

    def all_gather(
        self,
        out: torch.Tensor,
        shard: torch.Tensor,
        phase: Phase,
        label: str,
        async_op: bool = False,
    ) -> Handle | None:
        """out (world * n,) <- concatenation of every rank's shard (n,).

        Returns a ``Handle`` when async_op (``.wait()`` before reading out), else None.
        """
        assert out.numel() == shard.numel() * self.world_size, (out.shape, shard.shape)
        op = Collective.ALL_GATHER
        self._before(op, phase, label, out)
        self._log(op, phase, label, out, shard.numel() * shard.element_size())

        def call(async_):
            if self.world_size == 1:
                return out.copy_(shard)
            return _all_gather(out, shard, group=self.group, async_op=async_)

        return self._issue(op, phase, label, out, call, async_op, (out,))

    def reduce_scatter(
        self,
        out: torch.Tensor,
        full: torch.Tensor,
        phase: Phase,
        label: str,
        async_op: bool = False,
    ) -> Handle | None:
        """out (n,) <- sum over ranks of this rank's slice of full (world * n,)."""
        assert full.numel() == out.numel() * self.world_size, (out.shape, full.shape)
        op = Collective.REDUCE_SCATTER
        self._before(op, phase, label, full)
        self._log(op, phase, label, full, full.numel() * full.element_size())

        def call(async_):
            if self.world_size == 1:
                return out.copy_(full)
            return _reduce_scatter(out, full, group=self.group, async_op=async_)

        return self._issue(op, phase, label, full, call, async_op, (full,))

    def all_reduce(
        self, t: torch.Tensor, op: Collective, phase: Phase, label: str, async_op: bool = False
    ) -> Handle | None:
        """In place; op is ALL_REDUCE_SUM or ALL_REDUCE_MAX."""
        self._before(op, phase, label, t)
        self._log(op, phase, label, t, t.numel() * t.element_size())
        red = dist.ReduceOp.SUM if op is Collective.ALL_REDUCE_SUM else dist.ReduceOp.MAX

        def call(async_):
            if self.world_size == 1:
                return None
            return dist.all_reduce(t, op=red, group=self.group, async_op=async_)

        return self._issue(op, phase, label, t, call, async_op, (t,))

    def broadcast(self, t: torch.Tensor, phase: Phase, label: str) -> None:
        """In place, synchronous: every rank's t <- that of rank 0 of this communicator's group
        (the wire log counts its bytes as sent by rank 0)."""
        op = Collective.BROADCAST
        self._before(op, phase, label, t)
        self._log(op, phase, label, t, t.numel() * t.element_size() if self.rank == 0 else 0)

        def call(async_):
            if self.world_size == 1:
                return None
            pg = dist.group.WORLD if self.group is None else self.group
            return dist.broadcast(t, src=dist.get_global_rank(pg, 0), group=pg, async_op=async_)

        self._issue(op, phase, label, t, call, False, (t,))


# ------------------------------------------------------ collectives outside any FSDP model
# Control values, not FSDP's bytes: a checkpoint's agreement and digests (torch_side.
# sharded_files, whose callers pass a process group, not a model), a stand-alone
# distributed_mxfp8_quantize, an application's metrics. On a process group (None: the default
# one), synchronous, on the current stream, in no wire log; a failure gets a note naming the call.


def _on_group(what: str, group: Group, call: Callable[[], T]) -> T:
    try:
        return call()
    except RuntimeError as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        e.add_note(f"rank {rank}: this failed in {what}, a collective on the "
                   f"{'default process group' if group is None else f'process group {group}'}")
        raise


def all_reduce_on(t: torch.Tensor, op: Collective, what: str, group: Group = None) -> None:
    """In place over ``group``; op is ALL_REDUCE_SUM or ALL_REDUCE_MAX."""
    red = dist.ReduceOp.SUM if op is Collective.ALL_REDUCE_SUM else dist.ReduceOp.MAX
    _on_group(what, group, lambda: dist.all_reduce(t, op=red, group=group))


def all_gather_objects(obj: object, what: str, group: Group = None) -> list:
    """Every rank's picklable ``obj`` (between our own ranks only), in group rank order."""
    out: list = [None] * dist.get_world_size(group)
    _on_group(what, group, lambda: dist.all_gather_object(out, obj, group=group))
    return out


def gather_objects(obj: object, what: str, dst: int = 0, group: Group = None) -> list | None:
    """Every rank's picklable ``obj`` on global rank ``dst`` (None on the others)."""
    out: list | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    _on_group(what, group, lambda: dist.gather_object(obj, out, dst=dst, group=group))
    return out


def broadcast_object(obj: T, what: str, src: int = 0, group: Group = None) -> T:
    """Global rank ``src``'s picklable ``obj``, on every rank."""
    box = [obj]
    _on_group(what, group, lambda: dist.broadcast_object_list(box, src=src, group=group))
    return box[0]


def barrier(what: str, group: Group = None) -> None:
    _on_group(what, group, lambda: dist.barrier(group=group))
