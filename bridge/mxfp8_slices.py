"""Distributed-quantization numerics for Torch callers: JAX slice kernels on Torch tensors.

``torch_side.distributed_mxfp8_quantize`` owns the recipe's communication (DESIGN.md 5); the
numerics of its steps 1, 3 and 4 run here, in JAX, on a zero-copy view of the Torch buffer that
holds the main-weight slices (DESIGN.md 2: ``torch_side`` reaches JAX numerics only through
``bridge``):

- :func:`packed_partial_amax`: step 1, the partial block amax of ``bf16(main)`` of every parameter,
  both planes, packed into one fp32 1-D Torch tensor (the buffer the caller all-reduces with MAX);
- :func:`scales_and_cast`: steps 3-4, the full E8M0 scales from the reduced amax and the cast of
  the owned elements, returned as views of ONE packed uint8 Torch tensor.

Crossings: the buffer holding every slice (``SharedBuffer``, e.g. an FSDP group's main shard)
crosses once for both steps, the packed amax once each way, and all the bytes come back in one
array: a fixed handful per group, whatever the number of parameters. Each slice is a ``Piece``
(static: shape, flat start in the parameter, offset in the buffer, length).

Batches (``batched_partial_amax`` / ``batched_scales_and_cast_images``): several buffers, each
with its own pieces (e.g. every MXFP8 group of an FSDP model on one communicator), in ONE program
per step: each buffer still crosses once, the packed amax of the batch is the concatenation of
the buffers' packed amax (buffer order), and the bytes of every buffer come back in one array
(one per ``runs`` of buffers past 2**31 bytes: the in-place kernels index with int32 offsets).
Each buffer's part is the single-buffer program traced inside the batch's, so its bytes are
identical to the single-buffer path.

Packed amax layout: ``[row_0 (M0*K0/32), col_0 (M0*K0/32), row_1, col_1, ...]``, each plane's amax
in its scale tensor's row-major order (rowwise (M, K/32), columnwise (M/32, K)). Packed bytes
layout: ``[row bytes_0 (n_0), col bytes_0 (n_0), row bytes_1, ...]`` then, per parameter, its
rowwise then columnwise scales (the packed amax's layout).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.typing import DTypeLike

from bridge.dlpack import to_jax, to_torch
from bridge.dtypes import jax_dtype_for
from bridge.linear import resolve_for
from bridge.shared import SharedBuffer
from common.formats import BLOCK_SIZE, Plane, scale_shape
from common.kernels import Backend, KernelConfig
from jax_side.mxfp8 import (
    cast_slice,
    cast_slice_into,
    partial_block_amax,
    quantize_slice_into,
    scales_from_amax,
)
from jax_side.mxfp8.pallas_tiles import MAX_FLAT_INDEX
from jax_side.unit_grads import written_buffer

__all__ = [
    "Piece",
    "ScaleLayout",
    "GroupImages",
    "SliceBytes",
    "amax_numel",
    "batched_partial_amax",
    "batched_quantize_images",
    "batched_scales_and_cast_images",
    "packed_partial_amax",
    "runs",
    "scales_and_cast",
    "scales_and_cast_images",
    "slice_backend",
]


class Piece(NamedTuple):
    """One parameter's slice inside a shared buffer (all static)."""

    shape: tuple[int, int]  # the parameter's (M, K)
    start: int  # first element, in the parameter's flat row-major order
    offset: int  # where the slice sits in the buffer
    numel: int  # 0: this rank owns none of the parameter (it still gets the scales)


class SliceBytes(NamedTuple):
    """One parameter's bytes (uint8 views of the packed result)."""

    rowwise: torch.Tensor  # (n,) e4m3 bytes of the owned flat slice, rowwise scaling
    colwise: torch.Tensor  # (n,) e4m3 bytes of the owned flat slice, columnwise scaling
    rowwise_scale: torch.Tensor  # (M, K/32) E8M0 bytes
    colwise_scale: torch.Tensor  # (M/32, K) E8M0 bytes


