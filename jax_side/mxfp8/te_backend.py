"""Adapter to Transformer Engine for JAX: the ``te`` backend of ``jax_side.mxfp8``.

Loaded when TE can matter (``te`` requested, the automatic default, ``kernel_report``), and it
imports ``transformer_engine.jax`` only after JAX has shown a CUDA GPU: TE-JAX does not import
on a CPU-only machine. Which TE path runs is decided by the one rule ``te_probe.te_availability``
from :func:`probe`; the resolver asks it through ``TEBackend.availability`` and every public
function here re-derives it, so a caller cannot mix paths.
:data:`BACKEND` is this module behind the declared interface (``backend_api.KernelBackend``):
TE quantizes whole tensors and runs its own GEMM; it has no slice building blocks.

Paths (``te_probe.TEPath``):

- ``KERNELS`` (TE reports MXFP8 support and compute capability is 10.x): ``tex.quantize`` with a
  ``BlockScaleQuantizer`` and ``tex.gemm`` -- TE's MXFP8 CUDA custom calls and cuBLAS.
- ``PURE_JAX`` (every other GPU, e.g. the H200, 9.0): ``BlockScaleQuantizer.quantize`` -- TE's
  pure-JAX quantizer, which never binds the quantize custom call -- and ``tex.gemm`` with TE's
  ``GemmPrimitive`` disabled while our call traces (:func:`_gemm_custom_call`), so TE runs its
  pure-JAX GEMM (``jax.nn.scaled_matmul``). The previous enable state is restored afterwards;
  nothing process-wide is left changed (NVTE_JAX_CUSTOM_CALLS is read, never written).

Contract fix (DESIGN.md 3; ``ContractFix``): TE's pure-JAX quantizer computes in floats. It
propagates NaN into the block amax and maps an Inf amax to scale byte 0xFF (the contract: NaN
ignored, Inf -> 0xFE), so a block holding NaN or Inf comes out all NaN; and it divides by the
scale 2**(E-127), which is subnormal for E == 0, so wherever subnormals are flushed (XLA:CPU) an
all-zero block becomes NaN. Both only touch "edge blocks": a non-finite value, or a block amax
below 2**-100 (below that, scales and quotients come near the subnormal range; above it, a
flushed subnormal input would have rounded to e4m3 zero anyway). ``SPLICE_EDGE_BLOCKS`` (the
default on the pure-JAX path) takes exactly those blocks, scale and elements, from the ``xla``
path -- behind a ``lax.cond``, so a tensor without edge blocks pays one extra read of x -- and
everything else is TE's bytes. ``ContractFix.NONE`` returns TE's bytes untouched; the GPU tests
pin where those differ. docs/te_backend.md lists the cases.

Layout: TE's MXFP8 planes are the contract's (DESIGN.md 4): colwise data not transposed,
compact unswizzled scales of shapes (M, K/32) and (M/32, K); the ``MXFP8Tensor`` holds TE's
arrays themselves (a dtype bitcast at most, no copy).
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from common.formats import BLOCK_SIZE, Plane, PlaneData, scale_shape
from common.gemm_roles import GemmRole, role_spec
from common.kernels import Backend, GemmImpl, Platform
from jax_side.mxfp8 import te_probe, xla_backend, xla_impl
from jax_side.mxfp8.backend_api import (
    Availability,
    Capabilities,
    Execution,
    KernelBackend,
    Site,
    cc_text,
)
from jax_side.mxfp8.te_probe import TEPath, import_te, is_available, probe, te_availability
from jax_side.mxfp8.tensor import BlockAmax, MXFP8Tensor, SliceCast

__all__ = [
    "BACKEND",
    "TEBackend",
    "ContractFix",
    "EDGE_AMAX",
    "TESTED_TE_VERSION",
    "dequantize",
    "edge_blocks",
    "is_available",
    "matmul",
    "probe",
    "quantize",
    "te_path",
]

TESTED_TE_VERSION = "2.20.2"
EDGE_AMAX = 2.0**-100  # blocks with a smaller amax are "edge blocks" (module docstring)
_EDGE_AMAX_BITS = 0x0D800000  # fp32 bits of 2**-100
_ABS = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_BS = BLOCK_SIZE
assert np.float32(EDGE_AMAX).view(np.uint32) == _EDGE_AMAX_BITS


class ContractFix(enum.Enum):
    """What the adapter does where TE's pure-JAX quantizer leaves the contract."""

    NONE = "none"  # TE's bytes as they come
    SPLICE_EDGE_BLOCKS = "splice_edge_blocks"  # edge blocks taken from the xla path


