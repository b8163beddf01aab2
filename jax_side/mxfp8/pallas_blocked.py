"""One Pallas kernel that quantizes a bf16/fp32 (M, K) activation or gradient straight into the
``fp8_blocked`` GEMM's operand layouts (DESIGN.md 11; issue 33), x read once per call.

The plane path quantizes to MXFP8 planes (1x32 and 32x1 blocks), then a second pass re-blocks
each plane for the GEMM (``reblock``), transposing the colwise one for wgrad. This kernel does
both in registers: per 128x128 tile of x it computes the MXFP8 codes exactly as the quantize kernel
does (``pallas_elements``: the block's own E8M0 scale, e4m3 round-to-nearest-even), then shifts
them to the merged block's largest scale with round-to-nearest-even, as ``reblock`` does, and
writes (one call may make several; ``blocked_operands`` makes one per call, which measured
faster on the H200)

- ``rows``: (M, K) e4m3 in 1x128 blocks along K, scales (M, K/128) -- the ``a`` operand of the
  forward and dgrad GEMMs (``reblock_rows`` of the rowwise plane);
- ``rows_t``: (K, M) e4m3 in 1x128 blocks along M, scales (K, M/128) -- wgrad's ``a`` (dy^T:
  ``reblock_rows`` of the transposed colwise plane);
- ``tiles_t``: (K, M) e4m3 in 128x128 tiles, scales (K/128, M/128) -- wgrad's ``b`` (x^T:
  ``reblock_tiles`` of the transposed colwise plane).

Bytes: those of quantize-then-re-block (``blocked_operands.from_planes``), tested in interpret
mode on the CPU (the FTZ-proof element path) and compiled on the GPU (the native path). The
shift: an e4m3 magnitude (never subnormal in fp32) times 2**d, d in [-30, 0] (a normal power of
two), rounded by the e4m3 cast; the sign byte is or-ed back, NaN codes are kept as they are.

M and K must be multiples of 128 (``blocked_operands`` pads with zero rows and columns first,
which quantize to zero codes and zero scale bytes, as ``reblock.pad_to`` pads).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_side.mxfp8 import elementwise
from jax_side.mxfp8.elementwise import Prologue
from jax_side.mxfp8.pallas_elements import (
    ElementPath,
    cast_shift_native,
    element_fns,
    fp32_bits,
    scale_bytes_of_bits,
)
from jax_side.mxfp8.pallas_impl import element_path
from jax_side.mxfp8.pallas_tiles import triton_params
from jax_side.mxfp8.reblock import GROUP, Reblocked, shift_codes

__all__ = ["NUM_WARPS", "BlockedPlanes", "quantize_blocked_2d"]

_BS = 32  # MXFP8 block
_PER = GROUP // _BS  # 1x32 blocks per 1x128 block
_PACK = 4  # e4m3 codes per int32 word (``packed``)
NUM_WARPS = 8  # Triton warps per program (the default of quantize_blocked_2d)


class BlockedPlanes(NamedTuple):
    """What ``quantize_blocked_2d`` made; an output not asked for is None."""

    rows: Reblocked | None  # (M, K), scales (M, K/128)
    rows_t: Reblocked | None  # (K, M), scales (K, M/128)
    tiles_t: Reblocked | None  # (K, M), scales (K/128, M/128)
    # (M/32, K) uint8: the colwise plane's scale bytes (32x1 blocks), made beside the rows
    # (``col_scales=True``) for a transposed output's call (``given_scales``)
    col_scales: jax.Array | None = None


def _row_blocks(v: jax.Array) -> jax.Array:
    """(R, 128) -> (R, 4): max over each 1x32 block."""
    return jnp.max(v.reshape(v.shape[0], _PER, _BS), axis=2)


def _row_expand(e: jax.Array) -> jax.Array:
    """(R, 4) -> (R, 128): each block's value over its 32 elements."""
    r = e.shape[0]
    return jnp.broadcast_to(e[:, :, None], (r, _PER, _BS)).reshape(r, GROUP)


