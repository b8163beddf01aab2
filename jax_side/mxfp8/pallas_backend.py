"""The ``pallas`` backend: the 2-D Pallas kernels of ``pallas_impl`` behind the backend interface
(:data:`BACKEND`, a ``backend_api.KernelBackend``).

Same functions, arguments and results as ``xla_backend`` (``quantize``, ``partial_block_amax``,
``scales_from_amax``, ``cast_slice``; inputs validated by ``quantize.py`` / ``slices.py``), and
byte-identical results: tested against ``xla`` on the corner-case table, NaN/Inf/subnormal inputs,
both dtypes, both planes, odd valid shapes and partial slices.

Where it runs: on a CUDA GPU the kernels are compiled through Pallas's Triton lowering; anywhere
else (CPU) they run in Pallas **interpret mode** -- the same kernel code evaluated by XLA, slow,
for tests and CI (``kernel_report`` says so: ``execution``). Flat slices (the distributed
recipe) materialise the 32-row band the slice touches (``bands``), zero-padded, and run the 2-D
kernels on it: one extra copy of the band in and out, small next to a whole parameter. GEMMs run
the shared implementations of ``gemm_impls``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from common.formats import BLOCK_SIZE, Plane, PlaneData
from common.gemm_roles import GemmRole
from common.kernels import Backend, GemmImpl, Platform
from jax_side.mxfp8 import pallas_impl
from jax_side.mxfp8.backend_api import (
    Availability,
    Capabilities,
    Execution,
    KernelBackend,
    Site,
    cc_text,
    default_platform,
)
from jax_side.mxfp8.bands import Band, band, band_values
from jax_side.mxfp8.gemm_impls import run_gemm
from jax_side.mxfp8.pallas_tiles import MAX_FLAT_INDEX, FlatView
from jax_side.mxfp8.tensor import BlockAmax, MXFP8Tensor, SliceCast

__all__ = ["BACKEND", "PallasBackend", "cast_slice", "interpret_mode", "partial_block_amax",
           "quantize", "scales_from_amax"]

_BS = BLOCK_SIZE


def interpret_mode() -> bool:
    """True where the kernels cannot be compiled: JAX work lands on the CPU (no CUDA GPU, or
    ``jax.default_device`` set to the CPU). Work on CPU tensors in a GPU process resolves to the
    ``xla`` backend instead (``kernels.resolve_kernels``)."""
    return BACKEND.capabilities.execution(default_platform()) is Execution.INTERPRETED


def quantize(x: jax.Array, *, rowwise: bool, colwise: bool) -> MXFP8Tensor:
    """Both or one plane of a validated (M, K) bf16/fp32 x, x read once."""
    p = pallas_impl.quantize_2d(x, rowwise=rowwise, colwise=colwise, interpret=interpret_mode())
    planes = {Plane.ROWWISE: PlaneData(p.rowwise_data, p.rowwise_scale),
              Plane.COLWISE: PlaneData(p.colwise_data, p.colwise_scale)}
    m, k = x.shape
    return MXFP8Tensor({k: v for k, v in planes.items() if v.data is not None}, (m, k),
                       np.dtype(x.dtype))


def scales_from_amax(amax: jax.Array) -> jax.Array:
    """float8_e8m0fnu scales of validated fp32 amax (any shape)."""
    return pallas_impl.scales_from_amax(amax, interpret=interpret_mode())


def partial_block_amax(flat: jax.Array, shape: tuple[int, int], start: int, rowwise: bool,
                       colwise: bool, offset: int = 0, n: int | None = None,
                       read_as: DTypeLike | None = None) -> BlockAmax:
    """fp32 block amax of a validated slice, full scale shapes (zeros elsewhere): all of
    ``flat``, or (``n`` given) ``flat[offset : offset + n]`` read where it lies (``_in_place``),
    its values converted to ``read_as`` as they are loaded (which reads in place)."""
    read = _name(flat, read_as)
    in_place = n is not None or read is not None
    n = int(flat.shape[0]) if n is None else int(n)
    return _partial_amax(flat, int(offset), n, tuple(shape), int(start), bool(rowwise),
                         bool(colwise), interpret_mode(), in_place, read)


def _name(flat: jax.Array, read_as: DTypeLike | None) -> str | None:
    """The dtype the kernels convert loaded values to: None where ``flat`` holds it already."""
    return None if read_as is None or jnp.dtype(read_as) == flat.dtype else jnp.dtype(
        read_as).name


def _in_place(b: Band, k: int, offset: int, read_as: str | None) -> FlatView:
    """How the kernels read the band of a slice at ``offset`` of its buffer: band element (r, c)
    at ``offset - pad_left + r*K + c``, only the slice's own positions (zeros around them, as
    ``band_values`` pads), converted to ``read_as`` as loaded."""
    return FlatView(offset - b.pad_left, k, b.pad_left, b.rows * k - b.pad_right,
                    b.pad_left > 0 or b.pad_right > 0, read_as)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6, 7, 8, 9))
def _partial_amax(flat: jax.Array, offset: int, n: int, shape: tuple[int, int], start: int,
                  rowwise: bool, colwise: bool, interpret: bool, in_place: bool,
                  read_as: str | None) -> BlockAmax:
    m, k = shape
    if n == 0:
        return _placed(BlockAmax(None, None), None, shape, rowwise, colwise)
    b = band(m, k, start, n)
    if in_place:
        part = pallas_impl.block_amax_in_place(flat, _in_place(b, k, offset, read_as),
                                               (b.rows, k), rowwise=rowwise, colwise=colwise,
                                               interpret=interpret)
    else:  # zero padding never raises an amax
        part = pallas_impl.block_amax_2d(band_values(flat, k, b), rowwise=rowwise,
                                         colwise=colwise, interpret=interpret)
    return _placed(part, b, shape, rowwise, colwise)


def _placed(part: BlockAmax, b: Band | None, shape: tuple[int, int], rowwise: bool,
            colwise: bool) -> BlockAmax:
    """The (M, K) parameter's block amax planes asked for: zeros, with band ``b``'s amax
    ``part`` (if any) at its rows."""
    m, k = shape
    row = jnp.zeros((m, k // _BS), jnp.float32) if rowwise else None
    col = jnp.zeros((m // _BS, k), jnp.float32) if colwise else None
    if b is not None and row is not None:
        row = lax.dynamic_update_slice(row, part.rowwise, (b.row0, 0))
    if b is not None and col is not None:
        col = lax.dynamic_update_slice(col, part.colwise, (b.row0 // _BS, 0))
    return BlockAmax(row, col)


def cast_slice(flat: jax.Array, shape: tuple[int, int], start: int, row_b: jax.Array | None,
               col_b: jax.Array | None, offset: int = 0, n: int | None = None,
               read_as: DTypeLike | None = None) -> SliceCast:
    """e4m3 of a validated slice with given uint8 scale bytes (either may be None): all of
    ``flat``, or (``n`` given) ``flat[offset : offset + n]`` read where it lies, converted to
    ``read_as`` as loaded (``partial_block_amax``)."""
    read = _name(flat, read_as)
    in_place = n is not None or read is not None
    n = int(flat.shape[0]) if n is None else int(n)
    return _cast_slice(flat, row_b, col_b, int(offset), n, tuple(shape), int(start),
                       interpret_mode(), in_place, read)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7, 8, 9))
def _cast_slice(flat: jax.Array, rs: jax.Array | None, cs: jax.Array | None, offset: int,
                n: int, shape: tuple[int, int], start: int, interpret: bool,
                in_place: bool, read_as: str | None) -> SliceCast:
    m, k = shape
    if n == 0:
        empty = jnp.zeros((0,), jnp.float8_e4m3fn)
        return SliceCast(None if rs is None else empty, None if cs is None else empty)
    b = band(m, k, start, n)
    band_rs = None if rs is None else rs[b.row0:b.row1]
    band_cs = None if cs is None else cs[b.row0 // _BS:b.row1 // _BS]
    if in_place:
        out = pallas_impl.cast_in_place(flat, _in_place(b, k, offset, read_as), (b.rows, k),
                                        band_rs, band_cs, interpret=interpret)
    else:
        out = pallas_impl.cast_2d(band_values(flat, k, b), band_rs, band_cs,
                                  interpret=interpret)

    def finish(y):  # (R, K) band plane -> the slice's n elements
        return None if y is None else y.reshape(-1)[b.pad_left:b.pad_left + n]

    return SliceCast(finish(out.rowwise), finish(out.colwise))


def writes_in_place(buf: jax.Array, out: jax.Array, shape: tuple[int, int], start: int,
                    n: int) -> bool:
    """Whether ``cast_slice_into`` writes the slice's planes into ``out`` in place: a non-empty
    slice of whole 32-row bands (no masked rows: a whole parameter, or block-atomic rows) and
    both buffers within the kernels' int32 offsets."""
    if n == 0 or max(buf.shape[0], out.shape[0]) >= MAX_FLAT_INDEX:
        return False
    b = band(*shape, start, n)
    return b.pad_left == 0 and b.pad_right == 0


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7, 8, 9, 10))
def _cast_slice_into(out: jax.Array, buf: jax.Array, rs: jax.Array, cs: jax.Array,
                     ats: tuple[int, int], offset: int, n: int, shape: tuple[int, int],
                     start: int, interpret: bool, read_as: str | None) -> jax.Array:
    m, k = shape
    b = band(m, k, start, n)
    return pallas_impl.cast_into_in_place(
        out, ats, buf, _in_place(b, k, offset, read_as), (b.rows, k), rs[b.row0:b.row1],
        cs[b.row0 // _BS:b.row1 // _BS], interpret=interpret)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8))
def _quantize_slice_into(out: jax.Array, buf: jax.Array, ats: tuple[int, int], offset: int,
                         n: int, shape: tuple[int, int], start: int, interpret: bool,
                         read_as: str | None) -> tuple[jax.Array, BlockAmax]:
    m, k = shape
    b = band(m, k, start, n)
    out, part = pallas_impl.quantize_into_in_place(
        out, ats, buf, _in_place(b, k, offset, read_as), (b.rows, k), interpret=interpret)
    return out, _placed(part, b, shape, True, True)


class PallasBackend(KernelBackend):
    """The project's Pallas kernels: compiled on a CUDA GPU, interpreted (slow) on the CPU."""

    name = Backend.PALLAS.value
    capabilities = Capabilities(
        runs_on=((Platform.CPU, Execution.INTERPRETED), (Platform.GPU, Execution.COMPILED)),
        slices=True,
        own_gemm=False,
    )

    def availability(self, site: Site) -> Availability:
        """Fit for the automatic default on a CUDA GPU only: interpreted on the CPU is slow, and
        Triton on another GPU is untested here."""
        if site.platform is Platform.CPU:
            return Availability.on_request(
                "interpret mode for work on the CPU: the kernel code evaluated by XLA, slow"
            )
        if site.compute_capability is None:
            return Availability.on_request(
                "compiled by Pallas for a GPU that is not CUDA (untested here)"
            )
        return Availability.default(
            f"the project's Pallas kernels compiled with Triton on "
            f"{cc_text(site.compute_capability)}"
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

    # In place: the kernels read the slice from its buffer (int32 offsets: MAX_FLAT_INDEX),
    # converting each value to read_as as it is loaded

    def partial_block_amax_at(self, buf: jax.Array, offset: int, n: int,
                              shape: tuple[int, int], start: int, planes: tuple[Plane, ...],
                              *, read_as: jnp.dtype | None = None) -> BlockAmax:
        if buf.shape[0] >= MAX_FLAT_INDEX:
            return super().partial_block_amax_at(buf, offset, n, shape, start, planes,
                                                 read_as=read_as)
        return partial_block_amax(buf, shape, start, Plane.ROWWISE in planes,
                                  Plane.COLWISE in planes, offset, n, read_as)

    def cast_slice_at(self, buf: jax.Array, offset: int, n: int, shape: tuple[int, int],
                      start: int, row_b: jax.Array | None, col_b: jax.Array | None,
                      *, read_as: jnp.dtype | None = None) -> SliceCast:
        if buf.shape[0] >= MAX_FLAT_INDEX:
            return super().cast_slice_at(buf, offset, n, shape, start, row_b, col_b,
                                         read_as=read_as)
        return cast_slice(buf, shape, start, row_b, col_b, offset, n, read_as)

    def cast_slice_into(self, out: jax.Array, ats: tuple[int, int], buf: jax.Array,
                        offset: int, n: int, shape: tuple[int, int], start: int,
                        row_b: jax.Array, col_b: jax.Array, *,
                        read_as: jnp.dtype | None = None) -> jax.Array:
        if not writes_in_place(buf, out, shape, start, n):
            return super().cast_slice_into(out, ats, buf, offset, n, shape, start, row_b, col_b,
                                           read_as=read_as)
        return _cast_slice_into(out, buf, row_b, col_b, ats, offset, n, shape, start,
                                interpret_mode(), _name(buf, read_as))

    def quantize_slice_into(self, out: jax.Array, ats: tuple[int, int], buf: jax.Array,
                            offset: int, n: int, shape: tuple[int, int], start: int, *,
                            read_as: jnp.dtype | None = None) -> tuple[jax.Array, BlockAmax]:
        if not writes_in_place(buf, out, shape, start, n):
            return super().quantize_slice_into(out, ats, buf, offset, n, shape, start,
                                               read_as=read_as)
        return _quantize_slice_into(out, buf, ats, offset, n, shape, start, interpret_mode(),
                                    _name(buf, read_as))

    def matmul(self, a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole,
               gemm: GemmImpl | None) -> jax.Array:
        assert gemm is not None  # the resolver names one for a backend without its own GEMM
        return run_gemm(a, b, role, gemm)

    def matmul_rounded(self, a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole,
                       gemm: GemmImpl | None, out_dtype: jnp.dtype) -> jax.Array:
        assert gemm is not None
        return run_gemm(a, b, role, gemm, out_dtype)


BACKEND = PallasBackend()
