"""The ``pallas`` kernels: MXFP8 quantize in Pallas (Triton lowering), byte-identical to ``xla``.

Design note: docs/pallas_kernel.md. Contract: DESIGN.md 3 (numerics) and 4 (layout). The
backend interface (whole tensors and flat slices, interpret mode off the GPU) is
``pallas_backend``; this module holds the 2-D kernels.

Tiling. A grid program owns a (BM, BK) tile of x (BM, BK power-of-two multiples of 32; row tiles
on grid axis 0, column tiles on axis 1) and walks it in static (32, 32) chunks loaded straight
from the ref: a chunk holds 32 rowwise blocks (its rows) and 32 colwise blocks (its columns), so
both block amaxes are plain reductions over one axis of a 2-D value (no in-kernel reshape), and x
is read once for both planes.

Numerics, FTZ-proof (interpret mode runs on XLA:CPU, which flushes subnormal floats; Triton may
or may not): every value that can be subnormal is handled on int32 bit patterns, and every float
operation has normal operands and an exact normal (or discarded) result.

- x is widened to fp32 bits by a shift (bf16) or a bitcast (fp32); ``a = bits & 0x7FFFFFFF``.
- amax: max over ``a`` with NaN patterns zeroed (non-negative floats order like their bits).
- scale byte (``_scale_bytes``): byte >= 2 exactly when amax_bits >= T[1] (T = formats'
  threshold table); then amax and s = fp32_rn(amax * fp32(1/448)) are normal, so one float
  multiply is exact under any denormal mode and RCEIL is ``(s_bits + 0x7FFFFF) >> 23``. Below
  T[1] the byte is ``amax_bits >= T[0]``; +Inf (and, as in ``xla``, NaN or negative) -> 0xFE.
- element, v = |x| * 2**k with k = 127 - E, as an exponent add on "extended" bits
  (``_elements``): ``ext`` = a for normal x; for subnormal x the bits of |x| * 2**64 (computed
  as ``bitcast(a | 2**23) * 2**64 - 2**-62``, exact and normal) less ``64 << 23``, i.e. |x| with
  an exponent field <= 0. ``ext + (k << 23)`` is then the exact fp32 bits of v whenever
  v >= 2**-126; anything smaller is clamped at 0 (v < 2**-126 rounds to e4m3 0 anyway).
  ``_cast_own`` (scale from the block's own amax) needs no saturation clamp; ``_cast_any``
  (given scales) clamps ``ext`` at the bits of 448 * 2**-k first. v in [0, 448] -> e4m3 by the
  hardware cast (``"float"``: cvt.rn.satfinite.e4m3x2.f32) or integer RNE (``"int"``);
  Inf and NaN are cast as 448 (0x7E), then an or-ed byte adds the sign and, for NaN (or scale
  0xFF), the low bit (0x7F). All selects act on 32-bit values (byte selects cost unpacking).
- "native" element path (``_cast_native``; compiled kernels only, the GPU default): |x| * 2**k
  as one fp32 multiply, the hardware cast (RNE, satfinite: Inf -> 448, NaN -> 0x7F), then the
  sign or-ed in. Exact where fp32 subnormals are not flushed (Triton's GPU code: no .ftz);
  roughly half the per-element operations of the FTZ-proof paths (counted in the source, not
  the SASS). Interpret mode (XLA:CPU flushes) refuses it and uses "float". Byte-identical to
  ``xla`` on the GPU (test_gpu_*).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from common.formats import BLOCK_SIZE, E4M3_MAX
from jax_side.mxfp8.e8m0 import e8m0_thresholds, fp32_reciprocal_of_max
from jax_side.mxfp8.tensor import BlockAmax, SliceCast, scale_bytes

__all__ = [
    "COMPILED_MODE",
    "E4M3_CAST",
    "E4M3_CASTS",
    "KERNEL_MODES",
    "NATIVE",
    "BlockAmax",
    "Planes",
    "SliceCast",
    "Tiles",
    "block_amax_2d",
    "cast_2d",
    "quantize_2d",
    "scales_from_amax",
]

_BS = BLOCK_SIZE
_ABS = np.int32(0x7FFFFFFF)
_INF = np.int32(0x7F800000)
_MIN_NORMAL = np.int32(0x00800000)
_T0 = np.int32(e8m0_thresholds()[0])  # smallest amax bits with byte >= 1
_T1 = np.int32(e8m0_thresholds()[1])  # smallest amax bits with byte >= 2 (s normal from here)
_RECIP = np.float32(fp32_reciprocal_of_max())
_E4M3_MAX_BITS = np.int32(np.float32(E4M3_MAX).view(np.int32))  # 448 = 1.75 * 2**8

# How v in [0, 448] becomes e4m3: "float" = lax convert (Triton: tt.fp_to_fp rtne, PTX
# cvt.rn.satfinite.e4m3x2.f32 on sm_89+), "int" = integer round-to-nearest-even on v's bits.
# Both are FTZ-proof (exact under a flushing interpreter too).
E4M3_CASTS = ("float", "int")
E4M3_CAST = "float"
# "native" (compiled kernels only): v = |x| * 2**k by one fp32 multiply and the hardware cast,
# the sign or-ed in afterwards. Exact only where fp32 subnormals are not flushed (the GPU code
# Triton emits: no .ftz); XLA:CPU, which runs interpret mode, flushes them, so it is refused there.
NATIVE = "native"
KERNEL_MODES = (*E4M3_CASTS, NATIVE)
COMPILED_MODE = NATIVE  # the default of compiled (GPU) kernels; interpret mode uses E4M3_CAST


class Tiles(NamedTuple):
    """Tile sizes: upper bounds, shrunk per call to the largest power of two dividing M or K."""

    block_m: int = 32  # rows per program (power of two >= 32)
    block_k: int = 128  # columns per program (power of two >= 32)
    num_warps: int = 1  # Triton warps per program
    preload: bool = True  # issue every chunk's load before any math (more bytes in flight)
    chunk_k: int = 32  # chunk width (32, 64, 128): wider chunks reshape (32, CK) -> (32, CK/32,
    #                   32) for the rowwise amax but give each thread more rows (fewer shuffles)


# Defaults per (kernel, input dtype), from the sm_90 SASS of each (docs/pallas_kernel.md), to be
# replaced by measured ones: one warp per program gives quantize and amax the fewest
# instructions per element, with 8 KiB of x per program and no register spills; wider chunks
# (chunk_k 64/128) cut shuffles and instructions further for ~1.4x the registers (fewer warps
# per SM), so they are left to the benchmark's sweep. cast_2d spills with one warp: four.
DEFAULT_TILES = {
    # the "native" element path (the compiled default): 32x128, two warps, 128-wide chunks was
    # the fastest of three tilings at 8192x8192, 4096x8192 and 50304x768 bf16 (BENCHMARKS.md)
    ("quantize", "bfloat16", NATIVE): Tiles(block_m=32, block_k=128, num_warps=2, preload=True,
                                            chunk_k=128),
    # 32x64 measured fastest of 11 tilings at 8192x8192 bf16 on the H200 (BENCHMARKS.md), "float"
    ("quantize", "bfloat16"): Tiles(block_m=32, block_k=64, num_warps=1, preload=True),
    ("quantize", "float32"): Tiles(block_m=32, block_k=64, num_warps=1, preload=True),
    ("amax", "bfloat16"): Tiles(block_m=32, block_k=128, num_warps=1, preload=True, chunk_k=64),
    ("amax", "float32"): Tiles(block_m=32, block_k=64, num_warps=1, preload=True, chunk_k=64),
    ("cast", "bfloat16"): Tiles(block_m=32, block_k=128, num_warps=4, preload=True),
    ("cast", "float32"): Tiles(block_m=32, block_k=64, num_warps=4, preload=True),
}


class Planes(NamedTuple):
    """Output of ``quantize_2d``: a plane not asked for is (None, None)."""

    rowwise_data: jax.Array | None  # float8_e4m3fn (M, K), blocks 1x32 along K
    rowwise_scale: jax.Array | None  # float8_e8m0fnu (M, K // 32)
    colwise_data: jax.Array | None  # float8_e4m3fn (M, K), not transposed, blocks 32x1 along M
    colwise_scale: jax.Array | None  # float8_e8m0fnu (M // 32, K)


# ---------------------------------------------------------------------------------------------
# Element math on int32 bit patterns (used inside the kernels; plain jnp, so also testable).


def _fp32_bits(x: jax.Array) -> jax.Array:
    """int32 bits of fp32(x) for bf16 / fp32 x, without a float convert."""
    if x.dtype == jnp.bfloat16:
        return lax.shift_left(lax.bitcast_convert_type(x, jnp.int16).astype(jnp.int32), 16)
    return lax.bitcast_convert_type(x, jnp.int32)


class _Elements(NamedTuple):
    """Per-element values of a chunk that both planes share."""

    amax_in: jax.Array  # int32 |x| bits, NaN patterns zeroed: the block-amax operand
    ext: jax.Array  # int32 |x| as extended fp32 bits (exponent field <= 0 for subnormal x)
    special: jax.Array  # bool: x is +-Inf or NaN (cast as 448, then or8 makes NaN 0x7F)
    or8: jax.Array  # uint8 or-ed into the e4m3 byte: the sign bit, and 0x01 for NaN x


def _elements(bits: jax.Array) -> _Elements:
    """From int32 fp32 bits. Subnormal x: |x| * 2**64 = f * 2**64 - 2**-62 with
    f = bitcast(a | 2**23) = 2**-126 + |x|; all operands and the (exact) result are normal or 0, so
    no denormal mode changes it, and its bits less 64 << 23 encode |x| with exponent field <= 0."""
    a = bits & _ABS
    nan = a > _INF
    f = lax.bitcast_convert_type(a | _MIN_NORMAL, jnp.float32)
    scaled = f * jnp.float32(2.0**64) - jnp.float32(2.0**-62)
    sub = lax.bitcast_convert_type(scaled, jnp.int32) - jnp.int32(64 << 23)
    sign_nan = lax.shift_right_logical(bits, jnp.int32(24)) & jnp.int32(0x80)
    return _Elements(
        amax_in=jnp.where(nan, jnp.int32(0), a),
        ext=jnp.where(a < _MIN_NORMAL, sub, a),
        special=a >= _INF,
        or8=(sign_nan | jnp.where(nan, jnp.int32(1), jnp.int32(0))).astype(jnp.uint8),
    )


def _scale_bytes(amax_bits: jax.Array, *, any_bits: bool = True) -> jax.Array:
    """int32 E8M0 byte (0..254) from int32 fp32 amax bits; exact, see the module docstring.

    any_bits=False: amax_bits are known to lie in [0, +Inf bits] (kernel amax), one check less.
    """
    s = lax.bitcast_convert_type(lax.bitcast_convert_type(amax_bits, jnp.float32) * _RECIP,
                                 jnp.int32)
    # RCEIL of a normal s: E + (m != 0) is (s + 0x7FFFFF) >> 23; +Inf s gives 0xFF -> 0xFE.
    hi = jnp.minimum(lax.shift_right_logical(s + jnp.int32(0x7FFFFF), jnp.int32(23)),
                     jnp.int32(0xFE))
    lo = jnp.where(amax_bits >= _T0, jnp.int32(1), jnp.int32(0))
    byte = jnp.where(amax_bits >= _T1, hi, lo)
    if any_bits:  # as ``xla``: NaN (either sign) -> 0xFF, -0.0 -> 0, other negatives -> 0xFE
        nan = (amax_bits & _ABS) > _INF
        neg_zero = amax_bits == jnp.int32(-(2**31))
        byte = jnp.where((amax_bits < 0) | (amax_bits > _INF), jnp.int32(0xFE), byte)
        byte = jnp.where(neg_zero, jnp.int32(0), byte)
        byte = jnp.where(nan, jnp.int32(0xFF), byte)
    return byte


def _kshift(scale: jax.Array) -> jax.Array:
    """int32 (127 - E) << 23: adding it to fp32 bits multiplies by 2**(127 - E)."""
    return lax.shift_left(jnp.int32(127) - scale, jnp.int32(23))


def _e4m3_from_v(v: jax.Array, mode: str) -> jax.Array:
    """uint8 e4m3 magnitude of non-negative fp32 v < 464 (subnormal v may be flushed: -> 0)."""
    if mode == "float":
        return lax.bitcast_convert_type(v.astype(jnp.float8_e4m3fn), jnp.uint8)
    vb = lax.bitcast_convert_type(v, jnp.int32)
    # Normal e4m3 (v >= 2**-6): RNE of the mantissa to 3 bits, then rebias 127 -> 7 (120 << 3).
    odd = lax.shift_right_logical(vb, jnp.int32(20)) & jnp.int32(1)
    normal = lax.shift_right_logical(vb + jnp.int32(0x7FFFF) + odd, jnp.int32(20)) - 960
    # Subnormal e4m3: adding 2**14 (ulp 2**-9, the e4m3 subnormal step) rounds v RNE; all normal.
    magic = v + jnp.float32(16384.0)
    sub = lax.bitcast_convert_type(magic, jnp.int32) - jnp.int32(0x46800000)
    return jnp.where(vb < jnp.int32(0x3C800000), sub, normal).astype(jnp.uint8)


def _cast_own(el: _Elements, scale: jax.Array, mode: str) -> jax.Array:
    """uint8 e4m3 bytes of x * 2**(127 - E) where E came from the block's own amax.

    Then E < 0xFF, Inf only occurs with E = 0xFE, and |x| * 2**(127 - E) < 448 * (1 + 2**-20)
    for finite x (RCEIL never rounds the scale down), so nothing needs clamping: the exponent
    add is exact for results >= 2**-126, anything smaller rounds to e4m3 0 (it is clamped at 0
    only to keep the sign bit clear). Specials are cast as 448 (0x7E); or8 adds sign and NaN bit.
    Every select is on 32-bit values: byte-wise selects cost byte unpacking on the GPU.
    """
    v = jnp.maximum(el.ext + _kshift(scale), jnp.int32(0))
    v = jnp.where(el.special, _E4M3_MAX_BITS, v)
    return _e4m3_from_v(lax.bitcast_convert_type(v, jnp.float32), mode) | el.or8


def _cast_any(el: _Elements, scale: jax.Array, mode: str) -> jax.Array:
    """uint8 e4m3 bytes of x * 2**(127 - E) for any E8M0 byte E (0xFF gives NaN).

    ``sat`` = bits of 448 * 2**-k (k = 127 - E) clamps saturating |x| to exactly 448 after the
    shift; where that is above fp32 max (k < -119) no finite x saturates and there is no clamp.
    """
    k = jnp.int32(127) - scale
    sat = jnp.where(k >= -119, lax.shift_left(jnp.int32(135) - k, jnp.int32(23)) | 0x600000,
                    _ABS)
    v = jnp.maximum(jnp.minimum(el.ext, sat) + lax.shift_left(k, jnp.int32(23)), jnp.int32(0))
    nan_scale = scale == 0xFF
    v = jnp.where(el.special | nan_scale, _E4M3_MAX_BITS, v)
    y = _e4m3_from_v(lax.bitcast_convert_type(v, jnp.float32), mode) | el.or8
    return y | jnp.where(nan_scale, jnp.int32(1), jnp.int32(0)).astype(jnp.uint8)


class _NativeElements(NamedTuple):
    """Per-element values of a chunk for the "native" cast (compiled kernels only)."""

    amax_in: jax.Array  # int32 |x| bits, NaN patterns zeroed: the block-amax operand
    mag: jax.Array  # float32 |x| (subnormals kept: the GPU does not flush them)
    sign8: jax.Array  # uint8 0x80 where x is negative (NaN included), else 0


def _native_elements(bits: jax.Array) -> _NativeElements:
    a = bits & _ABS
    return _NativeElements(
        amax_in=jnp.where(a > _INF, jnp.int32(0), a),
        mag=lax.bitcast_convert_type(a, jnp.float32),
        sign8=(lax.shift_right_logical(bits, jnp.int32(24)) & jnp.int32(0x80)).astype(jnp.uint8),
    )


def _pow2_k(scale: jax.Array) -> jax.Array:
    """float32 2**(127 - E) for int32 E8M0 bytes E: exponent field 254 - E, except E = 254
    (2**-127, an fp32 subnormal: bits 0x00400000) and E = 255 (NaN scale: 1.0, the caller
    forces NaN)."""
    bits = jnp.where(scale >= 254,
                     jnp.where(scale == 254, jnp.int32(0x00400000), jnp.int32(0x3F800000)),
                     lax.shift_left(jnp.int32(254) - scale, jnp.int32(23)))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _cast_native(el: _NativeElements, scale: jax.Array, nan_scale: bool) -> jax.Array:
    """uint8 e4m3 bytes of x * 2**(127 - E): e4m3_rn_satfinite(|x| * 2**k) | sign.

    The fp32 multiply is exact whenever the product is normal (a power-of-two scaling of a value
    with at most 24 significant bits); a subnormal product is < 2**-126, which rounds to e4m3 0
    whatever its rounding. The hardware cast rounds to nearest even and saturates finite values
    and Inf to 448 (0x7E); NaN gives 0x7F. Or-ing the sign bit then gives the contract's byte for
    every x (-NaN -> 0xFF, -Inf -> 0xFE, -tiny -> 0x80). nan_scale: E may be 0xFF (any-scale
    cast), whose bytes are all NaN (0x7F | sign).
    """
    y = lax.bitcast_convert_type((el.mag * _pow2_k(scale)).astype(jnp.float8_e4m3fn), jnp.uint8)
    y = y | el.sign8
    if nan_scale:
        y = y | jnp.where(scale == 0xFF, jnp.int32(0x7F), jnp.int32(0)).astype(jnp.uint8)
    return y


def _element_path(mode: str, any_scale: bool):
    """(elements, cast) of an element path: ``el = elements(bits)`` once per chunk, then
    ``cast(el, E)`` per plane. any_scale: E are given bytes (any value, 0xFF = NaN), else the
    block's own scale (quantize)."""
    if mode == NATIVE:
        return _native_elements, functools.partial(_cast_native, nan_scale=any_scale)
    cast = _cast_any if any_scale else _cast_own
    return _elements, lambda el, e: cast(el, e, mode)


