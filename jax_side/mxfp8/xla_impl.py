"""The ``xla`` backend: MXFP8 quantize / dequantize in pure JAX, bit-exact to DESIGN.md 3.

Why the code looks the way it does: XLA flushes subnormal floats to zero on CPU (inputs and
results of float arithmetic), so every step whose operands or results can be subnormal is done on
integer bit patterns instead:

- the input is widened to fp32 by bit shifting (bf16 -> fp32), never by a float convert;
- the block amax is a max over ``bits & 0x7FFFFFFF`` (non-negative floats order like their bits),
  NaN bit patterns replaced by 0 first (NaN is ignored);
- the scale byte comes from a table of exact amax thresholds (see ``formats``);
- the element ``x * 2**(127 - E)`` is computed as ``float(N) * 2**t`` where N is x's integer
  significand (exact in fp32, and >= 1, so never subnormal) and 2**t is applied as up to three
  multiplications by *normal* powers of two. Every partial product is exact unless the true
  result is below 2**-126, where the e4m3 result is +-0 either way;
- dequantize builds the fp32 result bits of ``e4m3 * 2**(E - 127)`` directly (it can be
  subnormal).

All functions here are shape-static and jit-friendly; callers validate inputs (``quantize.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from common.formats import BLOCK_SIZE, E4M3_MAX, E8M0_BIAS, E8M0_NAN
from jax_side.mxfp8.e8m0 import e8m0_thresholds

__all__ = [
    "block_amax_2d",
    "cast_2d",
    "dequantize_plane",
    "expand_colwise",
    "expand_rowwise",
    "fp32_bits",
    "scale_bytes_from_amax",
]

_SIGN = 0x80000000
_ABS = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_BS = BLOCK_SIZE


def fp32_bits(x: jax.Array) -> jax.Array:
    """uint32 bit pattern of ``fp32(x)`` for bf16 or fp32 ``x``, without float arithmetic."""
    if x.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    if x.dtype == jnp.float32:
        return lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"internal: fp32_bits got {x.dtype}")


def _abs_bits_nan_as_zero(bits: jax.Array) -> jax.Array:
    a = bits & jnp.uint32(_ABS)
    return jnp.where(a > jnp.uint32(_INF_BITS), jnp.uint32(0), a)


class BlockAmaxBits(NamedTuple):
    rowwise: jax.Array | None  # uint32 (M, K // 32)
    colwise: jax.Array | None  # uint32 (M // 32, K)


def block_amax_2d(bits: jax.Array, *, rowwise: bool, colwise: bool) -> BlockAmaxBits:
    """Block amax bit patterns of a uint32 (M, K) array of fp32 bits (NaN ignored)."""
    m, k = bits.shape
    a = _abs_bits_nan_as_zero(bits)
    row = jnp.max(a.reshape(m, k // _BS, _BS), axis=2) if rowwise else None  # (M, K/32, 32)
    col = jnp.max(a.reshape(m // _BS, _BS, k), axis=1) if colwise else None  # (M/32, 32, K)
    return BlockAmaxBits(row, col)


def scale_bytes_from_amax(amax: jax.Array) -> jax.Array:
    """uint8 E8M0 bytes for fp32 block amax values (any shape), DESIGN.md 3 step 3.

    amax >= 0 (a block amax): 0 and -0.0 -> 0x00, +Inf -> 0xFE, NaN (either sign) -> 0xFF.
    """
    amax_bits = lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.uint32)
    is_nan = (amax_bits & jnp.uint32(_ABS)) > jnp.uint32(_INF_BITS)
    # -0.0 orders above every positive float as a bit pattern; it is the amax 0.
    amax_bits = jnp.where(amax_bits == jnp.uint32(_SIGN), jnp.uint32(0), amax_bits)
    thresholds = jnp.asarray(e8m0_thresholds())
    byte = jnp.searchsorted(thresholds, amax_bits.reshape(-1), side="right")
    byte = byte.astype(jnp.uint8).reshape(amax.shape)
    return jnp.where(is_nan, jnp.uint8(E8M0_NAN), byte)


def _pow2(e: jax.Array) -> jax.Array:
    """fp32 2**e for int32 e in [-126, 127] (normal), built from bits."""
    return lax.bitcast_convert_type(((e + 127).astype(jnp.uint32)) << 23, jnp.float32)


def cast_2d(bits: jax.Array, scale_exp: jax.Array) -> jax.Array:
    """float8_e4m3fn of ``e4m3_rn_satfinite(x * 2**(127 - E))``, elementwise.

    bits: uint32 fp32 bit patterns of x, any shape; scale_exp: uint8 E8M0 bytes E broadcast to the
    same shape. NaN x -> NaN with x's sign; +-Inf x -> +-448; E == 0xFF -> NaN.
    """
    sign = (bits & jnp.uint32(_SIGN)) != 0
    biased = ((bits >> 23) & jnp.uint32(0xFF)).astype(jnp.int32)
    mant = bits & jnp.uint32(0x7FFFFF)
    # x = N * 2**(e - 150) with integer significand N (exact in fp32) and e >= 1.
    n = jnp.where(biased == 0, mant, mant | jnp.uint32(0x800000))
    e = jnp.maximum(biased, 1)
    t = e - 23 - scale_exp.astype(jnp.int32)  # |x| * 2**(127 - E) == N * 2**t, t in [-276, 231]
    t1 = jnp.clip(t, -126, 127)
    t2 = jnp.clip(t - t1, -126, 127)
    t3 = t - t1 - t2
    z = n.astype(jnp.float32) * _pow2(t1) * _pow2(t2) * _pow2(t3)
    z = jnp.minimum(z, jnp.float32(E4M3_MAX))  # satfinite (z >= 0 here)
    z = jnp.where(biased == 0xFF, jnp.float32(E4M3_MAX), z)  # Inf saturates (NaN fixed below)
    y = lax.bitcast_convert_type(z.astype(jnp.float8_e4m3fn), jnp.uint8)
    is_nan = (bits & jnp.uint32(_ABS)) > jnp.uint32(_INF_BITS)
    y = jnp.where(is_nan | (scale_exp == 0xFF), jnp.uint8(0x7F), y)
    y = jnp.where(sign, y | jnp.uint8(0x80), y)
    return lax.bitcast_convert_type(y, jnp.float8_e4m3fn)


def dequantize_plane(data: jax.Array, scale_exp: jax.Array) -> jax.Array:
    """fp32 ``e4m3(data) * 2**(E - 127)``, exact (subnormal results kept), elementwise.

    data: float8_e4m3fn, any shape; scale_exp: uint8 E broadcast to the same shape.
    """
    yb = lax.bitcast_convert_type(data.astype(jnp.float32), jnp.uint32)  # e4m3 -> f32 is exact
    sign = yb & jnp.uint32(_SIGN)
    ey = ((yb >> 23) & jnp.uint32(0xFF)).astype(jnp.int32)
    my = yb & jnp.uint32(0x7FFFFF)
    er = ey + scale_exp.astype(jnp.int32) - E8M0_BIAS
    normal_bits = sign | (jnp.clip(er, 1, 254).astype(jnp.uint32) << 23) | my
    # e4m3 has 4 significant bits, so the subnormal shift (1 - er <= 10 here) drops no set bit.
    shift = jnp.clip(1 - er, 0, 31).astype(jnp.uint32)
    sub_bits = sign | ((my | jnp.uint32(0x800000)) >> shift)
    out = jnp.where(er >= 1, normal_bits, sub_bits)
    out = jnp.where(er >= 255, sign | jnp.uint32(_INF_BITS), out)
    out = jnp.where(ey == 0, sign, out)  # +-0 (e4m3 subnormals are normal in fp32)
    is_nan = (yb & jnp.uint32(_ABS)) > jnp.uint32(_INF_BITS)
    out = jnp.where(is_nan | (scale_exp == 0xFF), jnp.uint32(0x7FC00000), out)
    return lax.bitcast_convert_type(out, jnp.float32)


def expand_rowwise(scale: jax.Array) -> jax.Array:
    """uint8 (M, K/32) -> (M, K): each scale repeated over its 1x32 block."""
    return jnp.repeat(scale, _BS, axis=1)


def expand_colwise(scale: jax.Array) -> jax.Array:
    """uint8 (M/32, K) -> (M, K): each scale repeated over its 32x1 block."""
    return jnp.repeat(scale, _BS, axis=0)
