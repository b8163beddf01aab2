"""Activations and gradients quantized straight into the ``fp8_blocked`` GEMM's operand layouts
(DESIGN.md 11, issue 33), and the GEMMs of the linear layer's three roles on them.

``jax_side.linear`` calls these when its kernels' GEMM is ``fp8_blocked`` (or
``fp8_blocked_pallas``): x and dy are quantized once into what the GEMMs read -- 1x128 blocks for
the ``a`` operands, x^T in 128x128 tiles kept from the forward for wgrad -- instead of MXFP8
planes that every GEMM then re-blocks (and, for wgrad, transposes). Weights stay MXFP8 planes
(FSDP's gathered bytes) and are re-blocked into tiles where each GEMM reads them
(:func:`weight_tiles`: one Pallas kernel on the ``pallas`` backend, ``gemm_impls.b_tiles``'s XLA
fusions elsewhere).

The bytes are those of quantize-then-re-block (:func:`from_planes`, the reference): on the
``pallas`` backend the kernel of ``pallas_blocked`` makes them (one call per output); on any
other backend the backend's own quantize runs, then ``reblock`` (the composition itself).

Padding: x (T, C) is zero-padded to multiples of 128 in both dims before it is quantized (the
token dim to ``blocked_tokens(T)``, at least 128). Zero rows and columns quantize to zero codes
and zero scale bytes, exactly what ``reblock.pad_to`` appends, so every GEMM sees the operands the
MXFP8-plane path gives it; outputs are cut back to the real rows and columns. (Padding tokens to
128 rather than 16 can change which cuBLASLt kernel runs for token counts that are not a multiple
of 128: the order of fp32 sums only.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from common.formats import BLOCK_SIZE, Plane, PlaneData, round_up
from common.gemm_roles import ROLES, GemmRole
from common.kernels import Backend, GemmImpl
from jax_side.mxfp8 import elementwise, epilogue, reblock
from jax_side.mxfp8.elementwise import Prologue
from jax_side.mxfp8.gemm_impls import (
    b_tiles,
    blocked_product,
    blocked_product_into,
    writes_directly,
)
from jax_side.mxfp8.kernels import ResolvedKernels
from jax_side.mxfp8.pallas_blocked import BlockedPlanes, quantize_blocked_2d
from jax_side.mxfp8.pallas_reblock import reads_in_place, reblock_tiles_2d, reblock_tiles_flat
from jax_side.mxfp8.quantize import quantize
from jax_side.mxfp8.tensor import MXFP8Tensor

__all__ = [
    "BLOCKED_GEMMS",
    "BlockedPlanes",
    "KernelChoice",
    "KeptTiles",
    "PlaneInBuffers",
    "WgradOperands",
    "backward",
    "blocked_gemm",
    "blocked_tokens",
    "forward",
    "forward_post",
    "forward_parts",
    "from_planes",
    "quantize_operands",
    "row_parts",
    "weight_tiles",
]

BLOCKED_GEMMS = (GemmImpl.FP8_BLOCKED, GemmImpl.FP8_BLOCKED_PALLAS)


class KernelChoice(NamedTuple):
    """One output's kernel configuration (``pallas_blocked.quantize_blocked_2d``'s knobs)."""

    block: tuple[int, int]  # x's block per program
    warps: int  # Triton warps per program
    whole: bool = False  # each program's block loaded at once (the transposed outputs only)
    packed: bool = False  # four rows' codes per int32 word through the transpose (likewise)
    # (a transposed output asked beside the rows) its colwise scale bytes made by the rows'
    # call, so this call reads x once (``quantize_blocked_2d``'s col_scales / given_scales)
    given: bool = False


# The fastest on the H200 at the 1.3B GPT's shapes (benchmarks/bench_blocked_operands.py,
# BENCHMARKS.md session 8; whole-block, packed and pair calls measured slower, sessions 14 and
# 18). The transposed outputs take their scale bytes from the rows' call (``given``): on an
# H100 a linear's two calls took 4-14 % less at the 1.3B shapes (BENCHMARKS.md session 19).
# An entry "rows+rows_t" or "rows+tiles_t" (block (128, 128)) makes that pair in one call
# (_pallas_operands); none is set until the bench shows one faster than two calls.
KERNEL_CONFIG: dict[str, KernelChoice] = {
    "rows": KernelChoice((32, 128), 2), "rows_t": KernelChoice((128, 64), 2, given=True),
    "tiles_t": KernelChoice((128, 128), 4, given=True)}
_G = reblock.GROUP
_F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class KeptTiles:
    """What the forward keeps of x for wgrad: x^T (K, T) in 128x128 tiles, padded to multiples of
    128 (``tiles``), and K before padding (``cols``, static)."""

    tiles: reblock.Reblocked
    cols: int


jax.tree_util.register_dataclass(KeptTiles, data_fields=["tiles"], meta_fields=["cols"])


class PlaneInBuffers(Protocol):
    """One plane of an (N, K) weight inside flat buffers (what ``jax_side.linear.FlatPlane``
    is): codes at ``data[data_offset:]``, row-major, scale bytes from ``scale[scale_offset]``."""

    @property
    def data(self) -> jax.Array: ...
    @property
    def scale(self) -> jax.Array: ...
    @property
    def data_offset(self) -> int: ...
    @property
    def scale_offset(self) -> int: ...
    @property
    def shape(self) -> tuple[int, int]: ...
    @property
    def plane(self) -> Plane: ...
    def tensor(self) -> MXFP8Tensor: ...


Weight = MXFP8Tensor | PlaneInBuffers  # a weight's MXFP8 planes, or one plane in flat buffers
Dtypes = tuple[jnp.dtype, jnp.dtype]  # (the result's dtype, the dtype the GEMM writes)


class WgradOperands(NamedTuple):
    """One wgrad GEMM's operands, handed to ``backward``'s ``on_wgrad``: dW (n, k) = the first
    (n, k) of ``a @ b^T`` (a: dy^T in 1x128 rows, b: x^T in 128x128 tiles, both padded), in
    ``dtype`` (the GEMM writes it: no rounding after). ``into`` writes it into a flat buffer."""

    a: reblock.Reblocked
    b: reblock.Reblocked
    n: int
    k: int
    dtype: jnp.dtype
    pallas: bool

    def into(self, buf: jax.Array, start: int) -> jax.Array:
        """``buf`` (1-D, of ``dtype``) with dW written row-major at element ``start``: the bytes
        of ``lax.dynamic_update_slice(buf, dW.reshape(-1), (start,))``, written by the GEMM
        itself where it can (``gemm_impls.blocked_product_into``)."""
        if buf.dtype != self.dtype:
            raise ValueError(f"WgradOperands.into: buf is {buf.dtype}, dW is {self.dtype}")
        return blocked_product_into(buf, start, self.a, self.b, self.n, self.k,
                                    pallas=self.pallas)

    def direct(self, dtype: jnp.dtype, start: int) -> bool:
        """Whether ``into`` at ``start`` of a ``dtype`` buffer is the GEMM writing in place (a
        custom call that takes the whole buffer), not a product and an update."""
        return writes_directly(dtype, start, self.a, self.b, self.n, self.k, pallas=self.pallas)


def blocked_tokens(tokens: int) -> int:
    """Token count after zero-padding for the blocked operands: a multiple of 128, >= 128."""
    return max(_G, round_up(tokens, _G))


def _padded(x: jax.Array) -> jax.Array:
    t, c = x.shape
    return jnp.pad(x, ((0, blocked_tokens(t) - t), (0, round_up(c, _G) - c)))


def _bytes(scale: jax.Array) -> jax.Array:
    return scale if scale.dtype == jnp.uint8 else lax.bitcast_convert_type(scale, jnp.uint8)


def from_planes(t: MXFP8Tensor, *, rows: bool, rows_t: bool, tiles_t: bool) -> BlockedPlanes:
    """The reference: the operands re-blocked from the MXFP8 planes of an (M, K) tensor whose
    dims are multiples of 128 (rows from the rowwise plane; rows_t / tiles_t from the colwise
    plane, transposed to (K, M))."""
    r = rt = tt = None
    if rows:
        d, s = t.plane(Plane.ROWWISE)
        r = reblock.reblock_rows(d, _bytes(s))
    if rows_t or tiles_t:
        d, s = t.plane(Plane.COLWISE)
        dt, st = d.T, _bytes(s).T
        rt = reblock.reblock_rows(dt, st) if rows_t else None
        tt = reblock.reblock_tiles(dt, st) if tiles_t else None
    return BlockedPlanes(r, rt, tt)


Parts = tuple[jax.Array, ...]  # column parts of one (T, C) tensor, each C_i a multiple of 128


def quantize_operands(x: jax.Array | Parts, *, rows: bool, rows_t: bool = False,
                      tiles_t: bool = False, kernels: ResolvedKernels,
                      pre: Prologue | None = None) -> BlockedPlanes:
    """The blocked operands of a (T, C) bf16/fp32 activation or gradient, padded (module
    docstring): ``rows`` (T128, C128) 1x128 along C; ``rows_t`` / ``tiles_t`` (C128, T128).
    ``x`` may be a tuple of column parts (each C_i a multiple of 128): the operands of their
    concatenation, which the ``pallas`` kernels write part by part (no concatenation); other
    backends concatenate first.

    ``pre`` (elementwise, ``elementwise.check``): the operands of ``pre(x)``. The ``pallas``
    kernels apply it as they load x when x needs no padding (T and C multiples of 128), so
    ``pre(x)`` is never written; otherwise ``pre(x)`` is computed first (XLA fuses it into its
    own quantize on the other backends). The same bytes either way on the CPU."""
    if not (rows or rows_t or tiles_t):
        raise ValueError("quantize_operands: rows, rows_t and tiles_t all False asks for nothing")
    if pre is not None:
        if isinstance(x, tuple):
            raise ValueError("quantize_operands: pre with column parts; apply it to each part "
                             "first")
        elementwise.check(pre, x.dtype, "quantize_operands")
        t, c = x.shape
        if not (kernels.backend is Backend.PALLAS and (t, c) == (blocked_tokens(t),
                                                                 round_up(c, _G))):
            x, pre = pre(x), None
    if isinstance(x, tuple):
        if any(p.ndim != 2 or p.shape[1] % _G for p in x):
            raise ValueError(f"quantize_operands: column parts must be 2-D with widths that are "
                             f"multiples of {_G}, got {[tuple(p.shape) for p in x]}; pass the "
                             f"concatenated tensor instead")
        if kernels.backend is Backend.PALLAS:
            return _pallas_operands(tuple(_padded(p) for p in x), rows, rows_t, tiles_t)
        x = jnp.concatenate(x, axis=1)
    xp = _padded(x)
    if kernels.backend is Backend.PALLAS:
        return _pallas_operands(xp, rows, rows_t, tiles_t, pre)
    planes = tuple(p for p, need in ((Plane.ROWWISE, rows), (Plane.COLWISE, rows_t or tiles_t))
                   if need)
    return from_planes(quantize(xp, planes=planes, kernels=kernels), rows=rows, rows_t=rows_t,
                       tiles_t=tiles_t)


def _pallas_operands(xp: jax.Array | Parts, rows: bool, rows_t: bool, tiles_t: bool,
                     pre: Prologue | None = None) -> BlockedPlanes:
    """One kernel call per output (``KERNEL_CONFIG``): each alone keeps less of x in registers
    than all together (measured on the H200, benchmarks/bench_blocked_operands.py: at 8192x8192
    bf16 the rows took 83 us and the x^T tiles 144 us alone, both together 296 us) -- unless
    ``KERNEL_CONFIG`` holds an entry for the pair asked, ``"rows+rows_t"`` or
    ``"rows+tiles_t"``: then one call makes both (x read once; ``whole=True`` makes both from
    one loaded block). A transposed output whose entry says ``given``, asked beside the rows,
    takes its colwise scale bytes from the rows' call (which writes them, ``col_scales``), so
    its own call reads x once instead of twice. The bytes are the same either way."""
    from jax_side.mxfp8.pallas_backend import interpret_mode

    interpret = interpret_mode()

    def call(*outputs: str, col_scales: bool = False,
             given: jax.Array | None = None) -> BlockedPlanes:
        choice = KERNEL_CONFIG["+".join(outputs)]
        return quantize_blocked_2d(xp, rows="rows" in outputs, rows_t="rows_t" in outputs,
                                   tiles_t="tiles_t" in outputs, interpret=interpret,
                                   num_warps=choice.warps, block=choice.block,
                                   whole=choice.whole, packed=choice.packed, pre=pre,
                                   col_scales=col_scales, given_scales=given)

    second = "rows_t" if rows_t else "tiles_t" if tiles_t else ""
    if rows and f"rows+{second}" in KERNEL_CONFIG:
        both = call("rows", second)
        third = call("tiles_t").tiles_t if rows_t and tiles_t else None
        return BlockedPlanes(both.rows, both.rows_t, both.tiles_t if third is None else third)
    asked = {"rows_t": rows_t, "tiles_t": tiles_t}
    given = rows and any(KERNEL_CONFIG[e].given for e, on in asked.items() if on)
    first = call("rows", col_scales=given) if rows else None
    scales = None if first is None else first.col_scales

    def transposed(e: str) -> reblock.Reblocked | None:
        if not asked[e]:
            return None
        return getattr(call(e, given=scales if KERNEL_CONFIG[e].given else None), e)

    return BlockedPlanes(None if first is None else first.rows, transposed("rows_t"),
                         transposed("tiles_t"))


def blocked_gemm(a: reblock.Reblocked, b: Weight | reblock.Reblocked, role: GemmRole,
                 kernels: ResolvedKernels, m: int, n: int,
                 out_dtype: jnp.dtype = _F32) -> jax.Array:
    """(m, n) of one role's GEMM: ``a`` from :func:`quantize_operands` (``rows`` for forward and
    dgrad, ``rows_t`` for wgrad); ``b`` a weight's MXFP8 planes (re-blocked into tiles here, as
    the role reads them) or wgrad's ``tiles_t``."""
    if kernels.gemm not in BLOCKED_GEMMS:
        raise ValueError(f"blocked_gemm: kernels' GEMM is {kernels.gemm}, not one of "
                         f"{[g.value for g in BLOCKED_GEMMS]}")
    rb = b if isinstance(b, reblock.Reblocked) else weight_tiles(b, role, kernels)
    if a.data.shape[1] != rb.data.shape[1]:
        raise ValueError(f"blocked_gemm({role.value}): a has K = {a.data.shape[1]}, b "
                         f"{rb.data.shape[1]} (both padded to multiples of {_G})")
    return blocked_product(a, rb, m, n, jnp.dtype(out_dtype),
                           pallas=kernels.gemm is GemmImpl.FP8_BLOCKED_PALLAS)


