"""The slice building blocks of distributed quantization (DESIGN.md 5), validated and dispatched.

``partial_block_amax`` -> (all-reduce MAX across ranks) -> ``scales_from_amax`` -> ``cast_slice``
reproduces whole-tensor ``quantize`` byte for byte for any split into flat slices. A flat slice of
a row-major (M, K) tensor is a 1-D array holding flat elements ``[start, start + n)``; shape and
start are static (one compiled program per slice, as FSDP repeats them every step).

``kernels`` (a ``KernelConfig``; ``backend=`` is shorthand for its backend field) resolves through
the one resolver, ``kernels.resolve_kernels``, whose ``slices`` field names the backend that runs
them: ``xla`` (the reference) or ``pallas`` (byte-identical); a configuration whose backend has
no slice building blocks (``te``) runs them on ``xla``, and ``kernel_report`` says so.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from common.formats import ALL_PLANES, Plane, check_mxfp8_shape, parse_planes, scale_shape
from common.kernels import Backend, KernelConfig
from jax_side.mxfp8.backend_api import KernelBackend
from jax_side.mxfp8.backends import backend_impl
from jax_side.mxfp8.kernels import ResolvedKernels, resolve_call
from jax_side.mxfp8.tensor import BlockAmax, SliceCast, scale_bytes

__all__ = ["BlockAmax", "SliceCast", "cast_slice", "cast_slice_into", "partial_block_amax",
           "quantize_slice_into", "scales_from_amax"]

INPUT_DTYPES = (jnp.bfloat16, jnp.float32)


def check_dtype(x: jax.Array, what: str) -> None:
    """bf16 or fp32 input, else a TypeError with the fix (float64 is never narrowed silently)."""
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{what}: MXFP8 quantizes bfloat16 or float32 input, got dtype {x.dtype}; "
            f"cast first, e.g. x.astype(jnp.bfloat16) (master weights: bf16(fp32 master))"
        )


def _check_start(start: int, what: str, name: str = "start", noun: str = "flat offset",
                 fix: str = "the slice's first row-major element index") -> int:
    try:
        return operator.index(start)
    except TypeError:
        raise TypeError(
            f"{what}: {name} must be an integer {noun}, got {start!r} "
            f"({type(start).__name__}); pass {fix}"
        ) from None


def _check_slice(
    flat: jax.Array, shape: tuple[int, int], start: int, what: str, offset: int = 0,
    numel: int | None = None,
) -> tuple[int, int, int, int]:
    m, k = check_mxfp8_shape(shape, what)
    start = _check_start(start, what)
    if flat.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D flat slice, got shape {tuple(flat.shape)}")
    size = int(flat.shape[0])
    offset = _check_start(offset, what, "offset", "position in flat",
                          "where the slice starts in flat")
    n = size - offset if numel is None else _check_start(numel, what, "numel", "count",
                                                         "the slice's element count")
    if offset < 0 or n < 0 or offset + n > size:
        raise ValueError(
            f"{what}: the slice flat[offset : offset + numel] = [{offset}, {offset + n}) lies "
            f"outside flat's {size} elements; pass the slice's position in flat"
        )
    if start < 0 or start + n > m * k:
        raise ValueError(
            f"{what}: slice [start, start + n) = [{start}, {start + n}) lies outside the "
            f"{m * k} elements of shape {(m, k)}; pass the slice's flat row-major start offset"
        )
    return m, k, n, start


def _check_read_as(read_as: DTypeLike | None, flat: jax.Array, what: str) -> jnp.dtype | None:
    """The dtype the slice is read as, None where it is flat's own (or read_as is None)."""
    if read_as is None:
        return None
    try:
        dtype = jnp.dtype(read_as)
    except TypeError:
        dtype = None
    if dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{what}: read_as must be bfloat16 or float32 (the dtype MXFP8 quantizes; the recipe "
            f"reads fp32 master weights as bf16), got {read_as!r}; pass jnp.bfloat16, "
            f"jnp.float32 or None (flat's own dtype)"
        )
    return None if dtype == flat.dtype else dtype


def _slice_impl(what: str, kernels: KernelConfig | ResolvedKernels | None,
                backend: Backend | str | None, *operands: Any) -> KernelBackend:
    return backend_impl(resolve_call(what, kernels, backend, operands=operands).slices)


