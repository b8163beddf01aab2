"""Public MXFP8 quantize / dequantize API and the slice building blocks of distributed quantization.

Whole-tensor quantization is *defined* as the composition of the three building blocks
(``partial_block_amax`` over the whole tensor, ``scales_from_amax``, ``cast_slice``), so the
distributed recipe of DESIGN.md 5 -- partial amax per rank, all-reduce MAX, scales everywhere,
cast of owned elements -- is the same code path split differently.

Flat slices: a slice of a row-major (M, K) tensor is a 1-D array holding flat elements
``[start, start + n)``. Only the 32-row band of blocks the slice touches is materialised, never
the whole tensor.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_side.mxfp8 import xla_impl
from jax_side.mxfp8.backends import Backend, resolve_backend
from jax_side.mxfp8.formats import BLOCK_SIZE
from jax_side.mxfp8.tensor import MXFP8Tensor, Plane

__all__ = [
    "BlockAmax",
    "SliceCast",
    "cast_slice",
    "dequantize",
    "partial_block_amax",
    "quantize",
    "scales_from_amax",
]

_BS = BLOCK_SIZE
_INPUT_DTYPES = (jnp.bfloat16, jnp.float32)


class BlockAmax(NamedTuple):
    """Per-block amax, fp32, full scale-tensor shapes; zeros where nothing contributed."""

    rowwise: jax.Array | None  # float32 (M, K // 32), blocks 1x32 along K
    colwise: jax.Array | None  # float32 (M // 32, K), blocks 32x1 along M


class SliceCast(NamedTuple):
    """Quantized elements of one flat slice, as 1-D float8_e4m3fn of the slice's length."""

    rowwise: jax.Array | None
    colwise: jax.Array | None


def _round_up(d: int) -> int:
    return math.ceil(max(d, 1) / _BS) * _BS


def _check_shape(shape, what: str) -> tuple[int, int]:
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2:
        raise ValueError(
            f"{what}: MXFP8 needs a 2-D (M, K) tensor, got shape {shape} ({len(shape)}-D); "
            f"reshape to 2-D first (e.g. x.reshape(-1, x.shape[-1]))"
        )
    m, k = shape
    if m % _BS or k % _BS or m == 0 or k == 0:
        raise ValueError(
            f"{what}: MXFP8 needs M % 32 == 0 and K % 32 == 0 (non-empty), got shape (M, K) = "
            f"{shape}; pad to {_round_up(m), _round_up(k)} or keep this tensor in a non-MXFP8 "
            f"format"
        )
    return m, k


def _check_dtype(x, what: str) -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(
            f"{what}: MXFP8 quantizes bfloat16 or float32 input, got dtype {x.dtype}; "
            f"cast first, e.g. x.astype(jnp.bfloat16) (master weights: bf16(fp32 master))"
        )


def _check_planes(rowwise: bool, colwise: bool) -> None:
    if not (rowwise or colwise):
        raise ValueError("quantize: rowwise=False and colwise=False asks for nothing; set one")


def _check_slice(flat, shape, start: int, what: str) -> tuple[int, int, int]:
    m, k = _check_shape(shape, what)
    if flat.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D flat slice, got shape {tuple(flat.shape)}")
    n = int(flat.shape[0])
    if start < 0 or start + n > m * k:
        raise ValueError(
            f"{what}: slice [start, start + n) = [{start}, {start + n}) lies outside the "
            f"{m * k} elements of shape {(m, k)}; pass the slice's flat row-major start offset"
        )
    return m, k, n


class _Band(NamedTuple):
    """The 32-row-aligned band of rows [row0, row1) that covers a flat slice."""

    row0: int
    row1: int
    pad_left: int
    pad_right: int