def _load(x_ref: Any, pre: Prologue | None, *index: Any) -> jax.Array:
    """x's block (or rows of it) as the kernel quantizes it: ``pre`` applied where given."""
    v = x_ref[index] if index else x_ref[...]
    return v if pre is None else pre(v)


def _cast_shift(path: ElementPath, one_cast: bool) -> tuple[Any, Any]:
    """``(elements, cast_shift)``: ``cast_shift(el, E, diff)`` is ``shift_codes(cast(el, E),
    diff)``, the codes at each 1x32 block's own scale E shifted to the merged block's; on the
    native path with ``one_cast``, by one e4m3 cast (``pallas_elements.cast_shift_native``:
    the same bytes)."""
    elements, cast = element_fns(path, any_scale=False)
    if path is ElementPath.NATIVE and one_cast:
        return elements, cast_shift_native
    return elements, lambda el, e, diff: shift_codes(cast(el, e), diff)


def _rows_of(el: Any, cast_shift: Any) -> tuple[jax.Array, jax.Array]:
    """(codes, scale bytes) of R rows of elements in 1x128 blocks: each 1x32 block cast at its
    own scale, then shifted to its 1x128 block's largest."""
    e = scale_bytes_of_bits(_row_blocks(el.amax_in), any_bits=False)  # (R, 4)
    top = jnp.max(e, axis=1, keepdims=True)  # (R, 1)
    return cast_shift(el, _row_expand(e), _row_expand(e - top)), top.astype(jnp.uint8)


def _kernel_whole(x_ref: Any, *refs: Any, rows: bool, cols: bool, tiles: bool,
                  path: ElementPath, one_cast: bool, bands: int, pre: Prologue | None) -> None:
    """One program, x's whole (32 * bands, W) block loaded once: the rows' codes from it (W =
    128), the colwise scales of its bands by one reshape, and the transposed codes stored at
    once, so each output row gets its 32 * bands codes in one store (the banded kernel reads
    each band twice and stores 32 codes per row per band)."""
    queue = list(refs)
    elements, cast_shift = _cast_shift(path, one_cast)
    el = elements(fp32_bits(_load(x_ref, pre)))  # (R, W), R = 32 * bands
    if rows:
        rd, rs = queue.pop(0), queue.pop(0)
        rd[...], rs[...] = _rows_of(el, cast_shift)
    if not cols:
        return
    td, ts = queue
    w = el.amax_in.shape[1]
    amax = jnp.max(el.amax_in.reshape(bands, _BS, w), axis=1)  # (bands, W): 32x1 blocks
    ec = scale_bytes_of_bits(amax, any_bits=False)
    top = jnp.max(ec, axis=0, keepdims=True)  # (1, W): per column over the R rows
    if tiles:
        top = jnp.max(top, axis=1, keepdims=True)  # (1, 1): the whole tile
    e = jnp.broadcast_to(ec[:, None, :], (bands, _BS, w)).reshape(bands * _BS, w)
    codes = cast_shift(el, e, e - top)  # (R, W)
    td[...] = codes.astype(jnp.int32).T.astype(jnp.uint8)
    ts[...] = top.astype(jnp.uint8)


def _col_scales(el: Any) -> jax.Array:
    """(1, W) int32: the scale bytes of a band's 32x1 blocks (the colwise plane's)."""
    return scale_bytes_of_bits(jnp.max(el.amax_in, axis=0, keepdims=True), any_bits=False)