def weight_tiles(w: Weight, role: GemmRole, kernels: ResolvedKernels) -> reblock.Reblocked:
    """The weight's plane that ``role`` reads re-blocked into 128x128 tiles, padded (the GEMM's
    ``b``): on the ``pallas`` backend by one kernel (``pallas_reblock``; the colwise plane
    transposed inside it), reading a ``PlaneInBuffers`` where it lies when its dims are
    multiples of 128 (no copy of the slice first); elsewhere by XLA (``gemm_impls.b_tiles``).
    The same bytes on every path."""
    spec = ROLES[role]
    pallas = kernels.backend is Backend.PALLAS
    if not isinstance(w, MXFP8Tensor):
        if w.plane is not spec.b_plane:
            raise ValueError(f"weight_tiles({role.value}): the weight's {w.plane.value} plane "
                             f"was given; {role.value} reads its {spec.b_plane.value} plane")
        if pallas and reads_in_place(w.shape, w.data, w.scale):
            return reblock_tiles_flat(w.data, w.scale, w.data_offset, w.scale_offset, w.shape,
                                      colwise=spec.b_contract == 0, interpret=_interpret())
        w = w.tensor()
    if not pallas:
        return b_tiles(w, spec)[0]
    data, scale = w.plane(spec.b_plane)
    return reblock_tiles_2d(data, scale, colwise=spec.b_contract == 0, interpret=_interpret())


