"""``GradReducer``: one group's gradient staging and reduction into its main grad.

Tensors owned:

- the **grad bucket**: a full-size (padded group) staging buffer of this micro-batch's local
  gradients in the policy's grad-comm dtype, from the ``BucketAllocator`` (key
  ``(group label, "grad")``), made on the first staged gradient and freed by ``reduce`` or
  ``drop``. When the first gradients of a micro-batch come already laid out as the bucket (a
  unit program's gradient group, ``stage_flat``), that buffer becomes the bucket
  (``BucketAllocator.adopt``): no zero-fill, no add, no copy between the backward and the
  reduce-scatter. Bytes are unchanged: the bucket held 0 + g before, and x + 0 = x, except that
  a gradient of -0.0 stays -0.0 in the bucket (it was +0.0 in a zero-filled one). A zero's sign
  changes nothing the optimizer computes (AdamW's moments and update, clipping's norm: ±0 give
  the same bytes), and the first reduction after ``zero_grad`` passes the reduced gradient on as
  it is (below), so ``main_grad`` may hold -0.0 where a gradient is -0.0.

``reduce`` averages the bucket over the DP group into the group's ``main_grad`` (owned by
``GroupBuffers``; accumulated into, never replaced): a reduce-scatter into the rank's shard when
the strategy shards gradients (ZeRO-2/3), else an all-reduce of the full buffer. Parameters that
got no gradient this micro-batch leave zeros in the bucket, so every rank joins the collective.

**Zeroing without a pass** (``clear``, what ``zero_grad`` calls): ``main_grad`` is marked as
holding zeros instead of being filled with them. The first reduction after it makes
``main_grad`` the reduced gradient itself, as Torch's ``.grad`` takes the first gradient after
``zero_grad()``: its bytes are the reduced result's (cast to ``main_grad``'s dtype), a -0.0 kept
-- not ``0 + out``, whose -0.0 would read +0.0; a zero's sign changes nothing the optimizer
computes. It copies them in (one read, one write) instead of adding into a zero-filled buffer
(a fill, then two reads and a write); later micro-batches add on top. A reader (``ready``: the
optimizer, clipping, state dicts, any ``ParamGroup.main_grad``) of a group no reduction wrote
since gets the zeros filled in first.

**Releasing the memory** (``clear(release=True)``: ``zero_grad(set_to_none=True)``, Torch's
default): ``main_grad`` gives its storage back (``Tensor.set_`` to an empty one: the tensor object
stays, so every holder keeps it) and gets a fresh one where it is next written or read -- the
first reduction after it or a reader, which gets zeros. That first reduction, where the
reduce-scatter wrote a tensor of its own in ``main_grad``'s dtype (``reduce``'s ``out``:
ZeRO-2/3, with a comm dtype equal to the main grads', or the cast a narrower one makes anyway),
**hands that tensor's storage to** ``main_grad`` (``Tensor.set_``): no copy, no kernel, and no
second shard-sized buffer at once. (The pass it replaces, ``0 + out`` into a new storage, took
2.7 ms of the 1.3B step's GPU time in 14 calls, BENCHMARKS.md session 11.) An all-reduce's
result (the bucket itself, which the allocator reuses) is copied. From ``zero_grad`` to the
first reduction of the next backward the main grads hold no memory, as Torch's ``.grad`` after
``set_to_none``. That matters where one memory pool serves Torch and JAX (``common.shared_pool``,
the shared pool): the unit programs' residuals, which peak at the start of the backward, and the
main grads, which fill up during it, then share the same bytes. A stale reference taken before
the release (``t = group.main_grad``) keeps the old storage alive and its old values, never
dangling memory. ``released`` says whether it is given back now.

**Asynchronous reduction** (``reduce(async_op=True)``, FSDP's default): the collective is issued
and the bucket moves to the key ``(group label, "grad_reducing")``, held until ``settle`` waits
for it and adds the result into ``main_grad``. ``settle`` runs where the result is read: the
next ``reduce`` of this group (a later micro-batch), every read of ``ParamGroup.main_grad`` (the
optimizer, clipping, state dicts, ``zero_grad``), an abort; and the model's ``Schedule``
(``torch_side.fsdp.overlap``) settles the oldest reduction when more than
``Overlap.reductions_in_flight`` are in flight, which bounds the gradient buckets alive at
once. Until then the bucket is not written (``stage`` makes a new one).

**HSDP** (``replicate``, ``torch_side.fsdp.hybrid_mesh``): the reduced result is all-reduced
over the replicate group (in the comm dtype, synchronously, where the result is added) before it
is added into ``main_grad``; ``grad_divisor`` is then the whole DP size, replicas included.

Gradients are divided by the dense DP size (``grad_divisor``) for every group, expert groups
included (they reduce over the smaller expert-DP group): each rank's loss is its own mean, so the
gradient of the mean loss over all DP ranks is sum(local grads) / DP (Megatron's expert gradient
scaling is 1 / data-parallel size for the same reason).
"""

