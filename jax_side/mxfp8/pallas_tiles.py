"""Tiling of the ``pallas`` kernels: tile sizes and their defaults, how a program walks its tile,
and the ``pallas_call`` plumbing (grid, BlockSpecs, Triton parameters).

Design note: docs/pallas_kernel.md. A grid program owns a (BM, BK) tile of x (BM, BK
power-of-two multiples of 32; row tiles on grid axis 0, column tiles on axis 1) and walks it in
static (32, CK) chunks loaded straight from the ref (:class:`Chunking`): a (32, 32) chunk holds 32
rowwise blocks (its rows) and 32 colwise blocks (its columns), so both block amaxes are plain
reductions over one axis of a 2-D value (no in-kernel reshape), and x is read once for both
planes. Refs are blocks of: x (BM, BK); row planes (BM, BK), (BM, BK/32); col planes (BM, BK),
(BM/32, BK). Chunk (i, j) = rows [32 i, 32 i + 32), columns [CK j, CK j + CK) of the tile.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from common.formats import BLOCK_SIZE
from jax_side.mxfp8.pallas_elements import ElementPath

__all__ = ["DEFAULT_TILES", "MAX_FLAT_INDEX", "Chunking", "FlatInto", "FlatView", "Grid",
           "KernelKind", "TileKey", "Tiles", "triton_params"]

_BS = BLOCK_SIZE
MAX_FLAT_INDEX = 2**31  # kernels that read a buffer in place index it with int32 offsets


class KernelKind(enum.Enum):
    """The 2-D kernels that take tiles."""

    QUANTIZE = "quantize"
    AMAX = "amax"
    CAST = "cast"


class Tiles(NamedTuple):
    """Tile sizes: upper bounds, shrunk per call to the largest power of two dividing M or K."""

    block_m: int = 32  # rows per program (power of two >= 32)
    block_k: int = 128  # columns per program (power of two >= 32)
    num_warps: int = 1  # Triton warps per program
    preload: bool = True  # issue every chunk's load before any math (more bytes in flight)
    chunk_k: int = 32  # chunk width (32, 64, 128): wider chunks reshape (32, CK) -> (32, CK/32,
    #                   32) for the rowwise amax but give each thread more rows (fewer shuffles)


class TileKey(NamedTuple):
    """Key of ``DEFAULT_TILES``: path None is the entry for every element path."""

    kernel: KernelKind
    dtype: str  # the input dtype's name: "bfloat16" or "float32"
    path: ElementPath | None = None


_Q, _A, _C = KernelKind.QUANTIZE, KernelKind.AMAX, KernelKind.CAST
# Defaults per (kernel, input dtype[, element path]), from the sm_90 SASS of each
# (docs/pallas_kernel.md), to be replaced by measured ones: one warp per program gives quantize
# and amax the fewest instructions per element, with 8 KiB of x per program and no register
# spills; wider chunks (chunk_k 64/128) cut shuffles and instructions further for ~1.4x the
# registers (fewer warps per SM), so they are left to the benchmark's sweep. cast_2d spills
# with one warp: four.
DEFAULT_TILES: dict[TileKey, Tiles] = {
    # the native element path (the compiled default): 32x128, two warps, 128-wide chunks was
    # the fastest of three tilings at 8192x8192, 4096x8192 and 50304x768 bf16 (BENCHMARKS.md)
    TileKey(_Q, "bfloat16", ElementPath.NATIVE): Tiles(block_m=32, block_k=128, num_warps=2,
                                                        preload=True, chunk_k=128),
    # fp32 input on the native path (the refresh: FSDP's fp32 main read as bf16 where it lies):
    # 32x128, two warps, 128-wide chunks was faster than the fp32 entry below at all four 1.3B
    # weight shapes on an H100 (bench_quantize --refresh; BENCHMARKS.md, session 20)
    TileKey(_Q, "float32", ElementPath.NATIVE): Tiles(block_m=32, block_k=128, num_warps=2,
                                                       preload=True, chunk_k=128),
    # 32x64 measured fastest of 11 tilings at 8192x8192 bf16 on the H200 (BENCHMARKS.md), FLOAT
    TileKey(_Q, "bfloat16"): Tiles(block_m=32, block_k=64, num_warps=1, preload=True),
    TileKey(_Q, "float32"): Tiles(block_m=32, block_k=64, num_warps=1, preload=True),
    TileKey(_A, "bfloat16"): Tiles(block_m=32, block_k=128, num_warps=1, preload=True, chunk_k=64),
    TileKey(_A, "float32"): Tiles(block_m=32, block_k=64, num_warps=1, preload=True, chunk_k=64),
    TileKey(_C, "bfloat16"): Tiles(block_m=32, block_k=128, num_warps=4, preload=True),
    TileKey(_C, "float32"): Tiles(block_m=32, block_k=64, num_warps=4, preload=True),
}


class Chunking(NamedTuple):
    """How a program walks its (BM, BK) tile: (32, CK) chunks, CK = 32 * nb."""

    bm: int
    bk: int
    ck: int
    preload: bool

    @property
    def nb(self) -> int:  # rowwise blocks per chunk row
        return self.ck // _BS

    def chunks(self, x_ref: Any) -> Iterable[tuple[int, int, Any, Any, jax.Array]]:
        """(i, j, rows, cols, x chunk) for every chunk. preload: all loads are issued before any
        math, so a program keeps its whole tile in flight (Triton keeps the IR order)."""
        idx = [(i, j, pl.ds(i * _BS, _BS), pl.ds(j * self.ck, self.ck))
               for i in range(self.bm // _BS) for j in range(self.bk // self.ck)]
        if not self.preload:
            return ((*ix, x_ref[ix[2], ix[3]]) for ix in idx)  # each load right before use
        loaded = [x_ref[rows, cols] for _, _, rows, cols in idx]
        return [(*ix, x) for ix, x in zip(idx, loaded, strict=True)]

    def row_scales(self, j: int) -> Any:  # this chunk's columns of a (BM, BK/32) scale block
        return pl.ds(j * self.nb, self.nb)

    def row_max(self, v: jax.Array) -> jax.Array:
        """(32, CK) -> (32, CK/32): max over each 1x32 block."""
        if self.nb == 1:
            return jnp.max(v, axis=1, keepdims=True)
        return jnp.max(v.reshape(_BS, self.nb, _BS), axis=2)  # (32, nb, 32): blocks on axis 2

    def row_expand(self, e: jax.Array) -> jax.Array:
        """(32, CK/32) -> (32, CK), or broadcastable to it: each block's value over its 32."""
        if self.nb == 1:
            return e
        return jnp.broadcast_to(e[:, :, None], (_BS, self.nb, _BS)).reshape(_BS, self.ck)


