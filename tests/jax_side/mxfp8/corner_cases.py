"""Named MXFP8 corner cases with their expected bytes, derived by hand from DESIGN.md 3.

Each case is one block of 32 values (the listed values first, zeros after) and the bytes the
recipe must produce: the E8M0 scale byte and the e4m3 byte of each listed value. Notation:
c = fp32(1/448) = 0x3B124925 (slightly above 1/448); e4m3 byte = sign | exp+7 << 3 | mantissa.
``special_mix`` makes random whole tensors with the same kinds of values mixed in.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)

_TINY_S_EDGE = np.float32(1.75 * 2.0**-119)  # 448 * 2^-127: s lands exactly on 2^-127
_NEXT_UP = np.nextafter(_TINY_S_EDGE, np.float32(1))
_TWO_UP = np.nextafter(_NEXT_UP, np.float32(1))


class Corner(NamedTuple):
    name: str
    values: tuple[float, ...]
    dtype: np.dtype
    scale: int
    elements: tuple[int, ...]
    why: str


CORNERS: tuple[Corner, ...] = (
    Corner("all_zero", (0.0,), F32, 0x00, (0x00,),
           "amax 0 -> s 0 -> byte 0x00; 0 * 2^127 = 0"),
    Corner("amax_448", (448.0, 1.0), F32, 0x7F, (0x7E, 0x38),
           "s = rn(448c) = 1.0 exactly, m = 0 -> E 127; 448 = 1.75*2^8 -> 0 1111 110"),
    Corner("amax_464", (464.0, 1.0), F32, 0x80, (0x76, 0x30),
           "s = 1.0357 -> rounds up to 2^1; 464/2 = 232 ties 224|240 -> even 224 = 0x76"),
    Corner("amax_896", (896.0,), F32, 0x80, (0x7E,),
           "448*2: s = 2.0 exactly -> E 128; 896/2 = 448"),
    Corner("amax_450_bf16", (450.0,), BF16, 0x80, (0x76,),
           "first bf16 above 448: s > 1 -> 2^1; 225 -> 224"),
    Corner("amax_0p875", (0.875, 0.5), F32, 0x76, (0x7E, 0x78),
           "s = rn(0.875c) = 2^-9 exactly (m = 0) -> E 118; 0.875*2^9 = 448, 0.5*2^9 = 256"),
    Corner("rne_ties", (448.0, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, -0.0, -17.0), F32, 0x7F,
           (0x7E, 0x58, 0x5A, 0x00, 0x02, 0x80, 0xD8),
           "scale 1: 17 ties 16|18 -> 16; 19 ties 18|20 -> 20; 2^-10 ties 0|2^-9 -> 0; "
           "3*2^-10 ties 2^-9|2^-8 -> 2^-8 (sub 010); -0 keeps its sign"),
    Corner("nan_ignored", (np.nan, 2.0, 1.0, -np.nan), F32, 0x78, (0x7F, 0x78, 0x70, 0xFF),
           "amax ignores NaN = 2 -> s = 2c -> 2^-7 (E 120); NaN stays S.1111.111 with its sign"),
    Corner("inf_saturates", (np.inf, -np.inf, 1.0, 2.0**127), F32, 0xFE,
           (0x7E, 0xFE, 0x00, 0x38),
           "amax Inf -> byte 0xFE (2^127); +-Inf -> +-448; 1*2^-127 -> 0; 2^127*2^-127 = 1"),
    Corner("bf16_subnormals", (2.0**-127, 2.0**-133, -(2.0**-130)), BF16, 0x00,
           (0x38, 0x08, 0xA0),
           "amax 2^-127 (bf16 subnormal): s subnormal <= 2^-127 -> byte 0; elements * 2^127: "
           "1, 2^-6 (min normal e4m3), -2^-3"),
    Corner("s_subnormal_edge", (float(_TINY_S_EDGE),), F32, 0x00, (0x7E,),
           "amax 448*2^-127: s = rn(amax c) = 2^-127 (m = 0x400000, not rounded up) -> 0"),
    Corner("s_subnormal_next_ulp", (float(_NEXT_UP),), F32, 0x00, (0x7E,),
           "one ulp more: exact s is 2^-127(1+1.1e-7), under half a subnormal ulp (1.2e-7) "
           "-> still 2^-127 -> byte 0 (the normal-range rule would give 1)"),
    Corner("s_subnormal_two_ulps", (float(_TWO_UP),), F32, 0x01, (0x76,),
           "two ulps more: s rounds to 2^-127 + 2^-149, m > 0x400000 -> byte 1; "
           "x*2^126 = 224.00002 -> 224"),
    Corner("fp32_min_subnormal", (2.0**-149, -(2.0**-149)), F32, 0x00, (0x00, 0x80),
           "s = 0 (underflow) -> byte 0; 2^-149*2^127 = 2^-22 -> +-0"),
    Corner("bf16_max", (float(ml_dtypes.finfo(BF16).max), 1.0), BF16, 0xF7, (0x78, 0x00),
           "1.992*2^127: s = 1.138*2^119 -> 2^120 (E 247); x*2^-120 = 255 -> 256; 1 -> 0"),
)


def block_matrix(case: Corner, *, column: bool) -> np.ndarray:
    """(32, 32) array holding the case in row 0 (rowwise block) or column 0 (colwise block)."""
    block = np.zeros(32, np.float32)
    block[: len(case.values)] = case.values
    x = np.zeros((32, 32), np.float32)
    if column:
        x[:, 0] = block
    else:
        x[0, :] = block
    return x.astype(case.dtype)


def special_mix(shape, dtype, seed: int, special_rate: float = 0.05) -> np.ndarray:
    """Per-block magnitudes from deep subnormal to near fp32 max, with NaN/+-Inf/+-0 mixed in."""
    rng = np.random.default_rng(seed)
    m, k = shape
    exps = rng.integers(-150, 128, size=(m // 32, 1, k // 32, 1))
    spread = rng.integers(-12, 1, size=(m // 32, 32, k // 32, 32))
    x = (rng.standard_normal((m // 32, 32, k // 32, 32)) * np.exp2(exps + spread)).reshape(m, k)
    with np.errstate(over="ignore"):
        x = x.astype(np.float32)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    mask = rng.random(x.shape) < special_rate
    x[mask] = rng.choice(specials, size=int(mask.sum()))
    with np.errstate(over="ignore"):
        return x.astype(dtype)
