"""The exact E8M0 scale rule of MXFP8, tabulated in integer arithmetic.

The E8M0 scale byte of a block is a monotone step function of the block amax (DESIGN.md 3, steps
2-3): ``s = fp32_rn(amax * fp32(1/448))`` and then the exponent of ``s`` rounded *up* (RCEIL).
Evaluating that with float arithmetic on XLA:CPU is wrong for tiny blocks, because XLA flushes
subnormal floats to zero there (``amax * c`` of a subnormal amax gives 0, and a subnormal ``s``
flushes to 0 as well). We therefore never evaluate it in floats on device: the step function is
tabulated once, in exact integer arithmetic, as the 254 amax thresholds at which the byte steps
up, and the device code counts how many thresholds the amax bit pattern has reached
(``searchsorted`` over uint32 bit patterns, which order like the non-negative floats they encode).
The test oracle computes the same byte the slow, obvious way (numpy float32, which keeps
subnormals) and the tests compare the two for every threshold and its neighbours.
"""

from __future__ import annotations

import numpy as np

from common.formats import E4M3_MAX, E8M0_INF, E8M0_NAN

__all__ = [
    "e8m0_byte_exact",
    "e8m0_thresholds",
    "fp32_reciprocal_of_max",
]

_FP32_INF_BITS = 0x7F800000


def fp32_reciprocal_of_max() -> np.float32:
    """``fp32(1/448)``, rounded to nearest (0x3B124925)."""
    return np.float32(1.0) / np.float32(E4M3_MAX)


def _fp32_parts(bits: int) -> tuple[int, int]:
    """(integer significand N, exponent e) with value N * 2**e, for a finite non-negative fp32."""
    biased, mant = bits >> 23, bits & 0x7FFFFF
    if biased == 0:
        return mant, -149
    return mant | 0x800000, biased - 150


def _round_to_fp32_bits(n: int, e: int) -> int:
    """Bits of fp32_rn(n * 2**e) for integers n >= 0 (round to nearest even, subnormals kept)."""
    if n == 0:
        return 0
    top = n.bit_length() - 1 + e  # floor(log2(value))
    quantum = max(top - 23, -149)
    shift = quantum - e
    if shift <= 0:
        q = n << -shift
    else:
        q, r = divmod(n, 1 << shift)
        half = 1 << (shift - 1)
        if r > half or (r == half and q & 1):
            q += 1
    # q * 2**quantum with q < 2**24 (or == 2**24 after a carry, which is the next binade's 2**23).
    if q >= 1 << 24:
        q >>= 1
        quantum += 1
    if quantum == -149 and q < 1 << 23:
        return q  # subnormal
    biased = quantum + 150
    if biased >= 0xFF:
        return _FP32_INF_BITS
    return (biased << 23) | (q & 0x7FFFFF)


def _rceil_byte(s_bits: int) -> int:
    """E8M0 byte of a non-negative fp32 ``s`` with the exponent rounded up (DESIGN.md 3, step 3)."""
    if s_bits > _FP32_INF_BITS:
        return E8M0_NAN
    if s_bits == _FP32_INF_BITS:
        return E8M0_INF
    e, m = s_bits >> 23, s_bits & 0x7FFFFF
    if m > 0 and e != 0xFE and not (e == 0 and m <= 0x400000):
        e += 1
    return e


def e8m0_byte_exact(amax_bits: int) -> int:
    """E8M0 scale byte for a block whose fp32 amax has bit pattern ``amax_bits`` (exact integers).

    NaN amax cannot occur (NaN is ignored in the amax); +Inf maps to 0xFE by the contract.
    """
    if amax_bits >= _FP32_INF_BITS:
        return E8M0_INF if amax_bits == _FP32_INF_BITS else E8M0_NAN
    na, ea = _fp32_parts(amax_bits)
    nc, ec = _fp32_parts(int(fp32_reciprocal_of_max().view(np.uint32)))
    return _rceil_byte(_round_to_fp32_bits(na * nc, ea + ec))


def _build_thresholds() -> np.ndarray:
    # thresholds[b - 1] = smallest amax bit pattern whose byte is >= b, for b = 1 .. 254.
    # The byte is monotone in the amax, so each threshold is found by bisection.
    out: np.ndarray = np.empty(E8M0_INF, dtype=np.uint32)
    lo_start = 0
    for b in range(1, E8M0_INF + 1):
        lo, hi = lo_start, _FP32_INF_BITS  # byte(hi) == 0xFE >= b
        while lo < hi:
            mid = (lo + hi) // 2
            if e8m0_byte_exact(mid) >= b:
                hi = mid
            else:
                lo = mid + 1
        out[b - 1] = lo
        lo_start = lo
    return out


_THRESHOLDS = _build_thresholds()


def e8m0_thresholds() -> np.ndarray:
    """uint32[254]: entry b-1 is the smallest fp32 amax bit pattern whose E8M0 byte is >= b.

    ``byte(amax) == #{b : thresholds[b-1] <= amax_bits}`` (a ``searchsorted(..., side="right")``).
    Bytes that no finite amax reaches share the +Inf threshold, so +Inf maps to 0xFE.
    """
    return _THRESHOLDS.copy()


# Sanity of the tabulation itself (internal invariant, cheap): the canonical boundary 448 * 2**k
# maps to byte 127 + k, and one ulp above it to the next byte.
assert e8m0_byte_exact(int(np.float32(448.0).view(np.uint32))) == 127
assert e8m0_byte_exact(int(np.float32(448.0).view(np.uint32)) + 1) == 128