def partial_block_amax(
    flat: jax.Array,
    shape: tuple[int, int],
    start: int,
    *,
    planes: Plane | str | Iterable[Plane | str] = ALL_PLANES,
    backend: Backend | str | None = None,
    kernels: KernelConfig | ResolvedKernels | None = None,
    offset: int = 0,
    numel: int | None = None,
    read_as: DTypeLike | None = None,
) -> BlockAmax:
    """Block amax of the part of a (M, K) tensor held in a flat slice.

    flat: 1-D bf16/fp32, elements ``[start, start + n)`` of the row-major (M, K) tensor; shape and
    start are static; planes: which planes' amax to compute (default both). Returns fp32 arrays
    of the full scale shapes -- rowwise (M, K/32), blocks along K; colwise (M/32, K), blocks
    along M -- holding this slice's contribution and 0 elsewhere. Elementwise ``max`` over the
    results of any split into slices (e.g. an ``all_reduce(MAX)``) gives the whole tensor's
    block amax. NaN is ignored; Inf counts.

    ``offset`` / ``numel`` (static): the slice is ``flat[offset : offset + numel]`` of a longer
    buffer (numel None: to its end); the result is the same as for that slice cut out, and a
    backend whose kernels read a buffer in place (``pallas``) reads it there: no copy of the
    slice for the kernel (``KernelBackend.partial_block_amax_at``).

    ``read_as`` (bf16 or fp32, static): the slice's values are ``flat[...].astype(read_as)``
    (fp32 master weights read as the recipe's bf16, rounded to nearest even by JAX's
    conversion); the result is that of the converted slice, and a backend that reads in place
    converts each value as it loads it: no converted copy of the slice.
    """
    m, k, n, start = _check_slice(flat, shape, start, "partial_block_amax", offset, numel)
    check_dtype(flat, "partial_block_amax")
    read = _check_read_as(read_as, flat, "partial_block_amax")
    impl = _slice_impl("partial_block_amax", kernels, backend, flat)
    planes = parse_planes(planes, "partial_block_amax")
    if offset == 0 and n == flat.shape[0] and read is None:
        return impl.partial_block_amax(flat, (m, k), start, planes)
    return impl.partial_block_amax_at(flat, int(offset), n, (m, k), start, planes,
                                      read_as=read)


def scales_from_amax(
    amax: jax.Array,
    *,
    backend: Backend | str | None = None,
    kernels: KernelConfig | ResolvedKernels | None = None,
) -> jax.Array:
    """E8M0 scales (float8_e8m0fnu, same shape) from fp32 block amax, DESIGN.md 3 steps 2-3.

    amax must be non-negative (as produced by ``partial_block_amax``): +Inf gives 0xFE; a NaN
    amax (which ``partial_block_amax`` never produces, NaN being ignored) gives 0xFF, the E8M0 NaN.
    """
    if amax.dtype != jnp.float32:
        raise TypeError(f"scales_from_amax: expected float32 amax, got {amax.dtype}")
    return _slice_impl("scales_from_amax", kernels, backend, amax).scales_from_amax(amax)


def cast_slice(
    flat: jax.Array,
    shape: tuple[int, int],
    start: int,
    *,
    scales: Mapping[Plane, jax.Array] | Mapping[str, jax.Array],
    backend: Backend | str | None = None,
    kernels: KernelConfig | ResolvedKernels | None = None,
    offset: int = 0,
    numel: int | None = None,
    read_as: DTypeLike | None = None,
) -> SliceCast:
    """Cast a flat slice of a (M, K) tensor to e4m3 with precomputed full scales.

    flat: 1-D bf16/fp32, elements ``[start, start + n)`` (row-major); scales: the full E8M0 scale
    of each plane to cast, ``{Plane.ROWWISE: (M, K/32), Plane.COLWISE: (M/32, K)}`` (one or both;
    uint8 bytes are accepted too).
    Returns 1-D float8_e4m3fn arrays of length n per requested plane: exactly the bytes that the
    whole-tensor ``quantize`` has at those flat positions. ``offset`` / ``numel``: the slice is
    ``flat[offset : offset + numel]``, read in place where the backend can, and ``read_as``
    the dtype its values are converted to first (both as in ``partial_block_amax``).
    """
    m, k, n, start, read, b, impl = _cast_args("cast_slice", flat, shape, start, scales,
                                               backend, kernels, offset, numel, read_as)
    if offset == 0 and n == flat.shape[0] and read is None:
        return impl.cast_slice(flat, (m, k), start, b.get(Plane.ROWWISE), b.get(Plane.COLWISE))
    return impl.cast_slice_at(flat, int(offset), n, (m, k), start, b.get(Plane.ROWWISE),
                              b.get(Plane.COLWISE), read_as=read)


