"""Zero-copy DLPack conversion between Torch tensors and JAX arrays (DESIGN.md 6): ``to_jax``,
``to_torch`` and the rules that come with every buffer they share.

Ownership note (the rules every caller of this module relies on)
------------------------------------------------------------------
Names: the *Torch buffer* is the storage behind a ``torch.Tensor``; the *JAX view* is the
``jax.Array`` that ``to_jax`` returns over it (same data pointer). Likewise ``to_torch`` returns a
*Torch view* over a *JAX buffer*.

1. Zero-copy or refuse. ``to_jax`` / ``to_torch`` return an object with the same data pointer
   as the input, or raise ``ZeroCopyError`` naming the tensor (shape, dtype, strides, offset,
   device) and the fix. ``copy=True`` is the one explicit way to accept a copy; it always copies
   (the result never aliases the input).
2. Lifetime. The DLPack capsule holds a reference to the producer's buffer, so a JAX view keeps
   its Torch buffer allocated while the JAX view is alive (and vice versa). This does *not* cover
   asynchronous reads: JAX dispatches work asynchronously (on CPU too), so the Torch buffer must
   not be **overwritten or freed** until every JAX computation that reads it is done. A
   computation is done for Torch once one of its results has been brought back with ``to_torch``
   (which orders Torch's current stream after it, see 3) or after ``jax.block_until_ready`` on a
   result. Until then keep a Torch reference to the buffer and do not write to it.
   ``mxfp8_linear`` follows this rule: it converts its JAX results with ``to_torch`` before it
   drops its JAX views of Torch inputs.
3. CUDA ordering (producer before consumer) goes through the DLPack ``stream`` argument:
   ``to_jax`` lets ``jax.dlpack.from_dlpack`` pass JAX's stream to ``torch.Tensor.__dlpack__``,
   which makes that stream wait on an event recorded on Torch's current stream *of the tensor's
   device* (the bridge enters ``torch.cuda.device(t.device)``, so "current" means that device).
   ``to_torch`` passes Torch's current stream of the array's device to ``jax.Array.__dlpack__``,
   which makes it wait until the JAX buffer is ready. The result lives on the same device index
   as the input in both directions. (The CUDA fast path of ``to_jax``, ``bridge.jax_fastpath``,
   takes the same steps with a cached event and stream.)
4. Mutation. JAX arrays are immutable by contract. Writing through a Torch view of a JAX buffer,
   or into a Torch buffer while a JAX view of it is alive and in use, is undefined behaviour for
   JAX. Buffers that Torch writes (FSDP buckets) are created by Torch and lent to JAX, not the
   reverse -- with one exception: a JAX result that nothing on the JAX side references any more,
   handed over whole (a unit program's gradient group, which FSDP adopts as its grad bucket and
   divides in place: ``BucketAllocator.adopt``). JAX never reads it again; since JAX's allocator
   may reuse its memory as soon as the Torch view is gone, without waiting for Torch's streams,
   the allocator keeps the view until the work queued on it has run.
5. GPU memory. JAX must not preallocate most of the GPU in a process where Torch allocates too:
   ``start_jax_backend`` (``bridge.devices``), through which the bridge starts JAX before its
   first transfer, sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the caller set it (it only
   takes effect if JAX's GPU backend has not started yet: a process that runs JAX before the
   bridge calls ``start_jax_backend`` first, or sets the variable, as the launchers do).

Where the work is done: ``bridge.torch_to_jax`` and ``bridge.jax_to_torch`` (checks and transfer;
the CUDA fast path of ``to_jax``, through JAX internals, in ``bridge.jax_fastpath``),
``bridge.dtypes`` (the dtype table, ``ZeroCopyError``), ``bridge.capabilities`` (alignment, the
native or uint8 transport of 1-byte floats: ``dlpack_support()``), ``bridge.devices`` (starting
JAX, device twins, current streams) and ``bridge.crossings`` (``count_crossings()``).
"""

from __future__ import annotations

import jax
import torch

from bridge.capabilities import Fp8Transport
from bridge.crossings import Direction, counted
from bridge.jax_to_torch import export_array
from bridge.torch_to_jax import import_tensor

__all__ = ["to_jax", "to_torch"]


def to_jax(
    t: torch.Tensor, *, copy: bool = False, transport: Fp8Transport | str | None = None
) -> jax.Array:
    """A ``jax.Array`` over the same memory as ``t`` (same data pointer), on t's device.

    Any shape; dtypes from the bridge's table (float32, bfloat16, float16, uint8, int8, int32, bool,
    float8_e4m3fn, float8_e5m2, float8_e8m0fnu; float64/int64 with jax_enable_x64). Refuses
    (``ZeroCopyError``) non-contiguous, misaligned or grad-requiring tensors unless ``copy=True``.
    ``transport`` forces how 1-byte floats travel (default: ``dlpack_support()``). Read the
    ownership note at the top of this module before overwriting or freeing ``t``.
    """
    return counted(Direction.TO_JAX, import_tensor, t, copy, transport)


def to_torch(
    a: jax.Array, *, copy: bool = False, transport: Fp8Transport | str | None = None
) -> torch.Tensor:
    """A ``torch.Tensor`` over the same memory as the single-device array ``a``.

    Same dtype table as ``to_jax``. The tensor is contiguous, on a's device, and Torch's current
    stream waits for ``a`` to be ready. ``copy=True`` returns a Torch-owned copy instead.
    """
    return counted(Direction.TO_TORCH, export_array, a, copy, transport)