_DEFAULT_FIX = {TEPath.KERNELS: ContractFix.NONE, TEPath.PURE_JAX: ContractFix.SPLICE_EDGE_BLOCKS}


def _on_gpu() -> Availability:
    # te_probe.probe through the module: a test that simulates a GPU replaces it there
    return te_availability(te_probe.probe()).require(Backend.TE, Platform.GPU)


def te_path() -> TEPath:
    """The TE path that ``te`` runs on this process (raises where ``te`` is unusable)."""
    path = _on_gpu().path
    assert isinstance(path, TEPath), path  # te_availability names a TEPath when usable
    return path


@contextlib.contextmanager
def _gemm_custom_call(path: TEPath) -> Iterator[None]:
    """On the pure-JAX path, TE's GemmPrimitive custom call is off while the body traces."""
    if path is TEPath.KERNELS:
        yield
        return
    import importlib

    prim = importlib.import_module("transformer_engine.jax.cpp_extensions.gemm").GemmPrimitive
    saved = prim.__dict__.get("_is_enabled")
    prim.set_enabled(False)
    try:
        if prim.enabled():
            raise RuntimeError(
                "te backend (pure-JAX path): TE's GemmPrimitive custom call stays enabled because "
                "the environment variable NVTE_JAX_CUSTOM_CALLS forces it on; on this GPU TE's "
                "MXFP8 GEMM custom call is not supported. Unset NVTE_JAX_CUSTOM_CALLS or set it "
                "to 'GemmPrimitive=false', or use backend='xla'"
            )
        yield
    finally:
        if saved is None:
            delattr(prim, "_is_enabled")  # back to the inherited class default
        else:
            prim.set_enabled(saved)


# ---------------------------------------------------------------- quantize


class EdgeBlocks(NamedTuple):
    """bool masks of edge blocks: rowwise (M, K/32), colwise (M/32, K); None if not asked."""

    rowwise: jax.Array | None
    colwise: jax.Array | None