def _kernel(x_ref: Any, *refs: Any, rows: bool, cols: bool, tiles: bool,
            path: ElementPath, one_cast: bool, bands: int, pre: Prologue | None,
            col_scales: bool = False, given: bool = False) -> None:
    """One program: x's (32 * bands, W) block in bands of 32 rows, each band's elements made
    when it is cast (not all of them up front: fewer live registers). The transposed outputs
    need every band's colwise scale before the first cast, so their bands are read twice: once
    for the amax, then again (from cache) for the codes -- unless the scale bytes are
    ``given`` (the first ref, (bands, W): a ``col_scales`` call wrote them beside its rows),
    then each band is read once."""
    queue = list(refs)
    gs: Any = queue.pop(0) if given else None
    rd: Any = queue.pop(0) if rows else None
    rs: Any = queue.pop(0) if rows else None
    cs: Any = queue.pop(0) if col_scales else None
    td: Any = queue.pop(0) if cols else None
    ts: Any = queue.pop(0) if cols else None
    elements, cast_shift = _cast_shift(path, one_cast)

    def band(i: int) -> Any:
        return elements(fp32_bits(_load(x_ref, pre, pl.ds(i * _BS, _BS), slice(None))))

    if rows:
        for i in range(bands):
            el = band(i)
            rd[pl.ds(i * _BS, _BS), :], rs[pl.ds(i * _BS, _BS), :] = _rows_of(el, cast_shift)
            if col_scales:
                cs[pl.ds(i, 1), :] = _col_scales(el).astype(jnp.uint8)
    if cols:
        ec = [gs[pl.ds(i, 1), :].astype(jnp.int32) if given else _col_scales(band(i))
              for i in range(bands)]  # (1, W) per band
        top = functools.reduce(jnp.maximum, ec)  # (1, W): per column over the 128 rows
        if tiles:
            top = jnp.max(top, axis=1, keepdims=True)  # (1, 1): the whole tile
        for i in range(bands):
            codes = cast_shift(band(i), ec[i], ec[i] - top)  # (32, W)
            td[:, pl.ds(i * _BS, _BS)] = codes.astype(jnp.int32).T.astype(jnp.uint8)
        ts[...] = top.astype(jnp.uint8)


