"""The bodies of the ``pallas`` kernels (one grid program each; tiling in ``pallas_tiles``, the
element and scale math in ``pallas_elements``). Design note: docs/pallas_kernel.md.

Refs are blocks of: x (BM, BK); row planes (BM, BK), (BM, BK/32); col planes (BM, BK),
(BM/32, BK). Outputs are uint8 (bytes of e4m3 data and E8M0 scales) or fp32 (amax); the entry
points in ``pallas_impl`` bitcast them to the float8 dtypes.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_side.mxfp8.pallas_elements import (
    ABS_MASK,
    INF_BITS,
    ElementPath,
    element_fns,
    fp32_bits,
    scale_bytes_of_bits,
)
from jax_side.mxfp8.pallas_tiles import Chunking

__all__ = ["amax_kernel", "cast_kernel", "quantize_amax_kernel", "quantize_kernel",
           "scale_kernel"]


# Refs are Pallas memory references (``Any``: Pallas exports no public type for them); an output
# that was not asked for is None and never indexed.


def quantize_kernel(x_ref: Any, *refs: Any, rowwise: bool, colwise: bool, ch: Chunking,
                    mode: ElementPath) -> None:
    queue = list(refs)
    rd: Any = queue.pop(0) if rowwise else None
    rs: Any = queue.pop(0) if rowwise else None
    cd: Any = queue.pop(0) if colwise else None
    cs: Any = queue.pop(0) if colwise else None
    elements, cast = element_fns(mode, any_scale=False)
    for i, j, rows, cols, x in ch.chunks(x_ref):
        el = elements(fp32_bits(x))
        if rowwise:
            e = scale_bytes_of_bits(ch.row_max(el.amax_in), any_bits=False)  # (32, CK/32)
            rs[rows, ch.row_scales(j)] = e.astype(jnp.uint8)
            rd[rows, cols] = cast(el, ch.row_expand(e))
        if colwise:
            e = scale_bytes_of_bits(jnp.max(el.amax_in, axis=0, keepdims=True), any_bits=False)
            cs[pl.ds(i, 1), cols] = e.astype(jnp.uint8)  # (1, CK): one per column
            cd[rows, cols] = cast(el, e)


def quantize_amax_kernel(x_ref: Any, rd: Any, cd: Any, ra: Any, ca: Any, *, ch: Chunking,
                         mode: ElementPath) -> None:
    """Both planes' codes (``quantize_kernel``'s) and both planes' block amax (``amax_kernel``'s)
    from one read of x: the refresh's one pass where no rank's amax changes a block's scale
    (``slices.quantize_slice_into``). The scale bytes are left to the caller (from the amax)."""
    elements, cast = element_fns(mode, any_scale=False)
    for i, j, rows, cols, x in ch.chunks(x_ref):
        el = elements(fp32_bits(x))
        row_max = ch.row_max(el.amax_in)  # (32, CK/32) int32 |x| bits, NaN zeroed
        col_max = jnp.max(el.amax_in, axis=0, keepdims=True)  # (1, CK)
        ra[rows, ch.row_scales(j)] = lax.bitcast_convert_type(row_max, jnp.float32)
        ca[pl.ds(i, 1), cols] = lax.bitcast_convert_type(col_max, jnp.float32)
        rd[rows, cols] = cast(el, ch.row_expand(scale_bytes_of_bits(row_max, any_bits=False)))
        cd[rows, cols] = cast(el, scale_bytes_of_bits(col_max, any_bits=False))


def amax_kernel(x_ref: Any, *refs: Any, rowwise: bool, colwise: bool, ch: Chunking) -> None:
    queue = list(refs)
    ra: Any = queue.pop(0) if rowwise else None
    ca: Any = queue.pop(0) if colwise else None
    for i, j, rows, cols, x in ch.chunks(x_ref):
        a = fp32_bits(x) & ABS_MASK
        a0 = jnp.where(a > INF_BITS, jnp.int32(0), a)
        if rowwise:
            ra[rows, ch.row_scales(j)] = lax.bitcast_convert_type(ch.row_max(a0), jnp.float32)
        if colwise:
            m = jnp.max(a0, axis=0, keepdims=True)
            ca[pl.ds(i, 1), cols] = lax.bitcast_convert_type(m, jnp.float32)


def cast_kernel(x_ref: Any, *refs: Any, rowwise: bool, colwise: bool, ch: Chunking,
                mode: ElementPath) -> None:
    queue = list(refs)
    rs: Any = queue.pop(0) if rowwise else None
    cs: Any = queue.pop(0) if colwise else None
    rd: Any = queue.pop(0) if rowwise else None
    cd: Any = queue.pop(0) if colwise else None
    elements, cast = element_fns(mode, any_scale=True)
    for i, j, rows, cols, x in ch.chunks(x_ref):
        el = elements(fp32_bits(x))
        if rowwise:
            e = rs[rows, ch.row_scales(j)].astype(jnp.int32)  # (32, CK/32)
            rd[rows, cols] = cast(el, ch.row_expand(e))
        if colwise:
            cd[rows, cols] = cast(el, cs[pl.ds(i, 1), cols].astype(jnp.int32))


def scale_kernel(a_ref: Any, o_ref: Any) -> None:
    o_ref[...] = scale_bytes_of_bits(lax.bitcast_convert_type(a_ref[...], jnp.int32)).astype(
        jnp.uint8)

