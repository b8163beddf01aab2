"""Re-blocking MXFP8 planes for Hopper's FP8 tensor cores (DESIGN.md 11, the ``fp8_blocked`` GEMM).

An FP8 ``wgmma`` cannot apply a scale per 32 elements of K inside its K loop at speed; it can per
128 (one fp32 promotion of the accumulator per 128 of K, as DeepGEMM and cuBLAS's block-scaled
FP8 GEMMs do). So each operand, laid out as (rows, K) and blocked along K, is re-blocked:

- ``reblock_rows``: four consecutive 1x32 blocks along K become one 1x128 block (the left
  operand, ``a``);
- ``reblock_tiles``: the 1x32 blocks of 128 rows x 128 columns become one 128x128 tile (the right
  operand, ``b``: weights in the forward and dgrad GEMMs).

The merged block's scale is the largest of its E8M0 scales (a power of two, exact). Each element
keeps its value where it can: its e4m3 code is multiplied by ``2**(E_old - E_new)`` (a power of
two <= 1) and rounded to nearest even in e4m3. The shift is exact while the result stays an e4m3
normal (>= 2**-6), so only small elements of blocks well below their group's largest scale change
(measured, issue 33: 0.003-0.2 % of elements of ordinary tensors). The shift is computed on fp32
values that stay normal (the exponent difference is clamped at -30, where every e4m3 code already
rounds to zero), so the bytes do not depend on a platform's flushing of subnormals; NaN codes keep
their byte, sign included (``shift_codes``), and a block whose scale byte is 0xFF (NaN) makes
its merged scale NaN.

Shapes: K must be a multiple of 128 and, for tiles, rows too (``pad_to``, used by the GEMM, pads
with zero codes and zero scale bytes, which are never a group's maximum over real data and add
nothing to a dot product).

``blocked_dot_reference``: the exact value of the GEMM on re-blocked operands (dequantize to fp32
exactly, one fp32 dot at HIGHEST precision), the reference the Pallas kernel is tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_side.mxfp8 import xla_impl

__all__ = [
    "GROUP",
    "Reblocked",
    "blocked_dot_reference",
    "pad_to",
    "reblock_rows",
    "reblock_tiles",
    "scale_fp32",
    "shift_codes",
    "shift_factor",
]

GROUP = 128  # elements along K of one re-blocked block; rows of one tile
_MX = 32  # MXFP8 block
_PER = GROUP // _MX  # MXFP8 blocks per re-blocked block
_MIN_SHIFT = -30  # every e4m3 code times 2**-30 rounds to (signed) zero in e4m3


class Reblocked(NamedTuple):
    """One operand re-blocked: e4m3 data (rows, K) and uint8 E8M0 scale bytes.

    ``scale`` is (rows, K/128) for 1x128 blocks, (rows/128, K/128) for 128x128 tiles."""

    data: jax.Array
    scale: jax.Array


def _check(data: jax.Array, scale: jax.Array, tiles: bool, what: str) -> tuple[int, int]:
    if data.ndim != 2 or data.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{what}: data must be 2-D float8_e4m3fn (rows, K), got "
                         f"{data.dtype}{tuple(data.shape)}")
    rows, k = data.shape
    if tuple(scale.shape) != (rows, k // _MX) or scale.dtype != jnp.uint8:
        raise ValueError(f"{what}: scale must be uint8 E8M0 bytes of shape {(rows, k // _MX)} "
                         f"(1x32 blocks along K), got {scale.dtype}{tuple(scale.shape)}")
    if k % GROUP or (tiles and rows % GROUP):
        need = "rows and K" if tiles else "K"
        raise ValueError(f"{what}: {need} must be multiples of {GROUP}, got (rows, K) = "
                         f"{(rows, k)}; pad with pad_to(...) first")
    return rows, k


def shift_factor(diff: jax.Array) -> jax.Array:
    """float32 2**max(diff, -30) for int32 ``diff <= 0``, built from its exponent bits (a
    normal power of two; below -30 every e4m3 value rounds to zero anyway)."""
    d = jnp.maximum(diff, jnp.int32(_MIN_SHIFT))
    return lax.bitcast_convert_type(lax.shift_left(d + jnp.int32(127), jnp.int32(23)),
                                    jnp.float32)


def shift_codes(codes: jax.Array, diff: jax.Array) -> jax.Array:
    """uint8 e4m3 ``codes * 2**diff`` rounded to nearest even, int32 ``diff <= 0`` (broadcast):
    the magnitude shifted through fp32 (exact: an e4m3 value times a normal power of two), the
    sign bit or-ed back, NaN codes (0x7F, 0xFF) kept as they are -- a float multiply would let
    the device pick the NaN's sign (XLA:GPU writes 0x7F for both). Integer ops and one cast only,
    so the Pallas kernel (``pallas_blocked``) runs this same function."""
    c = codes.astype(jnp.int32)
    mag = c & jnp.int32(0x7F)
    v = lax.bitcast_convert_type(mag.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
    shifted = lax.bitcast_convert_type((v * shift_factor(diff)).astype(jnp.float8_e4m3fn),
                                       jnp.uint8)
    out = shifted.astype(jnp.int32) | (c & jnp.int32(0x80))
    return jnp.where(mag == jnp.int32(0x7F), c, out).astype(jnp.uint8)


def _shift(codes: jax.Array, diff: jax.Array) -> jax.Array:
    """``shift_codes`` on float8_e4m3fn codes."""
    return lax.bitcast_convert_type(
        shift_codes(lax.bitcast_convert_type(codes, jnp.uint8), diff), jnp.float8_e4m3fn)


def reblock_rows(data: jax.Array, scale: jax.Array) -> Reblocked:
    """1x32 blocks along K -> 1x128 blocks; ``scale`` (rows, K/32) uint8 -> (rows, K/128)."""
    rows, k = _check(data, scale, tiles=False, what="reblock_rows")
    s = scale.reshape(rows, k // GROUP, _PER)
    top = jnp.max(s, axis=2)
    diff = s.astype(jnp.int32) - top[..., None].astype(jnp.int32)
    out = _shift(data.reshape(rows, k // GROUP, _PER, _MX), diff[..., None])
    return Reblocked(out.reshape(rows, k), top)


def reblock_tiles(data: jax.Array, scale: jax.Array) -> Reblocked:
    """1x32 blocks along K -> 128x128 tiles; ``scale`` (rows, K/32) -> (rows/128, K/128)."""
    rows, k = _check(data, scale, tiles=True, what="reblock_tiles")
    s = scale.reshape(rows // GROUP, GROUP, k // GROUP, _PER)
    top = jnp.max(s, axis=(1, 3))
    diff = s.astype(jnp.int32) - top[:, None, :, None].astype(jnp.int32)
    out = _shift(data.reshape(rows // GROUP, GROUP, k // GROUP, _PER, _MX), diff[..., None])
    return Reblocked(out.reshape(rows, k), top)


def pad_to(data: jax.Array, scale: jax.Array, rows: int, k: int) -> tuple[jax.Array, jax.Array]:
    """Zero codes and zero scale bytes appended up to (rows, K); unchanged where already there."""
    r0, k0 = data.shape
    if (r0, k0) == (rows, k):
        return data, scale
    data = jnp.pad(data, ((0, rows - r0), (0, k - k0)))
    scale = jnp.pad(scale, ((0, rows - r0), (0, (k - k0) // _MX)))
    return data, scale


def scale_fp32(scale: jax.Array) -> jax.Array:
    """fp32 ``2**(E - 127)`` of uint8 E8M0 bytes (byte 0 gives the subnormal 2**-127; 0xFF NaN)."""
    e = scale.astype(jnp.uint32)
    bits = jnp.where(e == 0, jnp.uint32(0x00400000), e << 23)
    bits = jnp.where(e == 0xFF, jnp.uint32(0x7FC00000), bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _dequant_rows(r: Reblocked) -> jax.Array:
    return xla_impl.dequantize_plane(r.data, jnp.repeat(r.scale, GROUP, axis=1))


def _dequant_tiles(r: Reblocked) -> jax.Array:
    expanded = jnp.repeat(jnp.repeat(r.scale, GROUP, axis=0), GROUP, axis=1)
    return xla_impl.dequantize_plane(r.data, expanded)


def blocked_dot_reference(a: Reblocked, b: Reblocked) -> jax.Array:
    """fp32 (M, N) = a (M, K; 1x128 blocks) @ b (N, K; 128x128 tiles)^T, exact dequantize and
    one fp32 dot at HIGHEST precision."""
    return lax.dot_general(
        _dequant_rows(a), _dequant_tiles(b), (((1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
