"""The ``xla`` backend: whole-tensor quantize and the slice building blocks, in pure JAX.

Bit-exact to DESIGN.md 3 on every platform (the element and scale arithmetic is in
``xla_impl``). Whole-tensor quantization is *defined* as the composition of the three slice
building blocks (``partial_block_amax`` over the whole tensor, ``scales_from_amax``,
``cast_slice``), so the distributed recipe of DESIGN.md 5 -- partial amax per rank, all-reduce
MAX, scales everywhere, cast of owned elements -- is the same code path split differently.

Flat slices: a slice of a row-major (M, K) tensor is a 1-D array holding flat elements
``[start, start + n)``; only its 32-row band (``bands``) is materialised. Inputs are validated by
the callers (``slices.py``, ``quantize.py``). Its GEMM implementations are in ``gemm_impls``.
:data:`BACKEND` is this module behind the declared interface (``backend_api.KernelBackend``).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from common.formats import BLOCK_SIZE, Plane, PlaneData
from common.gemm_roles import GemmRole
from common.kernels import Backend, GemmImpl, Platform
from jax_side.mxfp8 import xla_impl
from jax_side.mxfp8.backend_api import Availability, Capabilities, Execution, KernelBackend, Site
from jax_side.mxfp8.bands import Band, band, band_values
from jax_side.mxfp8.gemm_impls import run_gemm
from jax_side.mxfp8.tensor import BlockAmax, MXFP8Tensor, SliceCast

__all__ = ["BACKEND", "XlaBackend", "cast_slice", "partial_block_amax", "quantize",
           "scales_from_amax"]

_BS = BLOCK_SIZE


def _band_bits(flat: jax.Array, k: int, b: Band) -> jax.Array:
    return band_values(xla_impl.fp32_bits(flat), k, b)  # zero bits never raise an amax


@partial(jax.jit, static_argnums=(1, 2, 3, 4))
def partial_block_amax(flat: jax.Array, shape: tuple[int, int], start: int, rowwise: bool,
                       colwise: bool) -> BlockAmax:
    """fp32 block amax of a validated slice, full scale shapes (zeros elsewhere)."""
    # One compiled program per (slice length, shape, start): FSDP calls repeat them every step.
    m, k = shape
    n = int(flat.shape[0])
    row = jnp.zeros((m, k // _BS), jnp.uint32) if rowwise else None
    col = jnp.zeros((m // _BS, k), jnp.uint32) if colwise else None
    if n > 0:
        b = band(m, k, start, n)
        part = xla_impl.block_amax_2d(_band_bits(flat, k, b), rowwise=rowwise, colwise=colwise)
        if rowwise:
            row = lax.dynamic_update_slice(row, part.rowwise, (b.row0, 0))
        if colwise:
            col = lax.dynamic_update_slice(col, part.colwise, (b.row0 // _BS, 0))

    def as_f32(a: jax.Array | None) -> jax.Array | None:
        return None if a is None else lax.bitcast_convert_type(a, jnp.float32)

    return BlockAmax(as_f32(row), as_f32(col))


@jax.jit
def scales_from_amax(amax: jax.Array) -> jax.Array:
    """float8_e8m0fnu scales (same shape) of validated fp32 amax."""
    return lax.bitcast_convert_type(xla_impl.scale_bytes_from_amax(amax), jnp.float8_e8m0fnu)


@partial(jax.jit, static_argnums=(1, 2))
def cast_slice(flat: jax.Array, shape: tuple[int, int], start: int, row_b: jax.Array | None,
               col_b: jax.Array | None) -> SliceCast:
    """e4m3 of a validated slice with given uint8 scale bytes (either may be None)."""
    m, k = shape
    n = int(flat.shape[0])
    if n == 0:
        empty = jnp.zeros((0,), jnp.float8_e4m3fn)
        return SliceCast(None if row_b is None else empty, None if col_b is None else empty)
    b = band(m, k, start, n)
    bits = _band_bits(flat, k, b)  # (R, K) rows [row0, row1)
    rows = b.row1 - b.row0

    def finish(y: jax.Array) -> jax.Array:
        return y.reshape(-1)[b.pad_left : b.pad_left + n]

    row = col = None
    if row_b is not None:
        band_scale = lax.dynamic_slice(row_b, (b.row0, 0), (rows, k // _BS))
        row = finish(xla_impl.cast_2d(bits, xla_impl.expand_rowwise(band_scale)))
    if col_b is not None:
        band_scale = lax.dynamic_slice(col_b, (b.row0 // _BS, 0), (rows // _BS, k))
        col = finish(xla_impl.cast_2d(bits, xla_impl.expand_colwise(band_scale)))
    return SliceCast(row, col)


def _bytes(scale: jax.Array | None) -> jax.Array | None:
    return None if scale is None else lax.bitcast_convert_type(scale, jnp.uint8)


@partial(jax.jit, static_argnames=("rowwise", "colwise"))
def quantize(x: jax.Array, *, rowwise: bool, colwise: bool) -> MXFP8Tensor:
    """Both or one plane of a validated (M, K) bf16/fp32 x: the slice blocks on the whole tensor."""
    m, k = x.shape
    flat = x.reshape(-1)  # (M*K,) row-major
    amax = partial_block_amax(flat, (m, k), 0, rowwise, colwise)
    rs = None if amax.rowwise is None else scales_from_amax(amax.rowwise)
    cs = None if amax.colwise is None else scales_from_amax(amax.colwise)
    cast = cast_slice(flat, (m, k), 0, _bytes(rs), _bytes(cs))
    planes = {}
    if rs is not None:
        planes[Plane.ROWWISE] = PlaneData(cast.rowwise.reshape(m, k), rs)
    if cs is not None:
        planes[Plane.COLWISE] = PlaneData(cast.colwise.reshape(m, k), cs)
    return MXFP8Tensor(planes, shape=(m, k), dtype=np.dtype(x.dtype))


class XlaBackend(KernelBackend):
    """The reference backend: every operation, compiled by XLA on every platform."""

    name = Backend.XLA.value
    capabilities = Capabilities(
        runs_on=((Platform.CPU, Execution.COMPILED), (Platform.GPU, Execution.COMPILED)),
        slices=True,
        own_gemm=False,
    )

    def availability(self, site: Site) -> Availability:
        return Availability.default(
            f"the project's pure-JAX reference, compiled by XLA for work on the "
            f"{site.platform.name}"
        )

    def quantize(self, x: jax.Array, *, planes: tuple[Plane, ...]) -> MXFP8Tensor:
        return quantize(x, rowwise=Plane.ROWWISE in planes, colwise=Plane.COLWISE in planes)

    def partial_block_amax(self, flat: jax.Array, shape: tuple[int, int], start: int,
                           planes: tuple[Plane, ...]) -> BlockAmax:
        return partial_block_amax(
            flat, shape, start, Plane.ROWWISE in planes, Plane.COLWISE in planes
        )

    def scales_from_amax(self, amax: jax.Array) -> jax.Array:
        return scales_from_amax(amax)

    def cast_slice(self, flat: jax.Array, shape: tuple[int, int], start: int,
                   row_b: jax.Array | None, col_b: jax.Array | None) -> SliceCast:
        return cast_slice(flat, shape, start, row_b, col_b)

    def matmul(self, a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole,
               gemm: GemmImpl | None) -> jax.Array:
        assert gemm is not None  # the resolver names one for a backend without its own GEMM
        return run_gemm(a, b, role, gemm)

    def matmul_rounded(self, a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole,
                       gemm: GemmImpl | None, out_dtype: jnp.dtype) -> jax.Array:
        assert gemm is not None
        return run_gemm(a, b, role, gemm, out_dtype)


BACKEND = XlaBackend()
