"""Framework-free oracle of the MXFP8 recipe (numpy + ml_dtypes), written from DESIGN.md 3.

Deliberately slow and obvious: numpy float32 arithmetic is IEEE (it keeps subnormals), so the
contract's steps are written exactly as stated. Every implementation in the repo must match
these bytes. Nothing here imports jax or torch.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32
E4M3 = ml_dtypes.float8_e4m3fn


def e8m0_from_s(s: np.ndarray) -> np.ndarray:
    """Step 3: E8M0 byte of fp32 s with the exponent rounded up (RCEIL)."""
    bits = np.asarray(s, np.float32).view(np.uint32).astype(np.int64)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    up = (m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
    out = e + up
    out = np.where(np.isposinf(s), 0xFE, out)
    out = np.where(np.isnan(s), 0xFF, out)
    out = np.where(s == 0, 0x00, out)
    return out.astype(np.uint8)


def scale_bytes(amax: np.ndarray) -> np.ndarray:
    """Steps 2-3: s = fp32_rn(amax * fp32(1/448)), then RCEIL."""
    amax = np.asarray(amax, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        s = amax * (np.float32(1.0) / np.float32(448.0))
    return e8m0_from_s(s)


def cast_elements(x32: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Step 4: uint8 e4m3 bytes of e4m3_rn_satfinite(fp32(x) * 2^(127 - E)), elementwise."""
    factor = np.ldexp(np.float32(1.0), 127 - scale.astype(np.int32)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x32 * factor
    y = np.where(np.isnan(x32), x32, np.clip(y, -448.0, 448.0)).astype(np.float32)
    return y.astype(E4M3).view(np.uint8)


def _block_amax(x32: np.ndarray, axis: int) -> np.ndarray:
    return np.max(np.where(np.isnan(x32), np.float32(0), np.abs(x32)), axis=axis)


def block_amax(x32: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Step 1 for both planes of a 2-D (M, K) fp32 array: rowwise (M, K/block) amax of 1 x block
    blocks along K, columnwise (M/block, K) of block x 1 blocks along M."""
    m, k = x32.shape
    assert m % block == 0 and k % block == 0
    return (_block_amax(x32.reshape(m, k // block, block), axis=2),
            _block_amax(x32.reshape(m // block, block, k), axis=1))


def quantize(x: np.ndarray, block: int = BLOCK) -> dict[str, np.ndarray]:
    """Both planes of a 2-D (M, K) bf16/fp32 array as uint8 arrays (data (M, K), scales).
    ``block``: the block size (32: MXFP8; the tests' second format uses 16)."""
    x32 = np.asarray(x).astype(np.float32)
    row_amax, col_amax = block_amax(x32, block)  # (M, K/block), (M/block, K)
    rs, cs = scale_bytes(row_amax), scale_bytes(col_amax)
    return {
        "rowwise_data": cast_elements(x32, np.repeat(rs, block, axis=1)),
        "rowwise_scale": rs,
        "colwise_data": cast_elements(x32, np.repeat(cs, block, axis=0)),
        "colwise_scale": cs,
    }


def dequantize(data_u8: np.ndarray, scale_u8: np.ndarray) -> np.ndarray:
    """Step 5: fp32 e4m3(y) * 2^(E - 127), scales already expanded to data's shape."""
    y = data_u8.view(E4M3).astype(np.float64)
    e = scale_u8.astype(np.int32) - 127
    with np.errstate(over="ignore"):  # 448 * 2^127 (an Inf block) overflows to Inf, as in fp32
        out = np.ldexp(y, e).astype(np.float32)  # exact: few significant bits, fp64 range
    return np.where(scale_u8 == 0xFF, np.float32(np.nan), out)


def reblock(data_u8: np.ndarray, scale_u8: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """DESIGN.md 11's re-block of a (R, K) plane blocked 1x32 along K: groups of ``rows`` rows x
    128 columns (rows=1: 1x128 blocks; rows=128: 128x128 tiles) take the largest E8M0 scale of
    their 1x32 blocks; each element becomes e4m3_rn(value / 2^(S - 127)) (float64, ml_dtypes'
    rounding). Returns (uint8 data (R, K), uint8 scales (R/rows, K/128))."""
    r, k = data_u8.shape
    top = scale_u8.reshape(r // rows, rows, k // 128, 4).max(axis=(1, 3))
    y = data_u8.view(E4M3).astype(np.float64)
    shift = (scale_u8.astype(np.int64)
             - np.repeat(np.repeat(top, rows, axis=0), 4, axis=1).astype(np.int64))
    codes = np.ldexp(y, np.repeat(shift, BLOCK, axis=1))  # exact in float64
    return codes.astype(E4M3).view(np.uint8), top