def _interpret() -> bool:
    from jax_side.mxfp8.pallas_backend import interpret_mode

    return interpret_mode()


def _made(r: reblock.Reblocked | None) -> reblock.Reblocked:
    if r is None:
        raise AssertionError("internal: quantize_operands did not make an operand it was asked for")
    return r


def forward(x2d: jax.Array, w: Weight, out_dtype: jnp.dtype, gemm_dtype: jnp.dtype,
            keep: bool, kernels: ResolvedKernels,
            pre: Prologue | None = None) -> tuple[jax.Array, KeptTiles | None]:
    """y = x W^T (T, N) in ``out_dtype`` (the GEMM writes ``gemm_dtype``), and, if ``keep``,
    x's tiles for wgrad; with ``pre``, of ``pre(x)`` (``quantize_operands``)."""
    (y,), kept = forward_parts(x2d, (w,), out_dtype, gemm_dtype, keep, kernels, pre)
    return y, kept


def forward_parts(x2d: jax.Array, ws: tuple[Weight, ...], out_dtype: jnp.dtype,
                  gemm_dtype: jnp.dtype, keep: bool, kernels: ResolvedKernels,
                  pre: Prologue | None = None,
                  ) -> tuple[tuple[jax.Array, ...], KeptTiles | None]:
    """``forward`` against several weights at once (``row_parts`` of one weight): x quantized
    once, one GEMM per weight, y_i = x W_i^T; the concatenation of the y_i is ``forward``'s y
    against the whole weight (the same operand bytes where each W_i's rows are a multiple of
    128: its tiles are the whole weight's)."""
    ops = quantize_operands(x2d, rows=True, tiles_t=keep, kernels=kernels, pre=pre)
    ys = tuple(blocked_gemm(_made(ops.rows), w, GemmRole.FORWARD, kernels, x2d.shape[0],
                            w.shape[0], gemm_dtype).astype(out_dtype) for w in ws)
    return ys, KeptTiles(_made(ops.tiles_t), x2d.shape[1]) if keep else None