@functools.partial(jax.jit, static_argnames=("pieces", "backend", "source"))
def _packed_partial_amax(buf, pieces, backend, source):
    parts = []
    for p in pieces:
        m, k = p.shape
        if p.numel == 0:
            parts.append(jnp.zeros((2 * m * k // BLOCK_SIZE,), jnp.float32))
            continue
        amax = partial_block_amax(buf, (m, k), p.start, backend=backend, offset=p.offset,
                                  numel=p.numel, read_as=source)
        parts += [amax.rowwise.reshape(-1), amax.colwise.reshape(-1)]
    return jnp.concatenate(parts)


@functools.partial(jax.jit, static_argnames=("pieces", "backend", "source"))
def _scales_and_cast(buf, packed_amax, pieces, backend, source):
    scale_bytes = lax.bitcast_convert_type(
        scales_from_amax(packed_amax, backend=backend), jnp.uint8
    )
    data, offset = [], 0
    for p in pieces:
        m, k = p.shape
        n_scale = m * k // BLOCK_SIZE
        if p.numel:
            row_s = scale_bytes[offset:offset + n_scale].reshape(m, k // BLOCK_SIZE)
            col_s = scale_bytes[offset + n_scale:offset + 2 * n_scale].reshape(m // BLOCK_SIZE, k)
            scales = {Plane.ROWWISE: row_s, Plane.COLWISE: col_s}
            cast = cast_slice(buf, (m, k), p.start, scales=scales, backend=backend,
                              offset=p.offset, numel=p.numel, read_as=source)
            data += [lax.bitcast_convert_type(cast.rowwise, jnp.uint8),
                     lax.bitcast_convert_type(cast.colwise, jnp.uint8)]
        offset += 2 * n_scale
    return jnp.concatenate([*data, scale_bytes])


class ScaleLayout(NamedTuple):
    """Where each parameter's scales sit in a flat scale buffer (one per plane; static)."""

    offsets: tuple[int, ...]  # parameter i's scales start here
    total: int  # the buffer's length


def _images_into(out: jax.Array, base: int, buf: jax.Array, packed_amax: jax.Array | None,
                 pieces: tuple[Piece, ...], backend: Backend | None, source: DTypeLike,
                 scales: ScaleLayout) -> tuple[jax.Array, jax.Array]:
    """``out`` (uint8) with one buffer's four images written at ``base`` (rowwise shard image,
    columnwise, rowwise scale buffer, columnwise: ``_scales_and_cast_images``' layout), each
    piece's scales by one in-place ``dynamic_update_slice`` and its bytes by ``cast_slice_into``
    (the ``pallas`` kernel writes a piece of whole rows straight into ``out``; otherwise two more
    in-place updates): no concatenation (a 1.3B model's refresh spent 13 ms in concatenations
    on one H200); and the packed amax. With ``packed_amax`` None (``batched_quantize_images``),
    each piece's amax and bytes from one read of it (``_codes_and_amax_into``)."""
    one_pass = packed_amax is None
    if one_pass:  # the codes and the amax first; the scales below, from that amax
        out, packed_amax = _codes_and_amax_into(out, base, buf, pieces, backend, source, scales)
    scale_bytes = lax.bitcast_convert_type(
        scales_from_amax(packed_amax, backend=backend), jnp.uint8
    )
    at_col, at_row_s, at_col_s = _image_starts(base, buf.shape[0], scales)
    offset = 0
    for p, at in zip(pieces, scales.offsets, strict=True):
        m, k = p.shape
        n_scale = m * k // BLOCK_SIZE
        rs = scale_bytes[offset:offset + n_scale]
        cs = scale_bytes[offset + n_scale:offset + 2 * n_scale]
        out = lax.dynamic_update_slice(out, rs, (at_row_s + at,))
        out = lax.dynamic_update_slice(out, cs, (at_col_s + at,))
        if p.numel and not one_pass:  # written into out where it goes (in place: pallas)
            planes = {Plane.ROWWISE: rs.reshape(m, k // BLOCK_SIZE),
                      Plane.COLWISE: cs.reshape(m // BLOCK_SIZE, k)}
            out = cast_slice_into(out, (base + p.offset, at_col + p.offset), buf, (m, k),
                                  p.start, scales=planes, backend=backend, offset=p.offset,
                                  numel=p.numel, read_as=source)
        offset += 2 * n_scale
    return out, packed_amax


def _codes_and_amax_into(out: jax.Array, base: int, buf: jax.Array, pieces: tuple[Piece, ...],
                         backend: Backend | None, source: DTypeLike,
                         scales: ScaleLayout) -> tuple[jax.Array, jax.Array]:
    """``out`` with each piece's codes at the scales of its own amax, and the buffer's packed
    amax, from one read of each piece (``quantize_slice_into``); a piece this rank owns none of
    has a zero amax, as the packed partial amax has it."""
    at_col = _image_starts(base, buf.shape[0], scales)[0]
    parts = []
    for p in pieces:
        m, k = p.shape
        amax = jnp.zeros((2 * m * k // BLOCK_SIZE,), jnp.float32)
        if p.numel:
            out, a = quantize_slice_into(out, (base + p.offset, at_col + p.offset), buf, (m, k),
                                         p.start, backend=backend, offset=p.offset,
                                         numel=p.numel, read_as=source)
            amax = jnp.concatenate([b.reshape(-1) for b in a if b is not None])  # row, col
        parts.append(amax)
    return out, jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)


def _images_numel(n: int, scales: ScaleLayout) -> int:
    """Bytes of one buffer's images: its two shard images (``n`` each) and two scale buffers."""
    return 2 * n + 2 * scales.total


def _image_starts(base: int, n: int, scales: ScaleLayout) -> tuple[int, int, int]:
    """Where one buffer's columnwise shard image, rowwise and columnwise scale buffers start in
    the images array (its rowwise shard image starts at ``base``; ``n``: the buffer's length)."""
    return base + n, base + 2 * n, base + 2 * n + scales.total


def _images_spans(base: int, n: int, pieces: tuple[Piece, ...],
                  scales: ScaleLayout) -> list[tuple[int, int]]:
    """The (start, length) byte ranges ``_images_into`` writes of one buffer's images at
    ``base``: each piece's two scale ranges, and its rowwise and columnwise bytes where it owns
    any; the rest (padding, other ranks' parts, scale alignment) must be zero."""
    at_col, at_row_s, at_col_s = _image_starts(base, n, scales)
    spans = []
    for p, at in zip(pieces, scales.offsets, strict=True):
        n_scale = p.shape[0] * p.shape[1] // BLOCK_SIZE
        spans += [(at_row_s + at, n_scale), (at_col_s + at, n_scale)]
        if p.numel:
            spans += [(base + p.offset, p.numel), (at_col + p.offset, p.numel)]
    return spans


def _new_images(numel: int, spans: list[tuple[int, int]], gapped: bool) -> jax.Array:
    """The uint8 array the images are written into: zeros behind an optimization barrier (XLA
    would otherwise fold zeros + the first update into one pad of the whole array, several times
    slower than a fill and in-place updates: CPU, 21.6 MB of images, 800 against 98 ms;
    ``tests/bridge/test_mxfp8_slices.py`` reads the HLO), or with ``gapped`` only the gaps
    between the ``spans`` zeroed where the cuBLASLt handlers run (``unit_grads.written_buffer``;
    the ``fp8_blocked`` GEMMs' library, so ``gapped`` is asked only where they are in use:
    ``_images_kernels``). Every span is written by ``_images_into``; a 1.3B step's refresh
    filled about 2.4 GB of images first (about 1 ms on the H200)."""
    if gapped:
        return written_buffer(numel, jnp.uint8, spans)
    return lax.optimization_barrier(jnp.zeros((numel,), jnp.uint8))


def _images_kernels(kernels: KernelConfig | None, device: torch.device) -> tuple[Backend, bool]:
    """(``slice_backend``, gapped) of the images' program, from one resolve: the images start
    with only their gaps zeroed on a CUDA device whose GEMM is an ``fp8_blocked`` one (whose
    cuBLASLt library holds the gaps handler; other modes do not build it for the refresh's
    sake)."""
    from jax_side.mxfp8.blocked_operands import BLOCKED_GEMMS

    resolved = resolve_for(kernels, device)
    return resolved.slices, device.type == "cuda" and resolved.gemm in BLOCKED_GEMMS


@functools.partial(jax.jit, static_argnames=("pieces", "backend", "source", "scales", "gapped"))
def _scales_and_cast_images(buf: jax.Array, packed_amax: jax.Array, pieces: tuple[Piece, ...],
                            backend: Backend | None, source: DTypeLike,
                            scales: ScaleLayout, gapped: bool = False) -> jax.Array:
    """``_scales_and_cast`` with its bytes laid out as the caller's buffers are: the rowwise and
    columnwise shard images (each ``len(buf)`` bytes, piece i at ``pieces[i].offset``, zeros
    between pieces), then the rowwise and columnwise scale buffers (``scales``)."""
    n = buf.shape[0]
    out = _new_images(_images_numel(n, scales), _images_spans(0, n, pieces, scales), gapped)
    return _images_into(out, 0, buf, packed_amax, pieces, backend, source, scales)[0]


class GroupImages(NamedTuple):
    """One buffer's bytes laid out as the caller's buffers are (uint8, 1-D views)."""

    rowwise: torch.Tensor  # like the buffer: piece i at pieces[i].offset, zeros between pieces
    colwise: torch.Tensor
    rowwise_scale: torch.Tensor  # like the scale buffer (ScaleLayout)
    colwise_scale: torch.Tensor


def amax_numel(pieces: Sequence[Piece]) -> int:
    """Length of the packed amax of ``pieces`` (both planes: M*K/32 each)."""
    return sum(2 * p.shape[0] * p.shape[1] // BLOCK_SIZE for p in pieces)


@functools.partial(jax.jit, static_argnames=("pieces", "backend", "source"))
def _batched_partial_amax(bufs, pieces, backend, source):
    return jnp.concatenate([_packed_partial_amax(b, p, backend, source)
                            for b, p in zip(bufs, pieces, strict=True)])


RUN_LIMIT = MAX_FLAT_INDEX  # bytes of images per array of a batch (``runs``)


def runs(sizes: Sequence[int], limit: int = MAX_FLAT_INDEX) -> list[list[int]]:
    """The batch's buffers (indices, in order) in runs whose images share one array: each run's
    total below ``limit`` (the kernels write an array with int32 offsets), so a model's refresh
    returns one array, or a few at billions of parameters; a buffer too large alone is a run of
    its own (its pieces are then written by XLA's updates)."""
    out: list[list[int]] = []
    total = limit
    for i, n in enumerate(sizes):
        if total + n >= limit:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


@functools.partial(jax.jit,
                   static_argnames=("pieces", "backend", "source", "scales", "limit", "gapped"))
def _batched_scales_and_cast_images(bufs, packed_amax, pieces, backend, source, scales,
                                    limit=MAX_FLAT_INDEX, gapped=False):
    """Each buffer's ``_scales_and_cast_images`` bytes, one after another in uint8 arrays, one
    per run of buffers (``runs`` below ``limit``; written in place, ``_images_into``); with
    ``packed_amax`` None, also the batch's packed amax, made in the same pass
    (``batched_quantize_images``)."""
    sizes = [_images_numel(b.shape[0], s) for b, s in zip(bufs, scales, strict=True)]
    starts = [0]
    for p in pieces:  # each buffer's packed amax
        starts.append(starts[-1] + amax_numel(p))
    arrays, made = [], []
    for run in runs(sizes, limit):
        spans, base = [], 0
        for i in run:
            spans += _images_spans(base, bufs[i].shape[0], pieces[i], scales[i])
            base += sizes[i]
        out, base = _new_images(base, spans, gapped), 0
        for i in run:
            amax = None if packed_amax is None else lax.slice(
                packed_amax, (starts[i],), (starts[i + 1],))
            out, amax = _images_into(out, base, bufs[i], amax, pieces[i], backend, source,
                                     scales[i])
            made.append(amax)
            base += sizes[i]
        arrays.append(out)
    return tuple(arrays), None if packed_amax is not None else jnp.concatenate(made)


def _static_pieces(pieces: Iterable[Iterable[Piece]]) -> tuple[tuple[Piece, ...], ...]:
    return tuple(tuple(Piece(*p) for p in ps) for ps in pieces)


def batched_partial_amax(
    bufs: Sequence[SharedBuffer],
    pieces: Sequence[Sequence[Piece]],
    device: torch.device,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``packed_partial_amax`` of several buffers (``pieces[j]``: buffer j's pieces) in one
    program: the concatenation of their packed amax, in buffer order (module note), a Torch-owned
    copy on ``device`` ready for ONE ``all_reduce(MAX)``."""
    packed = _batched_partial_amax(
        tuple(b.jax() for b in bufs), _static_pieces(pieces), slice_backend(kernels, device),
        jax_dtype_for(source_dtype),
    )
    t = to_torch(packed, copy=True)
    return t if t.device == device else t.to(device)


def batched_scales_and_cast_images(
    bufs: Sequence[SharedBuffer],
    packed_amax: torch.Tensor,
    pieces: Sequence[Sequence[Piece]],
    scales: Sequence[ScaleLayout],
    device: torch.device,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> list[GroupImages]:
    """``scales_and_cast_images`` of several buffers in one program, from the batch's reduced
    packed amax (``batched_partial_amax``'s layout): per buffer its four images, views of
    Torch tensors over JAX's result, one per run of buffers (``runs``: one crossing each way for
    the whole batch below 2**31 bytes of images)."""
    return _batched_images(bufs, to_jax(packed_amax.contiguous()), pieces, scales, device,
                           kernels, source_dtype)[0]


def batched_quantize_images(
    bufs: Sequence[SharedBuffer],
    pieces: Sequence[Sequence[Piece]],
    scales: Sequence[ScaleLayout],
    device: torch.device,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[GroupImages], torch.Tensor]:
    """``batched_partial_amax`` and ``batched_scales_and_cast_images`` of that amax, unreduced,
    in one program reading each piece once where it can (``quantize_slice_into``): for a batch
    whose amax no reduction over the ranks would change (one rank, or every block whole in one
    rank's pieces: the caller knows). The images and the packed amax (a view of JAX's result)."""
    images, amax = _batched_images(bufs, None, pieces, scales, device, kernels, source_dtype)
    assert amax is not None
    return images, amax


def _batched_images(bufs: Sequence[SharedBuffer], packed_amax: jax.Array | None,
                    pieces: Sequence[Sequence[Piece]], scales: Sequence[ScaleLayout],
                    device: torch.device, kernels: KernelConfig | None,
                    source_dtype: torch.dtype) -> tuple[list[GroupImages], torch.Tensor | None]:
    layouts = tuple(ScaleLayout(tuple(s.offsets), int(s.total)) for s in scales)
    backend, gapped = _images_kernels(kernels, device)
    arrays, amax = _batched_scales_and_cast_images(
        tuple(b.jax() for b in bufs), packed_amax, _static_pieces(pieces),
        backend, jax_dtype_for(source_dtype), layouts, limit=RUN_LIMIT, gapped=gapped,
    )
    sizes = [_images_numel(b.tensor.numel(), s) for b, s in zip(bufs, layouts, strict=True)]
    out = []
    for run, array in zip(runs(sizes, RUN_LIMIT), arrays, strict=True):
        packed, at = to_torch(array), 0
        if packed.device != device:
            packed = packed.to(device)
        for i in run:
            n, t = bufs[i].tensor.numel(), layouts[i].total
            cuts = (at, at + n, at + 2 * n, at + 2 * n + t, at + 2 * n + 2 * t)
            spans = zip(cuts[:-1], cuts[1:], strict=True)
            out.append(GroupImages(*(packed[lo:hi] for lo, hi in spans)))
            at = cuts[-1]
    amax_t = None if amax is None else to_torch(amax)
    return out, amax_t if amax_t is None or amax_t.device == device else amax_t.to(device)


def scales_and_cast_images(
    buf: SharedBuffer,
    packed_amax: torch.Tensor,
    pieces: Sequence[Piece],
    scales: ScaleLayout,
    device: torch.device,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 3-4 as ``scales_and_cast``, returned as four uint8 images of the caller's buffers:
    (rowwise shard, columnwise shard, rowwise scale buffer, columnwise scale buffer), views of
    one packed Torch tensor over JAX's result (the caller copies each with one ``copy_``)."""
    backend, gapped = _images_kernels(kernels, device)
    packed = to_torch(_scales_and_cast_images(
        buf.jax(), to_jax(packed_amax.contiguous()), tuple(Piece(*p) for p in pieces), backend,
        jax_dtype_for(source_dtype), ScaleLayout(tuple(scales.offsets), int(scales.total)),
        gapped=gapped,
    ))
    if packed.device != device:
        packed = packed.to(device)
    n, t = buf.tensor.numel(), int(scales.total)
    return packed[:n], packed[n:2 * n], packed[2 * n:2 * n + t], packed[2 * n + t:]


def slice_backend(kernels: KernelConfig | None, device: torch.device) -> Backend:
    """The backend whose slice kernels run for ``kernels`` on ``device``: what the resolver names
    (``ResolvedKernels.slices``; ``te``, whole tensors only, hands slices to ``xla``)."""
    return resolve_for(kernels, device).slices


def packed_partial_amax(
    buf: SharedBuffer,
    pieces: Sequence[Piece],
    device: torch.device,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Step 1: fp32 1-D packed partial amax of source_dtype(slices) (layout in the module note).

    buf: the fp32 buffer holding every piece's slice. Returned on ``device`` (a Torch-owned copy:
    the caller all-reduces it in place), ready for ``all_reduce(MAX)``. kernels: whose slice
    kernels run (``slice_backend``); source_dtype: what the fp32 slices are rounded to before
    quantizing (bf16: DESIGN.md 3).
    """
    packed = _packed_partial_amax(
        buf.jax(), tuple(Piece(*p) for p in pieces), slice_backend(kernels, device),
        jax_dtype_for(source_dtype),
    )
    t = to_torch(packed, copy=True)
    return t if t.device == device else t.to(device)


def scales_and_cast(
    buf: SharedBuffer,
    packed_amax: torch.Tensor,
    pieces: Sequence[Piece],
    device: torch.device,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> list[SliceBytes]:
    """Steps 3-4: full E8M0 scales from the reduced packed amax, cast of the owned elements.

    Returns per piece its bytes (1-D of the slice's length, empty when it owns nothing) and its
    full scales: views of one packed Torch tensor over JAX's result (zero-copy), valid as long
    as the caller keeps them.
    """
    pieces = tuple(Piece(*p) for p in pieces)
    packed = to_torch(_scales_and_cast(
        buf.jax(), to_jax(packed_amax.contiguous()), pieces, slice_backend(kernels, device),
        jax_dtype_for(source_dtype),
    ))
    if packed.device != device:
        packed = packed.to(device)
    out, cursor = [], 0
    for p in pieces:
        row, col = packed[cursor:cursor + p.numel], packed[cursor + p.numel:cursor + 2 * p.numel]
        cursor += 2 * p.numel
        out.append([row, col])
    for p, item in zip(pieces, out, strict=True):
        m, k = p.shape
        n = m * k // BLOCK_SIZE
        item.append(packed[cursor:cursor + n].view(scale_shape(p.shape, Plane.ROWWISE)))
        item.append(packed[cursor + n:cursor + 2 * n].view(scale_shape(p.shape, Plane.COLWISE)))
        cursor += 2 * n
    return [SliceBytes(*item) for item in out]
