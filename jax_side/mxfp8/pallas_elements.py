"""Element and scale math of the ``pallas`` kernels, on int32 bit patterns (plain jnp: used
inside the kernel bodies of ``pallas_kernels``, and testable on its own).

Design note: docs/pallas_kernel.md. Contract: DESIGN.md 3. Every path gives the ``xla`` bytes.

FTZ-proof paths (``ElementPath.FLOAT`` / ``INT``; interpret mode runs on XLA:CPU, which flushes
subnormal floats; Triton may or may not): every value that can be subnormal is handled on int32
bit patterns, and every float operation has normal operands and an exact normal (or discarded)
result.

- x is widened to fp32 bits by a shift (bf16) or a bitcast (fp32); ``a = bits & 0x7FFFFFFF``.
- amax: max over ``a`` with NaN patterns zeroed (non-negative floats order like their bits).
- scale byte (:func:`scale_bytes_of_bits`): byte >= 2 exactly when amax_bits >= T[1] (T =
  formats' threshold table); then amax and s = fp32_rn(amax * fp32(1/448)) are normal, so one
  float multiply is exact under any denormal mode and RCEIL is ``(s_bits + 0x7FFFFF) >> 23``.
  Below T[1] the byte is ``amax_bits >= T[0]``; +Inf (and, as in ``xla``, NaN or negative) ->
  0xFE.
- element, v = |x| * 2**k with k = 127 - E, as an exponent add on "extended" bits
  (:func:`elements`): ``ext`` = a for normal x; for subnormal x the bits of |x| * 2**64
  (computed as ``bitcast(a | 2**23) * 2**64 - 2**-62``, exact and normal) less ``64 << 23``,
  i.e. |x| with an exponent field <= 0. ``ext + (k << 23)`` is then the exact fp32 bits of v
  whenever v >= 2**-126; anything smaller is clamped at 0 (v < 2**-126 rounds to e4m3 0 anyway).
  :func:`cast_own` (scale from the block's own amax) needs no saturation clamp; :func:`cast_any`
  (given scales) clamps ``ext`` at the bits of 448 * 2**-k first. v in [0, 448] -> e4m3 by the
  hardware cast (``FLOAT``: cvt.rn.satfinite.e4m3x2.f32) or integer RNE (``INT``); Inf and NaN
  are cast as 448 (0x7E), then an or-ed byte adds the sign and, for NaN (or scale 0xFF), the low
  bit (0x7F). All selects act on 32-bit values (byte selects cost unpacking).

``ElementPath.NATIVE`` (:func:`cast_native`; compiled kernels only, the GPU default): |x| * 2**k
as one fp32 multiply, the hardware cast (RNE, satfinite: Inf -> 448, NaN -> 0x7F), then the sign
or-ed in. Exact where fp32 subnormals are not flushed (Triton's GPU code: no .ftz); roughly half
the per-element operations of the FTZ-proof paths (counted in the source, not the SASS).
Interpret mode (XLA:CPU flushes) refuses it and uses ``FLOAT``. Byte-identical to ``xla`` on the
GPU (test_gpu_*).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from common.enums import Parseable
from common.formats import E4M3_MAX
from jax_side.mxfp8.e8m0 import e8m0_thresholds, fp32_reciprocal_of_max
from jax_side.mxfp8.reblock import shift_factor

__all__ = [
    "COMPILED_DEFAULT",
    "FTZ_PROOF_PATHS",
    "INTERPRET_DEFAULT",
    "ABS_MASK",
    "INF_BITS",
    "ElementFns",
    "ElementPath",
    "Elements",
    "NativeElements",
    "cast_any",
    "cast_native",
    "cast_own",
    "cast_shift_native",
    "e4m3_from_v",
    "element_fns",
    "elements",
    "fp32_bits",
    "native_elements",
    "scale_bytes_of_bits",
]

ABS_MASK = np.int32(0x7FFFFFFF)
INF_BITS = np.int32(0x7F800000)
_MIN_NORMAL = np.int32(0x00800000)
_T0 = np.int32(e8m0_thresholds()[0])  # smallest amax bits with byte >= 1
_T1 = np.int32(e8m0_thresholds()[1])  # smallest amax bits with byte >= 2 (s normal from here)
_RECIP = np.float32(fp32_reciprocal_of_max())
_E4M3_MAX_BITS = np.int32(np.float32(E4M3_MAX).view(np.int32))  # 448 = 1.75 * 2**8


class ElementPath(Parseable, enum.Enum, what="e4m3_cast element path", hint=" (or None)"):
    """How the kernels turn x and its scale byte into e4m3 bytes (module docstring)."""

    FLOAT = "float"  # FTZ-proof; v -> e4m3 by lax convert (Triton: tt.fp_to_fp rtne)
    INT = "int"  # FTZ-proof; v -> e4m3 by integer round-to-nearest-even on v's bits
    NATIVE = "native"  # one fp32 multiply + hardware cast: compiled (unflushed) kernels only

    @property
    def ftz_proof(self) -> bool:
        """Exact also where fp32 subnormals are flushed (the Pallas interpreter, XLA:CPU)."""
        return self is not ElementPath.NATIVE


FTZ_PROOF_PATHS = tuple(p for p in ElementPath if p.ftz_proof)
INTERPRET_DEFAULT = ElementPath.FLOAT  # the path of interpret mode
COMPILED_DEFAULT = ElementPath.NATIVE  # the path of compiled (GPU) kernels


def fp32_bits(x: jax.Array) -> jax.Array:
    """int32 bits of fp32(x) for bf16 / fp32 x, without a float convert."""
    if x.dtype == jnp.bfloat16:
        return lax.shift_left(lax.bitcast_convert_type(x, jnp.int16).astype(jnp.int32), 16)
    return lax.bitcast_convert_type(x, jnp.int32)


class Elements(NamedTuple):
    """Per-element values of a chunk that both planes share (FTZ-proof paths)."""

    amax_in: jax.Array  # int32 |x| bits, NaN patterns zeroed: the block-amax operand
    ext: jax.Array  # int32 |x| as extended fp32 bits (exponent field <= 0 for subnormal x)
    special: jax.Array  # bool: x is +-Inf or NaN (cast as 448, then or8 makes NaN 0x7F)
    or8: jax.Array  # uint8 or-ed into the e4m3 byte: the sign bit, and 0x01 for NaN x


def elements(bits: jax.Array) -> Elements:
    """From int32 fp32 bits. Subnormal x: |x| * 2**64 = f * 2**64 - 2**-62 with
    f = bitcast(a | 2**23) = 2**-126 + |x|; all operands and the (exact) result are normal or 0, so
    no denormal mode changes it, and its bits less 64 << 23 encode |x| with exponent field <= 0."""
    a = bits & ABS_MASK
    nan = a > INF_BITS
    f = lax.bitcast_convert_type(a | _MIN_NORMAL, jnp.float32)
    scaled = f * jnp.float32(2.0**64) - jnp.float32(2.0**-62)
    sub = lax.bitcast_convert_type(scaled, jnp.int32) - jnp.int32(64 << 23)
    sign_nan = lax.shift_right_logical(bits, jnp.int32(24)) & jnp.int32(0x80)
    return Elements(
        amax_in=jnp.where(nan, jnp.int32(0), a),
        ext=jnp.where(a < _MIN_NORMAL, sub, a),
        special=a >= INF_BITS,
        or8=(sign_nan | jnp.where(nan, jnp.int32(1), jnp.int32(0))).astype(jnp.uint8),
    )


def scale_bytes_of_bits(amax_bits: jax.Array, *, any_bits: bool = True) -> jax.Array:
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
        nan = (amax_bits & ABS_MASK) > INF_BITS
        neg_zero = amax_bits == jnp.int32(-(2**31))
        byte = jnp.where((amax_bits < 0) | (amax_bits > INF_BITS), jnp.int32(0xFE), byte)
        byte = jnp.where(neg_zero, jnp.int32(0), byte)
        byte = jnp.where(nan, jnp.int32(0xFF), byte)
    return byte


def _kshift(scale: jax.Array) -> jax.Array:
    """int32 (127 - E) << 23: adding it to fp32 bits multiplies by 2**(127 - E)."""
    return lax.shift_left(jnp.int32(127) - scale, jnp.int32(23))


def e4m3_from_v(v: jax.Array, path: ElementPath) -> jax.Array:
    """uint8 e4m3 magnitude of non-negative fp32 v < 464 (subnormal v may be flushed: -> 0), by
    an FTZ-proof path."""
    if path is ElementPath.FLOAT:
        return lax.bitcast_convert_type(v.astype(jnp.float8_e4m3fn), jnp.uint8)
    assert path is ElementPath.INT, path
    vb = lax.bitcast_convert_type(v, jnp.int32)
    # Normal e4m3 (v >= 2**-6): RNE of the mantissa to 3 bits, then rebias 127 -> 7 (120 << 3).
    odd = lax.shift_right_logical(vb, jnp.int32(20)) & jnp.int32(1)
    normal = lax.shift_right_logical(vb + jnp.int32(0x7FFFF) + odd, jnp.int32(20)) - 960
    # Subnormal e4m3: adding 2**14 (ulp 2**-9, the e4m3 subnormal step) rounds v RNE; all normal.
    magic = v + jnp.float32(16384.0)
    sub = lax.bitcast_convert_type(magic, jnp.int32) - jnp.int32(0x46800000)
    return jnp.where(vb < jnp.int32(0x3C800000), sub, normal).astype(jnp.uint8)


def cast_own(el: Elements, scale: jax.Array, path: ElementPath) -> jax.Array:
    """uint8 e4m3 bytes of x * 2**(127 - E) where E came from the block's own amax.

    Then E < 0xFF, Inf only occurs with E = 0xFE, and |x| * 2**(127 - E) < 448 * (1 + 2**-20)
    for finite x (RCEIL never rounds the scale down), so nothing needs clamping: the exponent
    add is exact for results >= 2**-126, anything smaller rounds to e4m3 0 (it is clamped at 0
    only to keep the sign bit clear). Specials are cast as 448 (0x7E); or8 adds sign and NaN bit.
    Every select is on 32-bit values: byte-wise selects cost byte unpacking on the GPU.
    """
    v = jnp.maximum(el.ext + _kshift(scale), jnp.int32(0))
    v = jnp.where(el.special, _E4M3_MAX_BITS, v)
    return e4m3_from_v(lax.bitcast_convert_type(v, jnp.float32), path) | el.or8


def cast_any(el: Elements, scale: jax.Array, path: ElementPath) -> jax.Array:
    """uint8 e4m3 bytes of x * 2**(127 - E) for any E8M0 byte E (0xFF gives NaN).

    ``sat`` = bits of 448 * 2**-k (k = 127 - E) clamps saturating |x| to exactly 448 after the
    shift; where that is above fp32 max (k < -119) no finite x saturates and there is no clamp.
    """
    k = jnp.int32(127) - scale
    sat = jnp.where(k >= -119, lax.shift_left(jnp.int32(135) - k, jnp.int32(23)) | 0x600000,
                    ABS_MASK)
    v = jnp.maximum(jnp.minimum(el.ext, sat) + lax.shift_left(k, jnp.int32(23)), jnp.int32(0))
    nan_scale = scale == 0xFF
    v = jnp.where(el.special | nan_scale, _E4M3_MAX_BITS, v)
    y = e4m3_from_v(lax.bitcast_convert_type(v, jnp.float32), path) | el.or8
    return y | jnp.where(nan_scale, jnp.int32(1), jnp.int32(0)).astype(jnp.uint8)


class NativeElements(NamedTuple):
    """Per-element values of a chunk for the native cast (compiled kernels only)."""

    amax_in: jax.Array  # int32 |x| bits, NaN patterns zeroed: the block-amax operand
    mag: jax.Array  # float32 |x| (subnormals kept: the GPU does not flush them)
    sign8: jax.Array  # uint8 0x80 where x is negative (NaN included), else 0


def native_elements(bits: jax.Array) -> NativeElements:
    a = bits & ABS_MASK
    return NativeElements(
        amax_in=jnp.where(a > INF_BITS, jnp.int32(0), a),
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


def cast_native(el: NativeElements, scale: jax.Array, nan_scale: bool) -> jax.Array:
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


_GRID_LO = np.int32(0x3C800000)  # 2**-6, e4m3's smallest normal: below it the grid is 2**-9
_GRID_HI = np.int32(0x43800000)  # 2**8, the binade of 448 (finite |x| * 2**k stays below 512)
_TO_MAGIC = np.int32(20 << 23)  # 2**E -> 2**(E + 20), whose fp32 ulp is 2**(E - 3)


def cast_shift_native(el: NativeElements, scale: jax.Array, diff: jax.Array) -> jax.Array:
    """uint8 ``reblock.shift_codes(cast_native(el, scale, nan_scale=False), diff)`` (the
    block's own scale E, then the codes shifted by int32 ``diff <= 0`` to a merged block's
    scale, each rounded to nearest even) with one e4m3 cast instead of three conversions.

    y = |x| * 2**(127 - E) (as ``cast_native``) is rounded onto e4m3's grid in fp32:
    ``(y + m) - m`` with m = 2**(b + 20), b the binade of y clamped to [-6, 8], whose fp32
    ulp 2**(b - 3) is e4m3's spacing there (3 mantissa bits; 2**-9 below 2**-6, the
    subnormals): fp32's round-to-nearest-even of the sum is e4m3's of y, and the difference is
    exact. That value (at most 4 significant bits) times 2**diff is exact (>= 2**-39, normal),
    and the hardware cast rounds it the second time (RNE; e4m3 subnormals included). A finite
    y is below 448 * (1 + 2**-20) (RCEIL), so it lands on 448 at most, as the first cast's
    satfinite gives. Inf and NaN stay themselves through the sum; Inf comes with diff 0 (its
    block's byte is 0xFE, the largest), so the cast saturates it to 448 as cast_native does,
    and NaN gives 0x7F, kept as shift_codes keeps it; the sign is or-ed in last. Compiled
    kernels only, as ``cast_native`` (a flushed y is 0 either way: it rounds to 0 at any
    scale, so XLA:CPU gives the same bytes where it gives ``cast_native``'s)."""
    y = el.mag * _pow2_k(scale)
    binade = jnp.clip(lax.bitcast_convert_type(y, jnp.int32) & INF_BITS, _GRID_LO, _GRID_HI)
    m = lax.bitcast_convert_type(binade + _TO_MAGIC, jnp.float32)
    q = (y + m) - m
    shifted = (q * shift_factor(diff)).astype(jnp.float8_e4m3fn)
    return lax.bitcast_convert_type(shifted, jnp.uint8) | el.sign8


class ElementFns(NamedTuple):
    """An element path as two functions: ``el = elements(bits)`` once per chunk, then
    ``cast(el, E)`` per plane."""

    elements: Callable[[jax.Array], Elements | NativeElements]
    cast: Callable[[Elements | NativeElements, jax.Array], jax.Array]


def element_fns(path: ElementPath, any_scale: bool) -> ElementFns:
    """The functions of ``path``. any_scale: E are given bytes (any value, 0xFF = NaN), else the
    block's own scale (quantize)."""
    if path is ElementPath.NATIVE:
        return ElementFns(native_elements, functools.partial(cast_native, nan_scale=any_scale))
    cast = cast_any if any_scale else cast_own
    return ElementFns(elements, functools.partial(_cast_with_path, cast, path))


def _cast_with_path(
    cast: Callable[[Elements, jax.Array, ElementPath], jax.Array],
    path: ElementPath, el: Elements, scale: jax.Array,
) -> jax.Array:
    return cast(el, scale, path)