from __future__ import annotations

import torch

from torch_side.comm.collectives import Collective, Communicator, Handle, Phase
from torch_side.fsdp.bucket_allocator import BucketAllocator
from torch_side.fsdp.flat_layout import FlatLayout

__all__ = ["GradReducer"]

GRAD_PURPOSE = "grad"  # the allocator key's purpose of a group's grad bucket
REDUCING_PURPOSE = "grad_reducing"  # ... and of the bucket of a reduction in flight


class GradReducer:
    def __init__(
        self,
        label: str,
        layout: FlatLayout,
        main_grad: torch.Tensor,
        comm_dtype: torch.dtype,
        grads_sharded: bool,
        grad_divisor: int,
        comm: Communicator,
        allocator: BucketAllocator,
        replicate: Communicator | None = None,
    ):
        self.label, self.layout, self.main_grad = label, layout, main_grad
        self.replicate = replicate
        self.comm_dtype, self.grads_sharded, self.grad_divisor = (
            comm_dtype, grads_sharded, grad_divisor
        )
        self.comm, self.allocator = comm, allocator
        # (Handle, reduced output) of the reduction in flight
        self._inflight: tuple[Handle, torch.Tensor] | None = None
        self._zeros_pending = False  # main_grad means zeros not written yet (``clear``)
        self._numel = main_grad.numel()  # what a released main_grad is given back (``_acquire``)

    @property
    def released(self) -> bool:
        """Whether ``main_grad`` has given its storage back (``clear(release=True)``) and no
        write or read has taken a new one since."""
        return self.main_grad.numel() != self._numel

    @property
    def holds_zeros(self) -> bool:
        """Whether ``main_grad`` means zeros (``clear``) that nothing has written over since."""
        return self._zeros_pending and self._inflight is None

    def _acquire(self) -> None:
        """Give a released ``main_grad`` a new storage (unwritten: callers write all of it)."""
        if self.released:
            g = self.main_grad
            g.set_(torch.empty(self._numel, dtype=g.dtype, device=g.device))

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous reduction is issued and not settled yet."""
        return self._inflight is not None

    @property
    def staged(self) -> bool:
        """Whether gradients of this micro-batch are staged and not reduced yet."""
        return self.allocator.get(self.label, GRAD_PURPOSE) is not None

    def _bucket(self) -> torch.Tensor:
        """This micro-batch's grad bucket; made (zeroed) on first use."""
        bucket = self.allocator.get(self.label, GRAD_PURPOSE)
        if bucket is None:
            bucket = self.allocator.allocate(
                self.label, GRAD_PURPOSE, self.layout.padded_numel, self.comm_dtype,
                self.main_grad.device, zero=True,  # accumulated into; absent grads stay zero
            )
        return bucket

    def stage(self, index: int, grad: torch.Tensor) -> None:
        """Add one parameter's local gradient into this micro-batch's grad bucket."""
        bucket = self._bucket()
        s = self.layout.slots[index]
        bucket[s.start : s.end].add_(grad.detach().reshape(-1).to(bucket.dtype))

    def stage_flat(self, flat: torch.Tensor) -> None:
        """Stage gradients already laid out as the bucket (``padded_numel`` elements of the comm
        dtype on ``main_grad``'s device, zeros where nothing is staged: a unit program's
        ``GradGroup``), handed over: the bucket of this micro-batch if none is staged yet
        (adopted, module note), else added into it in one add."""
        want = (self.layout.padded_numel,)
        if (tuple(flat.shape) != want or flat.dtype != self.comm_dtype
                or flat.device != self.main_grad.device):
            raise ValueError(
                f"GradReducer {self.label!r}: a flat gradient buffer must match the grad bucket "
                f"({want}, {self.comm_dtype}, {self.main_grad.device}); got "
                f"({tuple(flat.shape)}, {flat.dtype}, {flat.device})"
            )
        if self.allocator.get(self.label, GRAD_PURPOSE) is None:
            self.allocator.adopt(self.label, GRAD_PURPOSE, flat)
        else:
            self._bucket().add_(flat)

    def reduce(self, async_op: bool = False) -> None:
        """Average the staged gradients over the DP group into ``main_grad`` (accumulating)
        and free the bucket (module note); with ``async_op`` the add happens at ``settle``."""
        self.settle()  # an earlier micro-batch's reduction adds into main_grad first
        bucket = self._bucket()
        if self.grad_divisor != 1:  # x / 1 == x exactly: one pass over the bucket less
            bucket.div_(self.grad_divisor)
        label = f"{self.label}/grad"
        if self.grads_sharded:
            out = torch.empty(self.layout.shard_numel, dtype=bucket.dtype, device=bucket.device)
            handle = self.comm.reduce_scatter(out, bucket, Phase.GRAD_REDUCE, label, async_op)
        else:
            handle = self.comm.all_reduce(
                bucket, Collective.ALL_REDUCE_SUM, Phase.GRAD_REDUCE, label, async_op
            )
            out = bucket
        if handle is None:
            self._finish(out, GRAD_PURPOSE)
            return
        self.allocator.rename(self.label, GRAD_PURPOSE, REDUCING_PURPOSE)
        self._inflight = (handle, out)

    def _finish(self, out: torch.Tensor, purpose: str) -> None:
        if self.replicate is not None:  # HSDP: the shard group's result summed over replicas
            self.replicate.all_reduce(out, Collective.ALL_REDUCE_SUM, Phase.GRAD_REDUCE,
                                      f"{self.label}/grad/replicas")
        g = self.main_grad
        result = out.to(g.dtype)  # cast first: a cast inside the add writes other NaN bits
        if not self._zeros_pending:
            g.add_(result)
        elif self.released and result is not self.allocator.get(self.label, purpose) \
                and result.is_contiguous() and result.numel() == self._numel:
            g.set_(result)  # the reduced gradient becomes main_grad (module note)
        else:  # the reduced gradient's bytes, written without reading main_grad
            self._acquire()
            g.copy_(result)
        self._zeros_pending = False
        self.allocator.free(self.label, purpose)

    def clear(self, release: bool = False) -> None:
        """Zero ``main_grad`` (lazily: module note), a reduction in flight settled first; with
        ``release`` its storage is given back until it is next written or read."""
        self.settle()
        self._zeros_pending = True
        if release and not self.released:
            g = self.main_grad
            g.set_(torch.empty(0, dtype=g.dtype, device=g.device))

    def ready(self) -> torch.Tensor:
        """``main_grad`` as a reader must see it: the reduction in flight added, pending zeros
        written."""
        self.settle()
        if self._zeros_pending:
            self._acquire()
            self.main_grad.zero_()
            self._zeros_pending = False
        return self.main_grad

    def settle(self) -> None:
        """Wait for the reduction in flight (if any) and add its result into ``main_grad``."""
        if self._inflight is None:
            return
        (handle, out), self._inflight = self._inflight, None
        handle.wait()
        self._finish(out, REDUCING_PURPOSE)

    def drop(self) -> None:
        """Free the grad bucket without reducing it (an aborted backward); a reduction already
        issued is settled (every rank issued it)."""
        self.settle()
        self.allocator.free(self.label, GRAD_PURPOSE)