# ---------------------------------------------------------------------------------------------
# Kernels. Refs are blocks of: x (BM, BK); row planes (BM, BK), (BM, BK/32); col planes (BM, BK),
# (BM/32, BK). Chunk (i, j) = rows [32 i, 32 i + 32), columns [CK j, CK j + CK) of the tile.


class _Chunking(NamedTuple):
    """How a program walks its (BM, BK) tile: (32, CK) chunks, CK = 32 * nb."""

    bm: int
    bk: int
    ck: int
    preload: bool

    @property
    def nb(self) -> int:  # rowwise blocks per chunk row
        return self.ck // _BS

    def chunks(self, x_ref):
        """(i, j, rows, cols, x chunk) for every chunk. preload: all loads are issued before any
        math, so a program keeps its whole tile in flight (Triton keeps the IR order)."""
        idx = [(i, j, pl.ds(i * _BS, _BS), pl.ds(j * self.ck, self.ck))
               for i in range(self.bm // _BS) for j in range(self.bk // self.ck)]
        if not self.preload:
            return ((*ix, x_ref[ix[2], ix[3]]) for ix in idx)  # each load right before use
        loaded = [x_ref[rows, cols] for _, _, rows, cols in idx]
        return [(*ix, x) for ix, x in zip(idx, loaded, strict=True)]

    def row_scales(self, j: int):  # this chunk's columns of a (BM, BK/32) rowwise-scale block
        return pl.ds(j * self.nb, self.nb)

    def row_max(self, v):
        """(32, CK) -> (32, CK/32): max over each 1x32 block."""
        if self.nb == 1:
            return jnp.max(v, axis=1, keepdims=True)
        return jnp.max(v.reshape(_BS, self.nb, _BS), axis=2)  # (32, nb, 32): blocks on axis 2

    def row_expand(self, e):
        """(32, CK/32) -> (32, CK), or broadcastable to it: each block's value over its 32."""
        if self.nb == 1:
            return e
        return jnp.broadcast_to(e[:, :, None], (_BS, self.nb, _BS)).reshape(_BS, self.ck)


def _quantize_kernel(x_ref, *refs, rowwise, colwise, ch: _Chunking, mode):
    refs = list(refs)
    rd, rs = (refs.pop(0), refs.pop(0)) if rowwise else (None, None)
    cd, cs = (refs.pop(0), refs.pop(0)) if colwise else (None, None)
    elements, cast = _element_path(mode, any_scale=False)
    for i, j, rows, cols, x in ch.chunks(x_ref):
        el = elements(_fp32_bits(x))
        if rowwise:
            e = _scale_bytes(ch.row_max(el.amax_in), any_bits=False)  # (32, CK/32)
            rs[rows, ch.row_scales(j)] = e.astype(jnp.uint8)
            rd[rows, cols] = cast(el, ch.row_expand(e))
        if colwise:
            e = _scale_bytes(jnp.max(el.amax_in, axis=0, keepdims=True), any_bits=False)
            cs[pl.ds(i, 1), cols] = e.astype(jnp.uint8)  # (1, CK): one per column
            cd[rows, cols] = cast(el, e)


def _amax_kernel(x_ref, *refs, rowwise, colwise, ch: _Chunking):
    refs = list(refs)
    ra = refs.pop(0) if rowwise else None
    ca = refs.pop(0) if colwise else None
    for i, j, rows, cols, x in ch.chunks(x_ref):
        a = _fp32_bits(x) & _ABS
        a0 = jnp.where(a > _INF, jnp.int32(0), a)
        if rowwise:
            ra[rows, ch.row_scales(j)] = lax.bitcast_convert_type(ch.row_max(a0), jnp.float32)
        if colwise:
            m = jnp.max(a0, axis=0, keepdims=True)
            ca[pl.ds(i, 1), cols] = lax.bitcast_convert_type(m, jnp.float32)


def _cast_kernel(x_ref, *refs, rowwise, colwise, ch: _Chunking, mode):
    refs = list(refs)
    rs = refs.pop(0) if rowwise else None
    cs = refs.pop(0) if colwise else None
    rd = refs.pop(0) if rowwise else None
    cd = refs.pop(0) if colwise else None
    elements, cast = _element_path(mode, any_scale=True)
    for i, j, rows, cols, x in ch.chunks(x_ref):
        el = elements(_fp32_bits(x))
        if rowwise:
            e = rs[rows, ch.row_scales(j)].astype(jnp.int32)  # (32, CK/32)
            rd[rows, cols] = cast(el, ch.row_expand(e))
        if colwise:
            cd[rows, cols] = cast(el, cs[pl.ds(i, 1), cols].astype(jnp.int32))


def _scale_kernel(a_ref, o_ref):
    o_ref[...] = _scale_bytes(lax.bitcast_convert_type(a_ref[...], jnp.int32)).astype(jnp.uint8)


# ---------------------------------------------------------------------------------------------
# pallas_call plumbing.


def _triton_params(num_warps: int):
    # Explicit Triton params select the Triton lowering: with None, jax >= 0.10 lowers
    # pallas_call on GPU with Mosaic GPU (jax_pallas_use_mosaic_gpu defaults to True).
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=num_warps)


def _fit(limit: int, dim: int) -> int:
    """Largest power-of-two multiple of 32 that is <= limit and divides dim (dim % 32 == 0)."""
    b = _BS
    while b * 2 <= limit and dim % (b * 2) == 0:
        b *= 2
    return b


class _Grid(NamedTuple):
    bm: int
    bk: int
    tiles: Tiles

    @classmethod
    def make(cls, kind: str, shape: tuple[int, int], tiles: Tiles | None, dtype,
             mode: str | None = None) -> _Grid:
        if tiles is None:
            name = jnp.dtype(dtype).name
            tiles = DEFAULT_TILES.get((kind, name, mode)) or DEFAULT_TILES[kind, name]
        if tiles.chunk_k not in (32, 64, 128):
            raise ValueError(f"Tiles.chunk_k: expected 32, 64 or 128, got {tiles.chunk_k}")
        m, k = shape
        return cls(_fit(tiles.block_m, m), _fit(tiles.block_k, k), tiles)

    def kernel(self, fn, **kw):
        ch = _Chunking(self.bm, self.bk, min(self.tiles.chunk_k, self.bk), self.tiles.preload)
        return functools.partial(fn, ch=ch, **kw)

    def grid(self, shape):
        return (shape[0] // self.bm, shape[1] // self.bk)

    def full(self):  # (BM, BK) blocks of (M, K) arrays
        return pl.BlockSpec((self.bm, self.bk), lambda i, j: (i, j))

    def row_scale(self):  # (BM, BK/32) blocks of (M, K/32) arrays
        return pl.BlockSpec((self.bm, self.bk // _BS), lambda i, j: (i, j))

    def col_scale(self):  # (BM/32, BK) blocks of (M/32, K) arrays
        return pl.BlockSpec((self.bm // _BS, self.bk), lambda i, j: (i, j))

    def call(self, kernel, shape, in_specs, outs, interpret):
        """outs: list of (BlockSpec, ShapeDtypeStruct)."""
        return pl.pallas_call(
            kernel,
            out_shape=[o[1] for o in outs],
            grid=self.grid(shape),
            in_specs=in_specs,
            out_specs=[o[0] for o in outs],
            compiler_params=_triton_params(self.tiles.num_warps),
            interpret=interpret,
            name="mxfp8_" + kernel.func.__name__.strip("_"),
        )


def _check_2d(x, what: str) -> tuple[int, int]:
    if x.ndim != 2 or x.shape[0] % _BS or x.shape[1] % _BS or 0 in x.shape:
        raise ValueError(f"{what}: expected 2-D (M, K) with M, K multiples of 32, got {x.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"{what}: expected bfloat16 or float32 x, got {x.dtype}")
    return int(x.shape[0]), int(x.shape[1])


def _mode(e4m3_cast: str | None, interpret: bool) -> str:
    """The element path: None -> COMPILED_MODE for compiled kernels, E4M3_CAST in interpret."""
    if e4m3_cast is None:
        return E4M3_CAST if interpret else COMPILED_MODE
    if e4m3_cast not in KERNEL_MODES:
        raise ValueError(f"e4m3_cast: expected one of {KERNEL_MODES} or None, got {e4m3_cast!r}")
    if e4m3_cast == NATIVE and interpret:
        raise ValueError(
            "e4m3_cast='native' needs unflushed fp32 subnormals, which the Pallas interpreter "
            "(XLA:CPU) flushes; use 'float' or 'int' with interpret=True (the default, None, "
            "picks 'float' there)"
        )
    return e4m3_cast


def _as_f8(y, dtype):
    return None if y is None else lax.bitcast_convert_type(y, dtype)


# ---------------------------------------------------------------------------------------------
# Public 2-D entry points.


def quantize_2d(x, *, rowwise: bool, colwise: bool, interpret: bool = False,
                tiles: Tiles | None = None, e4m3_cast: str | None = None) -> Planes:
    """MXFP8 planes of a 2-D (M, K) bf16/fp32 x (M, K multiples of 32), x read once.

    rowwise: data float8_e4m3fn (M, K), scale float8_e8m0fnu (M, K/32), blocks 1x32 along K.
    colwise: data float8_e4m3fn (M, K) (not transposed), scale (M/32, K), blocks 32x1 along M.
    Bytes equal the ``xla`` backend's (DESIGN.md 3). e4m3_cast: the element path (KERNEL_MODES;
    None: "native" compiled, "float" in interpret mode); tiles: None for DEFAULT_TILES.
    """
    shape = _check_2d(x, "quantize_2d")
    if not (rowwise or colwise):
        raise ValueError("quantize_2d: rowwise=False and colwise=False asks for nothing")
    mode = _mode(e4m3_cast, bool(interpret))
    return _quantize_2d(x, bool(rowwise), bool(colwise), bool(interpret),
                        _Grid.make("quantize", shape, tiles, x.dtype, mode), mode)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _quantize_2d(x, rowwise, colwise, interpret, g: _Grid, mode) -> Planes:
    m, k = x.shape
    outs = []
    if rowwise:
        outs += [(g.full(), jax.ShapeDtypeStruct((m, k), jnp.uint8)),
                 (g.row_scale(), jax.ShapeDtypeStruct((m, k // _BS), jnp.uint8))]
    if colwise:
        outs += [(g.full(), jax.ShapeDtypeStruct((m, k), jnp.uint8)),
                 (g.col_scale(), jax.ShapeDtypeStruct((m // _BS, k), jnp.uint8))]
    kernel = g.kernel(_quantize_kernel, rowwise=rowwise, colwise=colwise, mode=mode)
    res = list(g.call(kernel, (m, k), [g.full()], outs, interpret)(x))
    rd, rs = (res.pop(0), res.pop(0)) if rowwise else (None, None)
    cd, cs = (res.pop(0), res.pop(0)) if colwise else (None, None)
    e4, e8 = jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    return Planes(_as_f8(rd, e4), _as_f8(rs, e8), _as_f8(cd, e4), _as_f8(cs, e8))


def block_amax_2d(x, *, rowwise: bool, colwise: bool, interpret: bool = False,
                  tiles: Tiles | None = None) -> BlockAmax:
    """float32 block amax of 2-D (M, K) bf16/fp32 x, NaN ignored, Inf counts (subnormals kept).

    rowwise (M, K/32) over 1x32 blocks along K; colwise (M/32, K) over 32x1 blocks along M.
    """
    shape = _check_2d(x, "block_amax_2d")
    if not (rowwise or colwise):
        raise ValueError("block_amax_2d: rowwise=False and colwise=False asks for nothing")
    return _block_amax_2d(x, bool(rowwise), bool(colwise), bool(interpret),
                          _Grid.make("amax", shape, tiles, x.dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _block_amax_2d(x, rowwise, colwise, interpret, g: _Grid) -> BlockAmax:
    m, k = x.shape
    outs = []
    if rowwise:
        outs.append((g.row_scale(), jax.ShapeDtypeStruct((m, k // _BS), jnp.float32)))
    if colwise:
        outs.append((g.col_scale(), jax.ShapeDtypeStruct((m // _BS, k), jnp.float32)))
    kernel = g.kernel(_amax_kernel, rowwise=rowwise, colwise=colwise)
    res = list(g.call(kernel, (m, k), [g.full()], outs, interpret)(x))
    return BlockAmax(res.pop(0) if rowwise else None, res.pop(0) if colwise else None)


def cast_2d(x, rowwise_scale=None, colwise_scale=None, *, interpret: bool = False,
            tiles: Tiles | None = None, e4m3_cast: str | None = None) -> SliceCast:
    """e4m3 planes (M, K) of 2-D bf16/fp32 x with GIVEN E8M0 scales (float8_e8m0fnu or uint8).

    rowwise_scale (M, K/32) for 1x32 blocks along K, colwise_scale (M/32, K) for 32x1 blocks
    along M; either may be None (that plane is None). Any byte is valid (0xFF gives NaN).
    """
    m, k = _check_2d(x, "cast_2d")
    rs = None if rowwise_scale is None else scale_bytes(
        rowwise_scale, (m, k // _BS), "cast_2d rowwise_scale")
    cs = None if colwise_scale is None else scale_bytes(
        colwise_scale, (m // _BS, k), "cast_2d colwise_scale")
    if rs is None and cs is None:
        raise ValueError("cast_2d: pass rowwise_scale and/or colwise_scale")
    mode = _mode(e4m3_cast, bool(interpret))
    g = _Grid.make("cast", (m, k), tiles, x.dtype, mode)
    return _cast_2d(x, rs, cs, bool(interpret), g, mode)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _cast_2d(x, rs, cs, interpret, g: _Grid, mode) -> SliceCast:
    m, k = x.shape
    rowwise, colwise = rs is not None, cs is not None
    in_specs, args, outs = [g.full()], [x], []
    if rowwise:
        in_specs.append(g.row_scale())
        args.append(rs)
    if colwise:
        in_specs.append(g.col_scale())
        args.append(cs)
    outs = [(g.full(), jax.ShapeDtypeStruct((m, k), jnp.uint8))] * (int(rowwise) + int(colwise))
    kernel = g.kernel(_cast_kernel, rowwise=rowwise, colwise=colwise, mode=mode)
    res = list(g.call(kernel, (m, k), in_specs, outs, interpret)(*args))
    e4 = jnp.float8_e4m3fn
    return SliceCast(_as_f8(res.pop(0), e4) if rowwise else None,
                     _as_f8(res.pop(0), e4) if colwise else None)


_SCALE_BLOCK = 1024  # elements per program of the scale kernel


def scales_from_amax(amax, *, interpret: bool = False):
    """float8_e8m0fnu E8M0 bytes (same shape) from float32 block amax (any shape), as ``xla``.

    amax should be >= 0; +Inf gives 0xFE, NaN 0xFF, -0.0 0x00 (other negatives 0xFE, as ``xla``).
    """
    if amax.dtype != jnp.float32:
        raise TypeError(f"scales_from_amax: expected float32 amax, got {amax.dtype}")
    return _scales_from_amax(amax, bool(interpret))


@functools.partial(jax.jit, static_argnums=(1,))
def _scales_from_amax(amax, interpret):
    n = amax.size
    if n == 0:
        return jnp.zeros(amax.shape, jnp.float8_e8m0fnu)
    block = min(_SCALE_BLOCK, 1 << (n - 1).bit_length())  # power of two >= n, capped
    padded = -(-n // block) * block
    flat = jnp.pad(amax.reshape(-1), (0, padded - n))  # (padded,) zeros after the n values
    spec = pl.BlockSpec((block,), lambda i: (i,))
    out = pl.pallas_call(
        _scale_kernel, out_shape=jax.ShapeDtypeStruct((padded,), jnp.uint8),
        grid=(padded // block,), in_specs=[spec], out_specs=spec, interpret=interpret,
        compiler_params=_triton_params(4), name="mxfp8_scales_from_amax",
    )(flat)
    return lax.bitcast_convert_type(out[:n].reshape(amax.shape), jnp.float8_e8m0fnu)