def _kernel_packed(x_ref: Any, *refs: Any, rows: bool, tiles: bool, path: ElementPath,
                   one_cast: bool, pre: Prologue | None) -> None:
    """One program, a transposed output (and ``rows``, W = 128): x's (128, W) block read as four
    quarters of rows r, r + 4, ..., r + 124 (row-strided loads; a quarter's row 8b + j lies in
    32-row band b), each read twice as the banded kernel reads its bands (amax, then codes).
    The codes of rows 4i .. 4i + 3 become the bytes 0 .. 3 of one int32 word, and the (32, W)
    words are transposed and stored: the output's row c gets its 128 codes as 32 little-endian
    words. ``rows``: each quarter's 1x128 rows are made from the elements of its second read
    and stored at its rows (row-strided stores)."""
    rd, rs, td, ts = refs if rows else (None, None, *refs)
    elements, cast_shift = _cast_shift(path, one_cast)
    n = GROUP // _PACK  # 32 rows per quarter: 8 from each band
    w = td.shape[0]

    def quarter(r: int) -> Any:
        return elements(fp32_bits(_load(x_ref, pre, pl.ds(r, n, stride=_PACK), slice(None))))

    amax = functools.reduce(jnp.maximum, [
        jnp.max(quarter(r).amax_in.reshape(_PER, n // _PER, w), axis=1)
        for r in range(_PACK)])  # (4, W): each 32-row band's amax per column
    ec = scale_bytes_of_bits(amax, any_bits=False)
    top = jnp.max(ec, axis=0, keepdims=True)  # (1, W): per column over the 128 rows
    if tiles:
        top = jnp.max(top, axis=1, keepdims=True)  # (1, 1): the whole tile
    e = jnp.broadcast_to(ec[:, None, :], (_PER, n // _PER, w)).reshape(n, w)
    words = []
    for r in range(_PACK):
        el = quarter(r)
        if rows:
            at = pl.ds(r, n, stride=_PACK)
            rd[at, :], rs[at, :] = _rows_of(el, cast_shift)
        words.append(lax.shift_left(cast_shift(el, e, e - top).astype(jnp.int32),
                                    jnp.int32(8 * r)))  # (32, W)
    td[...] = functools.reduce(jnp.bitwise_or, words).T
    ts[...] = top.astype(jnp.uint8)


def quantize_blocked_2d(x: jax.Array | Sequence[jax.Array], *, rows: bool, rows_t: bool,
                        tiles_t: bool, interpret: bool = False,
                        e4m3_cast: ElementPath | str | None = None,
                        num_warps: int = NUM_WARPS,
                        block: tuple[int, int] = (GROUP, GROUP),
                        whole: bool = False, packed: bool = False,
                        pre: Prologue | None = None, one_cast: bool = True,
                        col_scales: bool = False,
                        given_scales: jax.Array | None = None) -> BlockedPlanes:
    """The operands asked for (module docstring) of a 2-D (M, K) bf16/fp32 x, M and K multiples
    of 128; ``rows_t`` and ``tiles_t`` exclude each other (one transposed output per call).
    ``num_warps``: Triton warps per program; ``block``: the (rows, columns) of x each program
    quantizes -- (32, 128), (64, 128) or (128, 128) for ``rows`` alone (a 1x128 block needs one
    row), (128, 32), (128, 64) or (128, 128) for ``rows_t`` alone (its blocks run down 128
    rows), (128, 128) otherwise (``tiles_t`` needs the whole tile); ``whole`` (a transposed
    output, with or without ``rows``): each program loads its whole block at once and stores
    each output row's 128 codes in one store, instead of 32-row bands read twice, and makes
    ``rows`` from the same loaded block (the bytes are the same); ``packed`` (a transposed
    output, with or without ``rows``; not ``whole``): each program loads x's block as four
    row-strided quarters (rows r, r + 4, ...), packs the codes of four consecutive rows into
    one int32 and transposes and stores words, a quarter of the elements through the transpose,
    and makes ``rows`` from each quarter's second read (the bytes are the same);
    benchmarks/bench_blocked_operands.py times them.

    ``x`` may also be a sequence of column parts (M, K_i) of one dtype, each K_i a multiple of
    128: the operands of their concatenation along the columns, each part's kernel writing its
    columns straight into the shared outputs (``input_output_aliases``), so the parts are never
    concatenated (the attention's dq, dk, dv into the qkv backward's operands).

    ``pre``: an elementwise function (``elementwise.check``) that each program applies to x's
    values as it loads them: the operands of ``pre(x)``, byte for byte, with ``pre(x)`` never
    written to memory (the GPT's GELU before its MLP's second linear; ``pre`` must be hashable,
    a module-level function, as it is part of the compiled kernel).

    ``one_cast`` (the native element path, compiled kernels): each code made by one e4m3 cast
    at the merged block's scale from x's value rounded onto its own 1x32 block's grid in fp32
    (``pallas_elements.cast_shift_native``); False: cast at the own scale, then shifted by
    ``reblock.shift_codes``, the composition it replaces (the same bytes: the GPU test compares
    them; the benchmark times them). The FTZ-proof paths always take the composition.

    ``col_scales`` (``rows`` alone): the call also writes the colwise plane's scale bytes,
    (M/32, K) uint8 (each 32x1 block's E8M0 byte, from the amax the rows' bands are loaded for),
    as ``BlockedPlanes.col_scales``. ``given_scales`` (a transposed output alone, banded, not
    packed): those bytes, read instead of computed, so each program reads its bands of x once
    (the first of its two passes is the amax). They must be what a ``col_scales`` call returned
    for the same x (and ``pre``): other bytes give other codes (only the shape and dtype are
    checked). The operands are those of one call per output, byte for byte."""
    parts = tuple(x) if isinstance(x, (list, tuple)) else (x,)
    _check_parts(parts, "quantize_blocked_2d")
    _check_request(rows, rows_t, tiles_t, whole, packed, tuple(block))
    if pre is not None:
        elementwise.check(pre, parts[0].dtype, "quantize_blocked_2d")
    _check_scales(parts, bool(col_scales), given_scales, rows, rows_t or tiles_t,
                  whole or packed)
    path = element_path(e4m3_cast, bool(interpret))
    return _quantize_blocked(parts, given_scales, bool(rows), bool(rows_t or tiles_t),
                             bool(tiles_t), bool(interpret), path, int(num_warps),
                             (int(block[0]), int(block[1])), bool(whole), bool(packed), pre,
                             bool(one_cast), bool(col_scales))


def _check_request(rows: bool, rows_t: bool, tiles_t: bool, whole: bool, packed: bool,
                   block: tuple[int, ...]) -> None:
    """A clear error unless the outputs, ``whole``, ``packed`` and ``block`` fit together."""
    what = "quantize_blocked_2d"
    if rows_t and tiles_t:
        raise ValueError(f"{what}: rows_t and tiles_t in one call; make them in two")
    if not (rows or rows_t or tiles_t):
        raise ValueError(f"{what}: rows, rows_t and tiles_t all False asks for nothing")
    if packed and (whole or not (rows_t or tiles_t)):
        raise ValueError(f"{what}: packed=True packs a transposed output, so it needs rows_t "
                         f"or tiles_t (with or without rows) and whole=False; got "
                         f"rows_t={rows_t}, tiles_t={tiles_t}, whole={whole}")
    _check_block(block, rows, rows_t, tiles_t)
    if whole and not (rows_t or tiles_t):
        raise ValueError(f"{what}: whole=True loads each program's block once for a transposed "
                         f"output (rows_t or tiles_t, with or without rows); rows alone take "
                         f"whole=False")


def _check_scales(parts: tuple[jax.Array, ...], col_scales: bool, given: jax.Array | None,
                  rows: bool, transposed: bool, whole_or_packed: bool) -> None:
    """A clear error unless ``col_scales`` comes with ``rows`` alone and ``given_scales`` (the
    (M/32, K) uint8 bytes) with a banded transposed output alone."""
    what = "quantize_blocked_2d"
    if col_scales and (not rows or transposed):
        raise ValueError(f"{what}: col_scales=True writes the colwise scale bytes beside the "
                         f"rows of a call that makes the rows alone; got rows={rows} and a "
                         f"transposed output={transposed}")
    if given is None:
        return
    if rows or not transposed or whole_or_packed:
        raise ValueError(f"{what}: given_scales serve a call that makes one transposed output "
                         f"(rows_t or tiles_t) alone with banded programs (whole=False, "
                         f"packed=False); got rows={rows}, a transposed output={transposed}, "
                         f"whole or packed={whole_or_packed}")
    want = (parts[0].shape[0] // _BS, sum(int(p.shape[1]) for p in parts))
    if tuple(given.shape) != want or given.dtype != jnp.uint8:
        raise ValueError(f"{what}: given_scales must be the (M/32, K) = {want} uint8 scale "
                         f"bytes a col_scales=True call of the same x returned; got "
                         f"{given.dtype}{tuple(given.shape)}")


def _check_parts(parts: tuple[jax.Array, ...], what: str) -> None:
    """A clear error unless ``parts`` are 2-D bf16/fp32 (M, K_i) of one M and dtype, each
    dimension a multiple of 128."""
    if not parts:
        raise ValueError(f"{what}: no column parts given; pass an (M, K) array or its parts")
    for i, part in enumerate(parts):
        name = "x" if len(parts) == 1 else f"x part {i}"
        if part.ndim != 2 or part.dtype not in (jnp.bfloat16, jnp.float32):
            raise TypeError(f"{what}: expected a 2-D bfloat16 or float32 {name}, got "
                            f"{part.dtype}{tuple(part.shape)}")
        if part.shape[0] % GROUP or part.shape[1] % GROUP:
            raise ValueError(f"{what}: {name}'s (M, K) = {tuple(part.shape)} must be multiples "
                             f"of {GROUP}; pad with zeros first "
                             f"(blocked_operands.quantize_operands does)")
        if part.shape[0] != parts[0].shape[0] or part.dtype != parts[0].dtype:
            raise ValueError(f"{what}: column parts must share M and dtype; part 0 is "
                             f"{parts[0].dtype}{tuple(parts[0].shape)}, part {i} "
                             f"{part.dtype}{tuple(part.shape)}")


def _check_block(block: tuple[int, ...], rows: bool, rows_t: bool, tiles_t: bool) -> None:
    sizes = (_BS, 2 * _BS, GROUP)
    if rows and not (rows_t or tiles_t):
        ok, want = len(block) == 2 and block[0] in sizes and block[1] == GROUP, \
            "(32, 128), (64, 128) or (128, 128) for rows alone"
    elif rows_t and not rows:
        ok, want = len(block) == 2 and block[0] == GROUP and block[1] in sizes, \
            "(128, 32), (128, 64) or (128, 128) for rows_t alone"
    else:
        ok, want = block == (GROUP, GROUP), "(128, 128) for tiles_t or several outputs"
    if not ok:
        raise ValueError(f"quantize_blocked_2d: block={block} cannot serve this call; "
                         f"expected {want}")


class _Call(NamedTuple):
    """One part's kernel call (static): its outputs, and where its columns start in them."""

    rows: bool
    cols: bool
    tiles: bool
    interpret: bool
    path: ElementPath
    one_cast: bool  # the native path's codes by one e4m3 cast (``_cast_shift``)
    num_warps: int
    block: tuple[int, int]
    whole: bool
    packed: bool  # the transposed codes stored as int32 words of four (``_kernel_packed``)
    pre: Prologue | None  # applied to x's values as they are loaded
    col_scales: bool  # the rows' call also writes the colwise scale bytes (M/32, K)
    given: bool  # the transposed output's call reads them (an input after x)
    c0: int  # the part's first column in the whole (M, K)
    k: int  # the whole's K

    def outs(self, m: int) -> list[tuple[Any, Any]]:
        """(BlockSpec, ShapeDtypeStruct) of every output, the whole's shapes, this part's
        blocks: program (i, j) writes block column j + (the part's first block)."""
        br, bc = self.block
        u8, k = jnp.uint8, self.k
        jr, jc = self.c0 // GROUP, self.c0 // bc  # rows: bc == 128
        outs: list[tuple[Any, Any]] = []
        if self.rows:  # one scale per row of the block
            outs += [(pl.BlockSpec((br, bc), lambda i, j: (i, j + jr)),
                      jax.ShapeDtypeStruct((m, k), u8)),
                     (pl.BlockSpec((br, 1), lambda i, j: (i, j + jr)),
                      jax.ShapeDtypeStruct((m, k // GROUP), u8))]
        if self.col_scales:  # one byte per 32x1 block: (bands, 128) per program
            outs.append((pl.BlockSpec((br // _BS, bc), lambda i, j: (i, j + jr)),
                         jax.ShapeDtypeStruct((m // _BS, k), u8)))
        if self.cols:  # br == 128; scales (M/128, K) or (M/128, K/128), transposed at the end
            width, js = (1, self.c0 // GROUP) if self.tiles else (bc, jc)
            q, t = (_PACK, jnp.int32) if self.packed else (1, u8)  # codes per stored element
            outs += [(pl.BlockSpec((bc, br // q), lambda i, j: (j + jc, i)),
                      jax.ShapeDtypeStruct((k, m // q), t)),
                     (pl.BlockSpec((1, width), lambda i, j: (i, j + js)),
                      jax.ShapeDtypeStruct((m // GROUP, k // GROUP if self.tiles else k), u8))]
        return outs


def _inputs(x_ref: Any, *refs: Any, read: int, skip: int, body: functools.partial[None]
            ) -> None:
    """The kernel body given x's ref, the ``read`` inputs after it and the outputs, not the
    aliased output inputs (``skip``: written, never read)."""
    body(x_ref, *refs[:read], *refs[read + skip:])


def _call_part(x: jax.Array, given: jax.Array | None, written: list[jax.Array], c: _Call
               ) -> list[jax.Array]:
    """The raw outputs (uint8; the transposed codes int32 words if packed) with ``x``'s columns
    written (into ``written``, the previous parts' outputs, where given: aliased, so XLA updates
    them in place); ``given``: the whole's colwise scale bytes (``_Call.given``)."""
    m, kx = x.shape
    br, bc = c.block
    if c.packed:
        kernel = functools.partial(_kernel_packed, rows=c.rows, tiles=c.tiles, path=c.path,
                                   one_cast=c.one_cast, pre=c.pre)
    elif c.whole:
        kernel = functools.partial(_kernel_whole, rows=c.rows, cols=c.cols, tiles=c.tiles,
                                   path=c.path, one_cast=c.one_cast, bands=br // _BS, pre=c.pre)
    else:
        kernel = functools.partial(_kernel, rows=c.rows, cols=c.cols, tiles=c.tiles,
                                   path=c.path, one_cast=c.one_cast, bands=br // _BS, pre=c.pre,
                                   col_scales=c.col_scales, given=c.given)
    outs = c.outs(m)
    read = [given] if c.given else []  # the part's columns of the whole's bytes
    jc = c.c0 // bc
    kernel = functools.partial(_inputs, read=len(read), skip=len(written), body=kernel)
    in_specs = [pl.BlockSpec((br, bc), lambda i, j: (i, j))]
    in_specs += [pl.BlockSpec((br // _BS, bc), lambda i, j: (i, j + jc)) for _ in read]
    in_specs += [o[0] for o in outs if written]
    return list(pl.pallas_call(
        kernel, out_shape=[o[1] for o in outs], grid=(m // br, kx // bc), in_specs=in_specs,
        out_specs=[o[0] for o in outs], compiler_params=triton_params(c.num_warps),
        input_output_aliases={1 + len(read) + i: i for i in range(len(written))},
        interpret=c.interpret, name="mxfp8_quantize_blocked",
    )(x, *read, *written))


@functools.partial(jax.jit, static_argnums=tuple(range(2, 14)))
def _quantize_blocked(parts: tuple[jax.Array, ...], given: jax.Array | None, rows: bool,
                      cols: bool, tiles: bool, interpret: bool, path: ElementPath,
                      num_warps: int, block: tuple[int, int], whole: bool, packed: bool,
                      pre: Prologue | None, one_cast: bool, col_scales: bool) -> BlockedPlanes:
    k = sum(int(p.shape[1]) for p in parts)
    res: list[jax.Array] = []
    c0 = 0
    for x in parts:
        res = _call_part(x, given, res, _Call(
            rows, cols, tiles, interpret, path, one_cast, num_warps, block, whole, packed, pre,
            col_scales, given is not None, c0, k))
        c0 += int(x.shape[1])
    e4 = jnp.float8_e4m3fn
    r = Reblocked(lax.bitcast_convert_type(res.pop(0), e4), res.pop(0)) if rows else None
    cs = res.pop(0) if col_scales else None
    t = None
    if cols:
        codes = res.pop(0)
        if packed:  # int32 words (K, M/4) -> their little-endian bytes, row 4i + r at byte r
            codes = lax.bitcast_convert_type(codes, jnp.uint8).reshape(k, -1)
        t = Reblocked(lax.bitcast_convert_type(codes, e4), res.pop(0).T)
    return BlockedPlanes(r, None if tiles else t, t if tiles else None, cs)