def _cast_args(what: str, flat: jax.Array, shape: tuple[int, int], start: int,
               scales: Mapping[Plane, jax.Array] | Mapping[str, jax.Array],
               backend: Backend | str | None, kernels: KernelConfig | ResolvedKernels | None,
               offset: int, numel: int | None, read_as: DTypeLike | None) -> tuple[Any, ...]:
    """(m, k, n, start, read_as or None, {plane: scale bytes}, backend impl) of a checked cast."""
    m, k, n, start = _check_slice(flat, shape, start, what, offset, numel)
    check_dtype(flat, what)
    read = _check_read_as(read_as, flat, what)
    planes = parse_planes(list(scales), f"{what} scales")
    given = {Plane.parse(p): s for p, s in scales.items()}
    b = {p: scale_bytes(given[p], scale_shape((m, k), p), f"{what} {p.value} scale")
         for p in planes}
    return m, k, n, start, read, b, _slice_impl(what, kernels, backend, flat)


def cast_slice_into(
    out: jax.Array,
    at: tuple[int, int],
    flat: jax.Array,
    shape: tuple[int, int],
    start: int,
    *,
    scales: Mapping[Plane, jax.Array] | Mapping[str, jax.Array],
    backend: Backend | str | None = None,
    kernels: KernelConfig | ResolvedKernels | None = None,
    offset: int = 0,
    numel: int | None = None,
    read_as: DTypeLike | None = None,
) -> jax.Array:
    """``cast_slice`` of both planes written into ``out``, a 1-D uint8 array: ``out`` with the
    rowwise bytes at ``out[at[0] : at[0] + n]`` and the columnwise at ``out[at[1] : ...]``
    (``at`` static), the rest of ``out`` as it was. A backend that can write there in place
    does (``pallas``, for a slice of whole rows: no plane-sized result and no copy of it);
    otherwise the two planes are cast and written by XLA's in-place updates. Same bytes."""
    what = "cast_slice_into"
    m, k, n, start, read, b, impl = _cast_args(what, flat, shape, start, scales, backend,
                                               kernels, offset, numel, read_as)
    if set(b) != set(ALL_PLANES):
        raise ValueError(f"{what}: scales must give both planes' scales (rowwise (M, K/32) and "
                         f"colwise (M/32, K)); got {[p.value for p in b]}")
    ats = _check_out(what, out, at, n)
    return impl.cast_slice_into(out, ats, flat, int(offset), n, (m, k), start,
                                b[Plane.ROWWISE], b[Plane.COLWISE], read_as=read)


def _check_out(what: str, out: jax.Array, at: tuple[int, int], n: int) -> tuple[int, int]:
    """The two planes' positions in ``out``, a 1-D uint8 array with room for n bytes at each."""
    ats = tuple(_check_start(a, what, "at", "position in out", "where a plane goes in out")
                for a in at)
    if out.ndim != 1 or out.dtype != jnp.uint8 or len(ats) != 2 or min(ats) < 0 or (
            max(ats) + n > out.shape[0]):
        raise ValueError(f"{what}: out must be a 1-D uint8 array with room for the slice's {n} "
                         f"bytes per plane at at={ats}; got {out.dtype}{tuple(out.shape)}")
    return ats[0], ats[1]


def quantize_slice_into(
    out: jax.Array,
    at: tuple[int, int],
    flat: jax.Array,
    shape: tuple[int, int],
    start: int,
    *,
    backend: Backend | str | None = None,
    kernels: KernelConfig | ResolvedKernels | None = None,
    offset: int = 0,
    numel: int | None = None,
    read_as: DTypeLike | None = None,
) -> tuple[jax.Array, BlockAmax]:
    """``partial_block_amax``, ``scales_from_amax`` of that amax and ``cast_slice_into``, for a
    slice whose scales need no other rank's amax: ``(out, amax)``, ``out`` as
    ``cast_slice_into`` writes it with the scales of this slice's own amax, and the amax (both
    planes, full scale shapes, zeros outside the slice). This is the distributed recipe's result
    exactly where no other rank holds part of a block the slice touches (one rank; or every
    block whole in the slice: a whole parameter, whole 32-row bands), which the caller knows
    (DESIGN.md 5); elsewhere the amax must be reduced over the ranks first. A backend that can
    (``pallas``, a slice of whole 32-row bands) makes both from one read of the slice; otherwise
    the slice is read twice. Same bytes either way."""
    what = "quantize_slice_into"
    m, k, n, start = _check_slice(flat, shape, start, what, offset, numel)
    check_dtype(flat, what)
    read = _check_read_as(read_as, flat, what)
    ats = _check_out(what, out, at, n)
    impl = _slice_impl(what, kernels, backend, flat)
    return impl.quantize_slice_into(out, ats, flat, int(offset), n, (m, k), start, read_as=read)
