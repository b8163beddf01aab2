"""One Pallas kernel that re-blocks a weight's MXFP8 plane into the ``fp8_blocked`` GEMM's 128x128
tiles (DESIGN.md 11; issue 33): the bytes of ``reblock.reblock_tiles``, which XLA runs as
elementwise fusions well below the memory bandwidth (the dgrad one through a transpose: 0.35
TB/s on the H200, BENCHMARKS.md session 12).

- ``colwise=False`` (the forward's ``b``): the rowwise plane, codes (N, K) in 1x32 blocks along
  K, scales (N, K/32) -> tiles (N, K), scales (N/128, K/128): ``reblock_tiles(data, scale)``.
- ``colwise=True`` (dgrad's ``b``): the colwise plane, codes (N, K) in 32x1 blocks along N, scales
  (N/32, K) -> tiles of its transpose, (K, N), scales (K/128, N/128):
  ``reblock_tiles(data.T, scale.T)``; the kernel transposes each tile.

Each program takes one 128x128 tile: the largest of its 512 scale bytes (rowwise 128 x 4,
colwise 4 x 128) is the tile's scale, and every code is shifted to it with ``shift_codes``, the
function the XLA reference runs (round to nearest even; NaN codes kept; a 0xFF block makes the
tile's scale 0xFF).

The kernel reads the plane where it lies: :func:`reblock_tiles_flat` takes the flat buffers and
offsets of a ``jax_side.linear.FlatPlane`` (FSDP's gathered bytes inside a unit program), so no
slice of the buffer is copied out first -- XLA must materialize the operand of a custom call,
which for a slice is a copy of the plane (about 4 ms of device-to-device copies per 1.3B step,
session 12's launch B). :func:`reblock_tiles_2d` takes arrays (padded to multiples of 128 with
zero codes and zero scale bytes first, as ``reblock.pad_to`` pads). Tested byte for byte against
``reblock_tiles`` in interpret mode on the CPU and compiled on the GPU
(tests/jax_side/mxfp8/test_pallas_reblock.py).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from common.formats import round_up
from jax_side.mxfp8.pallas_tiles import MAX_FLAT_INDEX, triton_params
from jax_side.mxfp8.reblock import GROUP, Reblocked, shift_codes

__all__ = ["NUM_WARPS", "reads_in_place", "reblock_tiles_2d", "reblock_tiles_flat"]

_BS = 32  # MXFP8 block
_BANDS = GROUP // _BS  # bands of 32 rows per tile
# Triton warps per program (rowwise, colwise): the defaults, the fastest on the H200 at the 1.3B
# GPT's weights (benchmarks/bench_blocked_operands.py --weights; BENCHMARKS.md session 12)
NUM_WARPS = (8, 4)


def _grid(rows: int, cols: int, row0: Any, stride: int, col0: Any) -> jax.Array:
    """(rows, cols) int32 flat offsets of a row-major matrix of row length ``stride``: rows
    ``row0 ...``, columns ``col0 ...``."""
    r = lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    c = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return (row0 + r) * stride + (col0 + c)


def _tile_max(s: jax.Array) -> jax.Array:
    """(a, b) int32 -> (1, 1): the largest."""
    return jnp.max(jnp.max(s, axis=1, keepdims=True), axis=0, keepdims=True)


def _kernel(d_ref: Any, s_ref: Any, od_ref: Any, os_ref: Any, *, colwise: bool, k: int,
            d_off: int, s_off: int) -> None:
    """Tile (i, j) of an (N, K) plane whose codes start at ``d_off`` of the 1-D ``d_ref`` and
    scales at ``s_off`` of ``s_ref``; writes the tile (rowwise) or its transpose (colwise)."""
    i, j = pl.program_id(0), pl.program_id(1)
    if colwise:  # scales (N/32, K): 4 rows of 128 per tile, one row per band
        top = _tile_max(s_ref[s_off + _grid(_BANDS, GROUP, i * _BANDS, k, j * GROUP)]
                        .astype(jnp.int32))
    else:  # scales (N, K/32): 128 rows of 4 per tile
        top = _tile_max(s_ref[s_off + _grid(GROUP, _BANDS, i * GROUP, k // _BS, j * _BANDS)]
                        .astype(jnp.int32))
    for b in range(_BANDS):
        codes = d_ref[d_off + _grid(_BS, GROUP, i * GROUP + b * _BS, k, j * GROUP)]  # (32, 128)
        if colwise:
            diff = s_ref[s_off + _grid(1, GROUP, i * _BANDS + b, k, j * GROUP)]  # (1, 128)
            shifted = shift_codes(codes, diff.astype(jnp.int32) - top)
            od_ref[:, pl.ds(b * _BS, _BS)] = shifted.astype(jnp.int32).T.astype(jnp.uint8)
        else:
            diff = s_ref[s_off + _grid(_BS, _BANDS, i * GROUP + b * _BS, k // _BS, j * _BANDS)]
            diff = diff.astype(jnp.int32) - top  # (32, 4): one per 1x32 block
            wide = jnp.broadcast_to(diff[:, :, None], (_BS, _BANDS, _BS)).reshape(_BS, GROUP)
            od_ref[pl.ds(b * _BS, _BS), :] = shift_codes(codes, wide)
    os_ref[...] = top.astype(jnp.uint8)


def _u8(a: jax.Array) -> jax.Array:
    return a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)


def _check_codes(data: jax.Array, what: str) -> None:
    if data.dtype not in (jnp.float8_e4m3fn, jnp.uint8):
        raise TypeError(f"{what}: data must be float8_e4m3fn (or uint8) codes, got "
                        f"{data.dtype}{tuple(data.shape)}")


def _warps(num_warps: int | None, colwise: bool) -> int:
    return NUM_WARPS[colwise] if num_warps is None else int(num_warps)


def reads_in_place(shape: tuple[int, int], data: jax.Array, scale: jax.Array) -> bool:
    """Whether :func:`reblock_tiles_flat` takes an (N, K) plane in these buffers: N and K
    multiples of 128 (no padding in place) and buffers its int32 offsets reach."""
    n, k = shape
    return (n > 0 and k > 0 and n % GROUP == 0 and k % GROUP == 0
            and max(data.shape[0], scale.shape[0]) < MAX_FLAT_INDEX)


def reblock_tiles_flat(data: jax.Array, scale: jax.Array, data_offset: int, scale_offset: int,
                       shape: tuple[int, int], *, colwise: bool, interpret: bool = False,
                       num_warps: int | None = None) -> Reblocked:
    """The tiles of an (N, K) plane held in flat buffers (``jax_side.linear.FlatPlane``'s
    fields): codes at ``data[data_offset : data_offset + N*K]`` (row-major), scale bytes from
    ``scale[scale_offset]`` ((N, K/32) rowwise, (N/32, K) colwise), read in place. N and K must
    be multiples of 128 (:func:`reblock_tiles_2d` pads), the buffers shorter than 2**31."""
    _check_codes(data, "reblock_tiles_flat")
    n, k = (int(d) for d in shape)
    if data.ndim != 1 or scale.ndim != 1 or scale.dtype not in (jnp.uint8, jnp.float8_e8m0fnu):
        raise ValueError(f"reblock_tiles_flat: expected 1-D buffers of codes and uint8 (or "
                         f"float8_e8m0fnu) scale bytes, got {data.dtype}{tuple(data.shape)} and "
                         f"{scale.dtype}{tuple(scale.shape)}")
    if n % GROUP or k % GROUP or n <= 0 or k <= 0:
        raise ValueError(f"reblock_tiles_flat: shape {(n, k)} must be positive multiples of "
                         f"{GROUP}; use reblock_tiles_2d on the sliced plane (it pads)")
    if (data_offset < 0 or scale_offset < 0 or data_offset + n * k > data.shape[0]
            or scale_offset + n * k // _BS > scale.shape[0]):
        raise ValueError(f"reblock_tiles_flat: the plane {(n, k)} at offsets {data_offset} / "
                         f"{scale_offset} runs past its buffers ({data.shape[0]} codes, "
                         f"{scale.shape[0]} scale bytes)")
    if max(data.shape[0], scale.shape[0]) >= MAX_FLAT_INDEX:
        raise ValueError(f"reblock_tiles_flat: buffers of 2**31 elements or more "
                         f"({data.shape[0]}, {scale.shape[0]}) are beyond its int32 offsets; "
                         f"use reblock_tiles_2d on the sliced plane")
    return _reblock(_u8(data), _u8(scale), int(data_offset), int(scale_offset), (n, k),
                    bool(colwise), bool(interpret), _warps(num_warps, colwise))


def reblock_tiles_2d(data: jax.Array, scale: jax.Array, *, colwise: bool,
                     interpret: bool = False, num_warps: int | None = None) -> Reblocked:
    """The tiles of one MXFP8 plane given as arrays (module docstring): ``data`` (N, K)
    float8_e4m3fn or uint8 codes, ``scale`` E8M0 bytes (uint8 or float8_e8m0fnu) (N, K/32)
    rowwise or (N/32, K) colwise; N and K multiples of 32 (an MXFP8 plane's). Returns padded
    tiles, (N128, K128) rowwise, (K128, N128) colwise (the transpose), as ``reblock.pad_to``
    then ``reblock_tiles`` make them. ``num_warps`` (None: ``NUM_WARPS``' for the plane)
    changes the speed only."""
    _check_codes(data, "reblock_tiles_2d")
    if data.ndim != 2:
        raise TypeError(f"reblock_tiles_2d: data must be 2-D (N, K), got {tuple(data.shape)}")
    n, k = data.shape
    want = (n // _BS, k) if colwise else (n, k // _BS)
    if (n % _BS or k % _BS or scale.dtype not in (jnp.uint8, jnp.float8_e8m0fnu)
            or tuple(scale.shape) != want):
        plane = "colwise (32x1 blocks)" if colwise else "rowwise (1x32 blocks)"
        raise ValueError(f"reblock_tiles_2d: a {plane} plane of data {tuple(data.shape)} needs "
                         f"N and K multiples of {_BS} and E8M0 scale bytes (uint8 or e8m0) "
                         f"of shape {want}, got {scale.dtype}{tuple(scale.shape)}")
    n2, k2 = round_up(n, GROUP), round_up(k, GROUP)
    codes = jnp.pad(_u8(data), ((0, n2 - n), (0, k2 - k)))
    if colwise:
        scale = jnp.pad(_u8(scale), ((0, (n2 - n) // _BS), (0, k2 - k)))
    else:
        scale = jnp.pad(_u8(scale), ((0, n2 - n), (0, (k2 - k) // _BS)))
    return reblock_tiles_flat(codes.reshape(-1), scale.reshape(-1), 0, 0, (n2, k2),
                              colwise=colwise, interpret=interpret, num_warps=num_warps)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7))
def _reblock(data: jax.Array, scale: jax.Array, data_offset: int, scale_offset: int,
             shape: tuple[int, int], colwise: bool, interpret: bool,
             num_warps: int) -> Reblocked:
    n, k = shape
    out = (k, n) if colwise else (n, k)
    tile = (lambda i, j: (j, i)) if colwise else (lambda i, j: (i, j))
    tiles_d, tiles_s = pl.pallas_call(
        functools.partial(_kernel, colwise=colwise, k=k, d_off=data_offset,
                          s_off=scale_offset),
        out_shape=[jax.ShapeDtypeStruct(out, jnp.uint8),
                   jax.ShapeDtypeStruct((out[0] // GROUP, out[1] // GROUP), jnp.uint8)],
        grid=(n // GROUP, k // GROUP),
        in_specs=[pl.BlockSpec(), pl.BlockSpec()],  # the whole buffers: read in place
        out_specs=[pl.BlockSpec((GROUP, GROUP), tile), pl.BlockSpec((1, 1), tile)],
        compiler_params=triton_params(num_warps), interpret=interpret,
        name="mxfp8_reblock_tiles",
    )(data, scale)
    return Reblocked(lax.bitcast_convert_type(tiles_d, jnp.float8_e4m3fn), tiles_s)