def edge_blocks(x: jax.Array, *, rowwise: bool, colwise: bool) -> EdgeBlocks:
    """Blocks of a 2-D (M, K) bf16/fp32 x holding NaN/Inf or with amax < 2**-100."""
    bits = xla_impl.fp32_bits(x) & jnp.uint32(_ABS)  # uint32 (M, K); NaN > Inf > finite
    m, k = x.shape

    def edge(block_max):
        return (block_max >= jnp.uint32(_INF_BITS)) | (block_max < jnp.uint32(_EDGE_AMAX_BITS))

    row = edge(jnp.max(bits.reshape(m, k // _BS, _BS), axis=2)) if rowwise else None
    col = edge(jnp.max(bits.reshape(m // _BS, _BS, k), axis=1)) if colwise else None
    return EdgeBlocks(row, col)


def _as_e8m0(scale: jax.Array) -> jax.Array:
    return scale if scale.dtype == jnp.float8_e8m0fnu else lax.bitcast_convert_type(
        scale.astype(jnp.uint8), jnp.float8_e8m0fnu)


def _plane_of(scaled: Any, plane: Plane, shape: tuple[int, int]) -> PlaneData:
    """(data, scale) of TE's ScaledTensor1x, checked against the contract layout."""
    m, k = shape
    expected = scale_shape(shape, plane)
    data, scale = scaled.data, _as_e8m0(scaled.scale_inv)
    if tuple(data.shape) != (m, k) or tuple(scale.shape) != expected:
        raise RuntimeError(
            f"te backend: TE-JAX {import_te().version} returned a {plane.value} plane with data "
            f"{tuple(data.shape)} and scales {tuple(scale.shape)} for x of shape {shape}; "
            f"expected data {(m, k)} and compact scales {expected} (adapter written against "
            f"TE {TESTED_TE_VERSION}); use backend='xla'"
        )
    if data.dtype != jnp.float8_e4m3fn:
        data = lax.bitcast_convert_type(data.astype(jnp.uint8), jnp.float8_e4m3fn)
    return PlaneData(data, scale)


def _te_quantize(x: jax.Array, rowwise: bool, colwise: bool, path: TEPath) -> MXFP8Tensor:
    te = import_te()
    layout = {
        (True, True): te.q.QuantizeLayout.ROWWISE_COLWISE,
        (True, False): te.q.QuantizeLayout.ROWWISE,
        (False, True): te.q.QuantizeLayout.COLWISE,
    }[(rowwise, colwise)]
    quantizer = te.q.QuantizerFactory.create(
        scaling_mode=te.q.ScalingMode.MXFP8_1D_SCALING, q_dtype=jnp.float8_e4m3fn, q_layout=layout
    )
    # TE's quantizer mixes bf16 and fp32 operands; the repo runs JAX with strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        if path is TEPath.KERNELS:
            out = te.tex.quantize(x, quantizer)
        else:
            out = quantizer.quantize(x, is_rowwise=rowwise, is_colwise=colwise)
    parts = {}
    m, k = x.shape
    for one in (out.rowwise_tensor, out.colwise_tensor) if rowwise and colwise else (out,):
        plane = Plane.COLWISE if one.is_colwise else Plane.ROWWISE
        parts[plane] = _plane_of(one, plane, (m, k))
    return MXFP8Tensor(parts, (m, k), np.dtype(x.dtype))


def _splice(te_t: MXFP8Tensor, ref: MXFP8Tensor, edge: EdgeBlocks) -> MXFP8Tensor:
    """te_t with its edge blocks (data and scale) replaced by ref's."""

    def pick(mask: jax.Array, expand: Callable[[jax.Array], jax.Array], a: jax.Array,
             b: jax.Array) -> jax.Array:
        if a.ndim == 2 and a.shape != mask.shape:
            mask = expand(mask)
        return jnp.where(mask, b, a)

    edges = {
        Plane.ROWWISE: (edge.rowwise, lambda m: jnp.repeat(m, _BS, axis=1)),
        Plane.COLWISE: (edge.colwise, lambda m: jnp.repeat(m, _BS, axis=0)),
    }
    planes = {
        p: PlaneData(*(pick(*edges[p], a, b)
                       for a, b in zip(te_t.plane(p), ref.plane(p), strict=True)))
        for p in te_t.planes
    }
    return MXFP8Tensor(planes, te_t.shape, te_t.dtype)


def quantize(
    x: jax.Array, *, rowwise: bool, colwise: bool, fix: ContractFix | None = None
) -> MXFP8Tensor:
    """MXFP8-quantize a validated 2-D (M, K) bf16/fp32 x with TE-JAX (layout of DESIGN.md 4).

    rowwise: blocks 1x32 along K; colwise: blocks 32x1 along M (data not transposed). fix: None
    for the path's default (``_DEFAULT_FIX``), or a ``ContractFix`` to choose explicitly.
    Called by ``jax_side.mxfp8.quantize(..., backend="te")``, which validates x.
    """
    path = te_path()
    fix = _DEFAULT_FIX[path] if fix is None else ContractFix(fix)
    te_t = _te_quantize(x, rowwise, colwise, path)
    if fix is ContractFix.NONE:
        return te_t
    edge = edge_blocks(x, rowwise=rowwise, colwise=colwise)
    masks = [mk for mk in edge if mk is not None]
    any_edge = functools.reduce(jnp.logical_or, [jnp.any(mk) for mk in masks])

    def spliced(_):
        ref = xla_backend.quantize(x, rowwise=rowwise, colwise=colwise)
        return _splice(te_t, ref, edge)

    return lax.cond(any_edge, spliced, lambda _: te_t, None)


# ---------------------------------------------------------------- dequantize and GEMM


def _scaled_1x(t: MXFP8Tensor, plane: Plane) -> Any:
    """One plane of t as TE's ScaledTensor1x (same arrays; fp32 dequantized dtype)."""
    te = import_te()
    data, scale = t.plane(plane)
    return te.q.ScaledTensorFactory.create_1x(
        data,
        scale,
        scaling_mode=te.q.ScalingMode.MXFP8_1D_SCALING,
        dq_dtype=jnp.float32,
        is_colwise=plane is Plane.COLWISE,
        data_layout="N",
        flatten_axis=-1,
    )


def dequantize(t: MXFP8Tensor, plane: Plane | str = Plane.ROWWISE) -> jax.Array:
    """float32 (M, K) of one plane by TE's dequantizer (``e4m3 * 2**(E - 127)`` in floats)."""
    te_path()
    with jax.numpy_dtype_promotion("standard"):
        return _scaled_1x(t, Plane.parse(plane)).dequantize()


def matmul(a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole) -> jax.Array:
    """fp32 GEMM of one role (``common.gemm_roles``) by ``tex.gemm`` on TE's path for this GPU.

    Operands are validated by ``jax_side.mxfp8.matmul``; both are blocked along the contracted
    axis. On the pure-JAX path this is ``jax.nn.scaled_matmul`` on the same bytes.
    """
    path = te_path()
    spec = role_spec(role)
    lhs, rhs = _scaled_1x(a, spec.a_plane), _scaled_1x(b, spec.b_plane)
    with jax.numpy_dtype_promotion("standard"), _gemm_custom_call(path):
        contract = ((spec.a_contract,), (spec.b_contract,))
        out = import_te().tex.gemm(lhs, rhs, contracting_dims=contract)
    out = out[0] if isinstance(out, tuple) else out
    return out.astype(jnp.float32)


_FACTS = ("te_importable", "te_detail", "te_mxfp8_supported", "compute_capability")


class TEBackend(KernelBackend):
    """Transformer Engine for JAX: whole-tensor quantize and its own GEMM, CUDA GPUs only."""

    name = Backend.TE.value
    capabilities = Capabilities(
        runs_on=((Platform.GPU, Execution.COMPILED),), slices=False, own_gemm=True
    )
    _NO_SLICES = "Transformer Engine quantizes whole tensors only; use backend 'xla' or 'pallas'"

    def availability(self, site: Site) -> Availability:
        """TE's rule (``te_probe.te_availability``) on a GPU; the probe only runs for GPU work."""
        if site.platform is not Platform.GPU:
            return Availability.unusable(
                f"Transformer Engine for JAX runs on CUDA GPUs only, and this work is on the "
                f"{site.platform.name}", "Use backend='xla' (the default) for CPU work",
            )
        return te_availability(te_probe.probe())

    def facts(self, site: Site, asked: bool) -> dict[str, str]:
        """TE's probe (importable, its detail, its MXFP8 answer, compute capability) where the
        resolver asked TE about GPU work; "not probed" otherwise (TE is never imported for it)."""
        if not (asked and site.platform is Platform.GPU):
            return dict.fromkeys(_FACTS, "not probed") | {"te_detail": ""}
        found = te_probe.probe()
        return {
            "te_importable": str(found.importable),
            "te_detail": found.detail,
            "te_mxfp8_supported": str(found.mxfp8_supported),
            "compute_capability": cc_text(found.compute_capability),
        }

    def quantize(self, x: jax.Array, *, planes: tuple[Plane, ...]) -> MXFP8Tensor:
        return quantize(x, rowwise=Plane.ROWWISE in planes, colwise=Plane.COLWISE in planes)

    def partial_block_amax(self, flat: jax.Array, shape: tuple[int, int], start: int,
                           planes: tuple[Plane, ...]) -> BlockAmax:
        raise self.unsupported("partial_block_amax", self._NO_SLICES)

    def scales_from_amax(self, amax: jax.Array) -> jax.Array:
        raise self.unsupported("scales_from_amax", self._NO_SLICES)

    def cast_slice(self, flat: jax.Array, shape: tuple[int, int], start: int,
                   row_b: jax.Array | None, col_b: jax.Array | None) -> SliceCast:
        raise self.unsupported("cast_slice", self._NO_SLICES)

    def matmul(self, a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole,
               gemm: GemmImpl | None) -> jax.Array:
        if gemm is not None:
            raise self.unsupported(
                f"GEMM implementation {gemm.value!r}", "it runs its own GEMM; leave gemm None"
            )
        return matmul(a, b, role)


BACKEND = TEBackend()