def forward_post(x2d: jax.Array, w: Weight, post: str, keep: bool, kernels: ResolvedKernels,
                 ) -> tuple[jax.Array, jax.Array, KeptTiles | None]:
    """(post(y), y), bfloat16 (T, N), of y = x W^T with ``epilogue.EPILOGUES[post]`` applied in
    the GEMM's epilogue (the GELU: cuBLASLt's ``GELU_AUX`` on a GPU), and, if ``keep``, x's
    tiles for wgrad: ``forward``'s operands, one GEMM writing both outputs."""
    ops = quantize_operands(x2d, rows=True, tiles_t=keep, kernels=kernels)
    g, h = epilogue.EPILOGUES[post].product(
        _made(ops.rows), weight_tiles(w, GemmRole.FORWARD, kernels), x2d.shape[0], w.shape[0],
        pallas=kernels.gemm is GemmImpl.FP8_BLOCKED_PALLAS)
    return g, h, KeptTiles(_made(ops.tiles_t), x2d.shape[1]) if keep else None


def row_parts(w: Weight, parts: int) -> tuple[Weight, ...]:
    """The rowwise plane of an (N, K) weight as ``parts`` weights of N/parts rows each (the qkv
    weight's q, k and v), each a multiple of 128 rows so that its 128x128 tiles are the whole
    weight's: row slices of an ``MXFP8Tensor``, or the same buffers at later offsets for a
    plane in flat buffers (no copy)."""
    n, k = w.shape
    if parts < 1 or n % parts or (n // parts) % _G:
        raise ValueError(f"row_parts: {n} rows cannot make {parts} parts of a multiple of {_G} "
                         f"rows each; run the whole weight and split its output instead")
    h = n // parts
    if isinstance(w, MXFP8Tensor):
        d, sc = w.plane(Plane.ROWWISE)
        return tuple(MXFP8Tensor({Plane.ROWWISE: PlaneData(d[i * h:(i + 1) * h],
                                                           sc[i * h:(i + 1) * h])},
                                 (h, k), w.dtype) for i in range(parts))
    if w.plane is not Plane.ROWWISE or not dataclasses.is_dataclass(w):
        raise ValueError(f"row_parts: expected a rowwise plane in flat buffers (a dataclass such "
                         f"as jax_side.linear.FlatPlane), got {type(w).__name__} "
                         f"({w.plane.value})")
    per_row = k // BLOCK_SIZE  # rowwise scales: (N, K/32), row-major
    return tuple(dataclasses.replace(w, data_offset=w.data_offset + i * h * k,
                                     scale_offset=w.scale_offset + i * h * per_row,
                                     shape=(h, k)) for i in range(parts))


def backward(dy2d: jax.Array | Parts, w: Weight | None, kept: KeptTiles | None, dx: Dtypes,
             dw: Dtypes, kernels: ResolvedKernels,
             on_wgrad: Callable[[WgradOperands], None] | None = None,
             ) -> tuple[jax.Array | None, jax.Array | None]:
    """dgrad (T, K) if the weight's colwise planes ``w`` are given, wgrad (N, K) if x's tiles
    are: dy quantized once into dgrad's 1x128 rows and wgrad's dy^T rows (dy may be column
    parts, as ``forward_parts``' cotangents come: ``quantize_operands``). ``on_wgrad`` (where
    dW's two dtypes agree) also gets wgrad's operands: a caller that writes dW with them
    elsewhere (``WgradOperands.into``) leaves the returned dW unused, and XLA drops its GEMM."""
    if isinstance(dy2d, tuple):  # column parts (forward_parts' cotangents): no concatenation
        t, n = dy2d[0].shape[0], sum(p.shape[1] for p in dy2d)
    else:
        t, n = dy2d.shape
    if w is None and kept is None:
        return None, None
    ops = quantize_operands(dy2d, rows=w is not None, rows_t=kept is not None, kernels=kernels)
    gx = gw = None
    if w is not None:
        gx = blocked_gemm(_made(ops.rows), w, GemmRole.DGRAD, kernels, t, w.shape[1],
                          dx[1]).astype(dx[0])
    if kept is not None:
        gw = blocked_gemm(_made(ops.rows_t), kept.tiles, GemmRole.WGRAD, kernels, n, kept.cols,
                          dw[1]).astype(dw[0])
        if on_wgrad is not None and dw[0] == dw[1]:
            on_wgrad(WgradOperands(_made(ops.rows_t), kept.tiles, n, kept.cols, dw[1],
                                   kernels.gemm is GemmImpl.FP8_BLOCKED_PALLAS))
    return gx, gw