class FlatView(NamedTuple):
    """An (R, K) x read where it lies in a 1-D buffer (the kernel's first operand is the whole
    buffer, no slice copied out for the custom call): element (r, c) is ``buf[base + r*K + c]``;
    with ``masked``, only flat positions ``f = r*K + c`` in ``[lo, hi)`` are read, the others
    are zero (a slice's band: ``jax_side.mxfp8.bands``); with ``read_as`` (a dtype name), the
    loaded values are converted to it first (``astype``: fp32 master weights read as the
    recipe's bf16, rounded to nearest even by the same conversion XLA runs), so the kernel sees
    the values of ``buf[...].astype(read_as)``."""

    base: int
    k: int
    lo: int
    hi: int
    masked: bool
    read_as: str | None = None

    def over(self, ref: Any, bm: int, bk: int) -> _FlatRef:
        return _FlatRef(ref, self, bm, bk)


def _tile_positions(rows: Any, cols: Any, bm: int, bk: int, k: int) -> jax.Array:
    """Flat row-major positions ``r*K + c`` (int32) of the elements ``[rows, cols]`` (static
    ``pl.ds``) of this program's (BM, BK) tile."""
    shape = (int(rows.size), int(cols.size))
    r = pl.program_id(0) * bm + rows.start + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    c = pl.program_id(1) * bk + cols.start + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return r * k + c


class _FlatRef:
    """What a kernel indexes as its (BM, BK) block of x: ``[rows, cols]`` (static ``pl.ds``)
    loads those elements of this program's tile from the buffer (int32 offsets)."""

    def __init__(self, ref: Any, view: FlatView, bm: int, bk: int) -> None:
        self.ref, self.view, self.bm, self.bk = ref, view, bm, bk

    def __getitem__(self, idx: tuple[Any, Any]) -> jax.Array:
        f = _tile_positions(*idx, self.bm, self.bk, self.view.k)
        if not self.view.masked:
            return self._read(self.ref[self.view.base + f])
        ok = (f >= self.view.lo) & (f < self.view.hi)
        x = self._read(self.ref[self.view.base + jnp.where(ok, f, self.view.lo)])  # valid address
        return jnp.where(ok, x, jnp.zeros((), x.dtype))

    def _read(self, x: jax.Array) -> jax.Array:
        return x if self.view.read_as is None else x.astype(self.view.read_as)


def _read_in_place(x_ref: Any, *refs: Any, body: functools.partial[None], view: FlatView,
                   bm: int, bk: int) -> None:
    body(view.over(x_ref, bm, bk), *refs)


class FlatInto(NamedTuple):
    """Where a kernel writes its (R, K) outputs inside one 1-D uint8 array it updates in place
    (the call's last operand, aliased to its only result): output i's element (r, c) at
    ``ats[i] + r*K + c`` -- every element, so a band with rows outside its slice cannot be
    written this way."""

    ats: tuple[int, ...]
    k: int


