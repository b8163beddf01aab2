"""Allocator for the temporary unsharded buckets (all-gathered weights, gradient staging): a pool.

A bucket is keyed by (owner label, purpose) while it is live. ``free`` returns its tensor to the
pool, and a later ``allocate`` of the same size, dtype and device (the next unit's bucket: the
blocks of a model have equal layouts) takes it back instead of asking Torch for new memory.
``zero=False`` skips the zero-fill for a bucket that is written whole (an all-gather output);
a bucket that is accumulated into (the grad bucket) asks for ``zero=True``.

When a pooled tensor may be reused -- never while anyone may still read it:

- **References.** A freed bucket is reused only when the pool holds the last reference to its
  memory (``_sole_owner``): a JAX array imported through DLPack holds one (the bridge's export
  keeps the Torch tensor alive until JAX drops the array), and so does every Torch view or
  saved tensor (a tensor Torch's autograd saved, a parameter that still points into the bucket).
  The pool's own JAX share of the tensor is allowed for, as long as nothing else references it
  or its JAX array. A bucket
  with such a holder is left alone (counted in ``held_bytes``) and a new one is made; it is
  reused once the holder lets go. So a bound on ``peak_reserved_bytes`` holds only if every
  holder lets go before the pool is asked again, whatever the timing; FSDP's do: buckets cross
  to JAX only through the pool's share, none is held by an object only the cyclic garbage
  collector frees, and the one holder on another thread, gloo's worker (a finished collective's
  work), is waited for by ``collectives.Handle.wait`` (issue 30, item 13).
- **Streams (CUDA).** ``free`` records an event on the current stream, which at that point is
  ordered after every reader's work: JAX's programs that read the bucket produced results Torch
  imported before the reshard (``to_torch`` waits for the program), and Torch's own kernels are on
  that stream. The next user of the tensor (``allocate`` returns it with ``ready``, the event)
  makes its stream wait for that event before writing -- the communication stream for a gather.

**Adopted buckets.** ``adopt`` makes a tensor the caller hands over (a unit program's gradient
group, a JAX output that only the Torch view references) the live bucket of a key, instead of
allocating one: the grad bucket without a zero-fill, an add and a copy. Its memory is not the
pool's (JAX's allocator owns it), so ``free`` does not pool it: on the CPU it is dropped at once;
on CUDA it is kept, with an event recorded on the current stream, until that event has completed
(checked at each later ``allocate``, ``adopt``, ``free`` and ``trim``), because JAX's allocator
may hand the memory to its next program as soon as the last reference goes, without waiting
for Torch's or the communication stream's readers (the reduce-scatter, the add into
``main_grad``). **At most ``retiring_limit`` such buckets wait at once** (FSDP passes
``Overlap.freed_grad_buckets``, default 2): when a free would leave more, the host waits for the
oldest one's event (``retire_waits`` counts the waits), as FSDP1's all-gather rate limiter
does. Without the bound a host that runs ahead of the GPU (the usual case: it enqueues a unit's
backward in less time than the GPU runs it) checks the events before any has completed and
keeps every adopted bucket of the backward alive until the optimizer's first wait -- at 1.3B
with 4 blocks per unit, six 0.75 GiB buckets of JAX memory. With the bound the host waits for
the reduction of a bucket freed two units earlier; on the H200 at 1.3B it waits about 11 times a
step with the default, and the GPU still has the later units' work queued (the step time is
unchanged, BENCHMARKS.md session 9).

Accounting (bytes): ``live_bytes`` handed out and not freed, ``peak_bytes`` its maximum;
``reserved_bytes`` everything the pool holds (live + idle + held, adopted buckets included until
released), ``peak_reserved_bytes`` its maximum -- the bucket memory a step really needs.
``trim()`` releases idle tensors to Torch.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from bridge.shared import SharedBuffer
from common import trace

__all__ = ["BucketAllocator"]


@dataclasses.dataclass
class _Pooled:
    tensor: torch.Tensor
    ready: torch.cuda.Event | None  # recorded at free (CUDA): writers wait for it
    share: SharedBuffer | None = None  # the tensor's JAX view, kept across owners
    adopted: bool = False  # handed over by the caller (``adopt``): not pooled at free


def _sole_owner(pooled: _Pooled) -> bool:
    """Whether nothing but the pool (and its own share) references a pooled tensor's memory:
    no other holder of its TensorImpl (a DLPack export -- a JAX view made elsewhere -- or a
    tensor autograd saved), no other tensor on its storage (a view), no other reference to the
    pool's share or to the share's JAX array, no other Python reference to the tensor. (While
    a C++ owner besides its Python object holds a tensor, Torch keeps one reference to the
    Python object from C++: that one is not someone else's.)"""
    impl, py = 0, 0  # references the pool's own share holds: TensorImpl (DLPack), Python
    if pooled.share is not None:
        py = 1  # the share's ``tensor``
        if sys.getrefcount(pooled.share) > 2:  # pooled.share, the argument
            return False
        if pooled.share.shared:
            if sys.getrefcount(pooled.share.jax()) > 2:  # the share's, the argument
                return False
            impl = pooled.share.import_refs
    t = pooled.tensor
    preserved = 1 if t._use_count() > 1 else 0  # Torch's own, from C++
    return (
        sys.getrefcount(pooled.tensor) - preserved <= 3 + py  # pooled.tensor, t, the argument
        and t._use_count() == 1 + impl
        and torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2  # t, the temporary
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class BucketAllocator:
    def __init__(self, retiring_limit: int = 2) -> None:
        if isinstance(retiring_limit, bool) or not isinstance(retiring_limit, int) \
                or retiring_limit < 0:
            raise ValueError(f"BucketAllocator: retiring_limit must be an int >= 0 (the freed "
                             f"adopted buckets kept while their readers may run), got "
                             f"{retiring_limit!r}")
        self.retiring_limit = retiring_limit
        self.retire_waits = 0  # host waits for the oldest retiring bucket (module note)
        self._live: dict[tuple[str, str], _Pooled] = {}
        self._idle: dict[tuple, list[_Pooled]] = {}  # (numel, dtype, device) -> freed buckets
        self.live_bytes = 0
        self.peak_bytes = 0
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0
        self.reused = 0  # allocations served from the pool
        self.made = 0  # allocations that asked Torch for new memory
        self.adopted = 0  # buckets handed over by the caller (``adopt``)
        self._retiring: list[_Pooled] = []  # freed adopted buckets (CUDA) awaiting their event

    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> _Pooled | None:
        candidates = self._idle.get((numel, dtype, device), [])
        for i, p in enumerate(candidates):
            if _sole_owner(p):
                return candidates.pop(i)
        return None

    def allocate(
        self,
        owner: str,
        purpose: str,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        zero: bool = True,
    ) -> torch.Tensor:
        """A 1-D bucket (zero-filled when ``zero``); error if (owner, purpose) is already live
        (a leak). A reused bucket on CUDA comes back with the current stream already waiting
        for the event of its free (module note), so any later writer is ordered after its
        previous readers."""
        key = (owner, purpose)
        self._check_free(key)
        pooled = self._take(numel, dtype, device)
        if pooled is None:
            pooled = _Pooled(torch.empty(numel, dtype=dtype, device=device), None)
            self.made += 1
            self.reserved_bytes += _nbytes(pooled.tensor)
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        else:
            self.reused += 1
            if pooled.ready is not None:  # later kernels on this stream run after the readers
                torch.cuda.current_stream(device).wait_event(pooled.ready)
                pooled.ready = None
        if zero:
            pooled.tensor.zero_()
        self._live[key] = pooled
        self.live_bytes += _nbytes(pooled.tensor)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        trace.counter("bucket bytes", live=self.live_bytes, reserved=self.reserved_bytes)
        return pooled.tensor

    def _check_free(self, key: tuple[str, str]) -> None:
        self._retire()
        if key in self._live:
            raise RuntimeError(
                f"BucketAllocator: bucket {key} is still live; free it (reshard) before "
                f"allocating it again"
            )

    def adopt(self, owner: str, purpose: str, tensor: torch.Tensor) -> torch.Tensor:
        """Make ``tensor`` (1-D, contiguous, handed over: nothing else will read or write it)
        the live bucket of (owner, purpose), without a copy (module note); error if that key is
        live or the tensor is not a whole 1-D buffer."""
        key = (owner, purpose)
        self._check_free(key)
        if tensor.dim() != 1 or not tensor.is_contiguous() or tensor.storage_offset() != 0:
            raise ValueError(
                f"BucketAllocator.adopt {key}: expected a whole contiguous 1-D tensor, got "
                f"shape {tuple(tensor.shape)}, strides {tensor.stride()}, offset "
                f"{tensor.storage_offset()}; allocate a bucket and copy into it instead"
            )
        pooled = _Pooled(tensor, None, adopted=True)
        self.adopted += 1
        n = _nbytes(tensor)
        self.reserved_bytes += n
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self._live[key] = pooled
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        trace.counter("bucket bytes", live=self.live_bytes, reserved=self.reserved_bytes)
        return tensor

    def _retire(self) -> None:
        """Drop the freed adopted buckets whose readers are done; wait for the oldest while
        more than ``retiring_limit`` remain (module note)."""
        if not self._retiring:
            return
        keep = []
        for p in self._retiring:
            if p.ready is not None and not p.ready.query():
                keep.append(p)
            else:
                self.reserved_bytes -= _nbytes(p.tensor)
        while len(keep) > self.retiring_limit:
            oldest = keep.pop(0)
            assert oldest.ready is not None  # (only CUDA buckets, with their event, are kept)
            oldest.ready.synchronize()
            self.retire_waits += 1
            self.reserved_bytes -= _nbytes(oldest.tensor)
        self._retiring = keep

    def get(self, owner: str, purpose: str) -> torch.Tensor | None:
        p = self._live.get((owner, purpose))
        return None if p is None else p.tensor

    def rename(self, owner: str, purpose: str, new_purpose: str) -> None:
        """Keep a live bucket under a new key (a grad bucket whose reduction is in flight)."""
        key, new = (owner, purpose), (owner, new_purpose)
        if key not in self._live or new in self._live:
            raise RuntimeError(f"BucketAllocator: cannot rename {key} to {new}: "
                               f"{'not live' if key not in self._live else 'target live'}")
        self._live[new] = self._live.pop(key)

    def free(self, owner: str, purpose: str) -> None:
        """Return the bucket to the pool (a no-op if it is not live)."""
        p = self._live.pop((owner, purpose), None)
        if p is None:
            return
        self.live_bytes -= _nbytes(p.tensor)
        p.ready = self._readers_event(p.tensor)
        if p.adopted:  # not the pool's memory: released once its readers are done
            self._retiring.append(p)
            self._retire()
            trace.counter("bucket bytes", live=self.live_bytes, reserved=self.reserved_bytes)
            return
        key = (p.tensor.numel(), p.tensor.dtype, p.tensor.device)
        self._idle.setdefault(key, []).append(p)
        trace.counter("bucket bytes", live=self.live_bytes, reserved=self.reserved_bytes)

    @staticmethod
    def _readers_event(t: torch.Tensor) -> torch.cuda.Event | None:
        """An event recorded now on the current stream (CUDA), after every reader queued so
        far; None on the CPU, where nothing runs behind the host."""
        if not t.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        return event

    def shared(self, owner: str, purpose: str) -> SharedBuffer:
        """The live bucket's JAX share (``bridge.shared.SharedBuffer``), made on first use and
        kept with the tensor in the pool: the next owner of the tensor reads it through the same
        JAX array, without crossing the bridge again (the ordering argument of a buffer
        rewritten under its share is bridge/shared.py's; the pool reuses a tensor only when the
        share's JAX array is referenced by nothing else, ``_sole_owner``)."""
        p = self._live[(owner, purpose)]
        if p.share is None:
            p.share = SharedBuffer(p.tensor)
        return p.share

    def _idle_entries(self) -> list[_Pooled]:
        return [p for entries in self._idle.values() for p in entries]

    @property
    def held_bytes(self) -> int:
        """Freed buckets that something outside the pool still references (not reusable yet),
        and freed adopted buckets whose readers may still run."""
        self._retire()
        return (sum(_nbytes(p.tensor) for p in self._idle_entries() if not _sole_owner(p))
                + sum(_nbytes(p.tensor) for p in self._retiring))

    def trim(self) -> int:
        """Release the idle tensors nobody else references (and their shares) back to Torch;
        returns the bytes."""
        self._retire()
        released = 0
        for key, entries in list(self._idle.items()):
            keep = [p for p in entries if not _sole_owner(p)]
            released += sum(_nbytes(p.tensor) for p in entries if _sole_owner(p))
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        self.reserved_bytes -= released
        return released

    def reset_peaks(self) -> None:
        """Start measuring peaks afresh (from what is held now)."""
        self.peak_bytes, self.peak_reserved_bytes = self.live_bytes, self.reserved_bytes

    def live_keys(self) -> list[tuple[str, str]]:
        return sorted(self._live)