def _band(m: int, k: int, start: int, n: int) -> _Band:
    first_row = start // k
    last_row = (start + n - 1) // k
    row0 = (first_row // _BS) * _BS
    row1 = min(m, (last_row // _BS + 1) * _BS)
    return _Band(row0, row1, start - row0 * k, row1 * k - (start + n))


def _band_bits(flat, k: int, band: _Band) -> jax.Array:
    bits = xla_impl.fp32_bits(flat)
    bits = jnp.pad(bits, (band.pad_left, band.pad_right))  # zero bits never raise an amax
    return bits.reshape(band.row1 - band.row0, k)


def partial_block_amax(
    flat: jax.Array,
    shape: tuple[int, int],
    start: int,
    *,
    rowwise: bool = True,
    colwise: bool = True,
) -> BlockAmax:
    """Block amax of the part of a (M, K) tensor held in a flat slice.

    flat: 1-D bf16/fp32, elements ``[start, start + n)`` of the row-major (M, K) tensor; shape and
    start are static. Returns fp32 arrays of the full scale shapes -- rowwise (M, K/32), blocks
    along K; colwise (M/32, K), blocks along M -- holding this slice's contribution and 0
    elsewhere. Elementwise ``max`` over the results of any split into slices (e.g. an
    ``all_reduce(MAX)``) gives the whole tensor's block amax. NaN is ignored; Inf counts.
    """
    m, k, n = _check_slice(flat, shape, start, "partial_block_amax")
    _check_dtype(flat, "partial_block_amax")
    return _partial_block_amax(flat, (m, k), int(start), bool(rowwise), bool(colwise))


@partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _partial_block_amax(flat, shape, start, rowwise, colwise) -> BlockAmax:
    # One compiled program per (slice length, shape, start): FSDP calls repeat them every step.
    m, k = shape
    n = int(flat.shape[0])
    row = jnp.zeros((m, k // _BS), jnp.uint32) if rowwise else None
    col = jnp.zeros((m // _BS, k), jnp.uint32) if colwise else None
    if n > 0:
        band = _band(m, k, start, n)
        part = xla_impl.block_amax_2d(
            _band_bits(flat, k, band), rowwise=rowwise, colwise=colwise
        )
        if rowwise:
            row = lax.dynamic_update_slice(row, part.rowwise, (band.row0, 0))
        if colwise:
            col = lax.dynamic_update_slice(col, part.colwise, (band.row0 // _BS, 0))

    def as_f32(a):
        return None if a is None else lax.bitcast_convert_type(a, jnp.float32)

    return BlockAmax(as_f32(row), as_f32(col))


def scales_from_amax(amax: jax.Array) -> jax.Array:
    """E8M0 scales (float8_e8m0fnu, same shape) from fp32 block amax, DESIGN.md 3 steps 2-3.

    amax must be non-negative (as produced by ``partial_block_amax``); +Inf gives 0xFE.
    """
    if amax.dtype != jnp.float32:
        raise TypeError(f"scales_from_amax: expected float32 amax, got {amax.dtype}")
    return _scales_from_amax(amax)


@jax.jit
def _scales_from_amax(amax):
    return lax.bitcast_convert_type(xla_impl.scale_bytes_from_amax(amax), jnp.float8_e8m0fnu)


def _scale_bytes(scale: jax.Array, expected: tuple[int, int], what: str) -> jax.Array:
    if tuple(scale.shape) != expected:
        raise ValueError(f"{what}: expected scale shape {expected}, got {tuple(scale.shape)}")
    if scale.dtype == jnp.float8_e8m0fnu:
        return lax.bitcast_convert_type(scale, jnp.uint8)
    if scale.dtype == jnp.uint8:
        return scale
    raise TypeError(f"{what}: expected float8_e8m0fnu (or uint8) scales, got {scale.dtype}")


def cast_slice(
    flat: jax.Array,
    shape: tuple[int, int],
    start: int,
    *,
    rowwise_scale: jax.Array | None = None,
    colwise_scale: jax.Array | None = None,
) -> SliceCast:
    """Cast a flat slice of a (M, K) tensor to e4m3 with precomputed full scales.

    flat: 1-D bf16/fp32, elements ``[start, start + n)`` (row-major); rowwise_scale: E8M0
    (M, K/32) or None; colwise_scale: E8M0 (M/32, K) or None (uint8 bytes are accepted too).
    Returns 1-D float8_e4m3fn arrays of length n per requested plane: exactly the bytes that the
    whole-tensor ``quantize`` has at those flat positions.
    """
    m, k, n = _check_slice(flat, shape, start, "cast_slice")
    _check_dtype(flat, "cast_slice")
    if rowwise_scale is None and colwise_scale is None:
        raise ValueError("cast_slice: pass rowwise_scale and/or colwise_scale")
    row_b = None if rowwise_scale is None else _scale_bytes(
        rowwise_scale, (m, k // _BS), "cast_slice rowwise_scale")
    col_b = None if colwise_scale is None else _scale_bytes(
        colwise_scale, (m // _BS, k), "cast_slice colwise_scale")
    return _cast_slice(flat, (m, k), int(start), row_b, col_b)


@partial(jax.jit, static_argnums=(1, 2))
def _cast_slice(flat, shape, start, row_b, col_b) -> SliceCast:
    m, k = shape
    n = int(flat.shape[0])
    if n == 0:
        empty = jnp.zeros((0,), jnp.float8_e4m3fn)
        return SliceCast(None if row_b is None else empty, None if col_b is None else empty)
    band = _band(m, k, start, n)
    bits = _band_bits(flat, k, band)  # (R, K) rows [row0, row1)
    rows = band.row1 - band.row0

    def finish(y: jax.Array) -> jax.Array:
        return y.reshape(-1)[band.pad_left : band.pad_left + n]

    row = col = None
    if row_b is not None:
        band_scale = lax.dynamic_slice(row_b, (band.row0, 0), (rows, k // _BS))
        row = finish(xla_impl.cast_2d(bits, xla_impl.expand_rowwise(band_scale)))
    if col_b is not None:
        band_scale = lax.dynamic_slice(col_b, (band.row0 // _BS, 0), (rows // _BS, k))
        col = finish(xla_impl.cast_2d(bits, xla_impl.expand_colwise(band_scale)))
    return SliceCast(row, col)


@partial(jax.jit, static_argnums=(1, 2))
def _quantize_xla(x: jax.Array, rowwise: bool, colwise: bool) -> MXFP8Tensor:
    m, k = x.shape
    flat = x.reshape(-1)  # (M*K,) row-major
    amax = partial_block_amax(flat, (m, k), 0, rowwise=rowwise, colwise=colwise)
    rs = None if amax.rowwise is None else scales_from_amax(amax.rowwise)
    cs = None if amax.colwise is None else scales_from_amax(amax.colwise)
    cast = cast_slice(flat, (m, k), 0, rowwise_scale=rs, colwise_scale=cs)
    return MXFP8Tensor(
        rowwise_data=None if rs is None else cast.rowwise.reshape(m, k),
        rowwise_scale=rs,
        colwise_data=None if cs is None else cast.colwise.reshape(m, k),
        colwise_scale=cs,
        shape=(m, k),
        dtype=np.dtype(x.dtype),
    )


def quantize(
    x: jax.Array,
    *,
    rowwise: bool = True,
    colwise: bool = True,
    backend: Backend | str | None = None,
) -> MXFP8Tensor:
    """Quantize a 2-D (M, K) bf16/fp32 tensor to MXFP8 (DESIGN.md 3 numerics, 4 layout).

    rowwise: blocks 1x32 along K -> rowwise_data (M, K) e4m3, rowwise_scale (M, K/32) e8m0.
    colwise: blocks 32x1 along M -> colwise_data (M, K) e4m3 (not transposed),
    colwise_scale (M/32, K) e8m0. backend: None (automatic, see ``backend_report``), "xla", "te".
    """
    x = jnp.asarray(x)
    _check_shape(x.shape, "quantize")
    _check_dtype(x, "quantize")
    _check_planes(rowwise, colwise)
    choice = resolve_backend(backend)
    if choice.backend is Backend.TE:
        from jax_side.mxfp8 import te_backend

        return te_backend.quantize(x, rowwise=rowwise, colwise=colwise)
    return _quantize_xla(x, bool(rowwise), bool(colwise))


def dequantize(t: MXFP8Tensor, plane: Plane | str = Plane.ROWWISE) -> jax.Array:
    """float32 (M, K): ``e4m3(y) * 2**(E - 127)`` of one plane, exact (DESIGN.md 3 step 5)."""
    if not isinstance(t, MXFP8Tensor):
        raise TypeError(f"dequantize: expected an MXFP8Tensor, got {type(t).__name__}")
    plane = Plane.parse(plane)
    data, scale = t.plane(plane)
    scale_b = _scale_bytes(scale, t.scale_shapes[plane], f"dequantize {plane.value} scale")
    expand = xla_impl.expand_rowwise if plane is Plane.ROWWISE else xla_impl.expand_colwise
    return xla_impl.dequantize_plane(data, expand(scale_b))