class _FlatOut:
    """What a kernel stores to as its (BM, BK) block of one output: ``[rows, cols] = v``
    (static ``pl.ds``) writes those elements of this program's tile at their flat positions
    (int32 offsets)."""

    def __init__(self, ref: Any, at: int, k: int, bm: int, bk: int) -> None:
        self.ref, self.at, self.k, self.bm, self.bk = ref, at, k, bm, bk

    def __setitem__(self, idx: tuple[Any, Any], v: jax.Array) -> None:
        self.ref[self.at + _tile_positions(*idx, self.bm, self.bk, self.k)] = v


def _write_in_place(*refs: Any, body: Any, into: FlatInto, inputs: int, bm: int,
                    bk: int) -> None:
    """``body`` given the call's ``inputs`` refs, then one writer per output into the aliased
    array (its input ref, written never read, is skipped), then the call's other outputs (those
    between the aliased input and the aliased output: blocks as their specs say)."""
    out = refs[-1]
    body(*refs[:inputs], *(_FlatOut(out, at, into.k, bm, bk) for at in into.ats),
         *refs[inputs + 1:-1])


def triton_params(num_warps: int) -> Any:
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


class Grid(NamedTuple):
    """The tiles of one call (a static argument of the jitted entry points)."""

    bm: int
    bk: int
    tiles: Tiles

    @classmethod
    def make(cls, kind: KernelKind, shape: tuple[int, int], tiles: Tiles | None, dtype: Any,
             path: ElementPath | None = None) -> Grid:
        if tiles is None:
            name = jnp.dtype(dtype).name
            tiles = DEFAULT_TILES.get(TileKey(kind, name, path)) or DEFAULT_TILES[
                TileKey(kind, name)]
        if tiles.chunk_k not in (32, 64, 128):
            raise ValueError(f"Tiles.chunk_k: expected 32, 64 or 128, got {tiles.chunk_k}")
        m, k = shape
        return cls(_fit(tiles.block_m, m), _fit(tiles.block_k, k), tiles)

    def kernel(self, fn: Callable[..., None], view: FlatView | None = None,
               **kw: Any) -> functools.partial[None]:
        """``fn`` with its chunking; with ``view``, x (its first ref) is read where it lies in
        the buffer the call gets instead (:class:`FlatView`; pass ``x_spec(view)``)."""
        ch = Chunking(self.bm, self.bk, min(self.tiles.chunk_k, self.bk), self.tiles.preload)
        body = functools.partial(fn, ch=ch, **kw)
        if view is None:
            return body
        return functools.partial(_read_in_place, body=body, view=view, bm=self.bm, bk=self.bk)

    def kernel_into(self, fn: Callable[..., None], view: FlatView | None, into: FlatInto,
                    inputs: int, **kw: Any) -> functools.partial[None]:
        """``kernel(fn, view)`` whose outputs are written in place (:class:`FlatInto`)."""
        return functools.partial(_write_in_place, body=self.kernel(fn, view, **kw), into=into,
                                 inputs=inputs, bm=self.bm, bk=self.bk)

    def x_spec(self, view: FlatView | None) -> Any:
        """x's BlockSpec: (BM, BK) blocks, or the whole buffer for a ``FlatView``."""
        return self.full() if view is None else pl.BlockSpec()

    def grid(self, shape: tuple[int, int]) -> tuple[int, int]:
        return (shape[0] // self.bm, shape[1] // self.bk)

    def full(self) -> Any:  # (BM, BK) blocks of (M, K) arrays
        return pl.BlockSpec((self.bm, self.bk), lambda i, j: (i, j))

    def row_scale(self) -> Any:  # (BM, BK/32) blocks of (M, K/32) arrays
        return pl.BlockSpec((self.bm, self.bk // _BS), lambda i, j: (i, j))

    def col_scale(self) -> Any:  # (BM/32, BK) blocks of (M/32, K) arrays
        return pl.BlockSpec((self.bm // _BS, self.bk), lambda i, j: (i, j))

    def call(self, kernel: functools.partial[None], shape: tuple[int, int], in_specs: list[Any],
             outs: list[tuple[Any, Any]], interpret: bool,
             aliases: dict[int, int] | None = None) -> Callable[..., Any]:
        """outs: list of (BlockSpec, ShapeDtypeStruct); the ``pallas_call`` to apply
        (``aliases``: its ``input_output_aliases``)."""
        return pl.pallas_call(
            kernel,
            out_shape=[o[1] for o in outs],
            grid=self.grid(shape),
            in_specs=in_specs,
            out_specs=[o[0] for o in outs],
            compiler_params=triton_params(self.tiles.num_warps),
            interpret=interpret,
            input_output_aliases=aliases or {},
            name="mxfp8_" + _body_name(kernel),
        )


def _body_name(kernel: Any) -> str:
    """The kernel function under its wrappers (``functools.partial``s with a ``body``)."""
    while "body" in getattr(kernel, "keywords", {}):
        kernel = kernel.keywords["body"]
    return str(kernel.func.__name__).strip("_")
