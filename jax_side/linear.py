"""The one JAX MXFP8 linear layer ``y = x W^T``: quantization points, token padding, GEMM roles.

Both the Torch op (``bridge.mxfp8_linear``, Torch autograd around these jitted pieces) and the
Flax twin (``mxfp8_linear`` below, a ``jax.custom_vjp`` over the same pieces) run this code, so
the two stacks agree by construction: same programs, same bytes.

| step    | computes    | quantized operands (``common.gemm_roles``)      | result dtype |
|---------|-------------|-------------------------------------------------|--------------|
| forward | y  = x W^T  | x rowwise, W rowwise (x colwise kept for wgrad) | out_dtype    |
| dgrad   | dx = dy W   | dy rowwise, W colwise                           | x's dtype    |
| wgrad   | dW = dy^T x | dy colwise, x colwise                           | W's dtype    |

With an ``fp8_blocked`` GEMM (Hopper's FP8 tensor cores), x and dy are quantized straight into
that GEMM's operand layouts instead (``jax_side.mxfp8.blocked_operands``: the bytes the plane path
would re-block, so the same results) and the forward keeps x^T in 128x128 tiles (``KeptTiles``)
in place of x's colwise plane.

W is either given as MXFP8 planes (e.g. FSDP's all-gathered planes, used as they are) or
quantized here as ``quantize(bf16(weight))`` (DESIGN.md 3: master weights are quantized from their
bf16 rounding). Given planes are an ``MXFP8Tensor`` or a ``FlatPlane``: one plane of the weight
inside flat byte buffers (FSDP's unsharded bucket and its group's scale buffer, shared with JAX
once per bucket lifetime), cut out inside the jitted program -- so no per-call transfer or slice
dispatch is needed for weights. A ``FlatPlane`` says its format (``common.formats.ScaleBlocks``):
MXFP8 planes go to ``jax_side.mxfp8``'s GEMM kernels, planes of another block-scaled format
(registered by a user, docs/extending.md) to ``jax_side.block_scaled``'s reference GEMM; x and
dy are quantized to MXFP8 either way.

Tokens (the flattened leading dims of x, the M of x and dy) need not be a multiple of 32: x and dy
are **zero-padded along the token dim** to the next multiple of 32 (at least 32) before they are
quantized, and outputs are sliced back to the real tokens. Zero rows never raise a block amax, so
every real element gets exactly the scale of the block of real tokens it sits in (the last,
partial 32x1 colwise block is scaled by the amax of its real rows only); zero rows quantize to zero
bytes and add exactly nothing to wgrad. With zero tokens, y and dx are empty and dW is zero.

Compilation: forward (quantize x, GEMM) and backward (quantize dy, dgrad, wgrad) are each one
jitted program per (shape, dtype, kernels); layers of equal shape share compiled code. The
kernels (``ResolvedKernels``, from a ``KernelConfig``) are a static argument. Rounding to the
result dtype happens once, after the fp32 GEMM.

``LinearMode.HIGH_PRECISION`` runs the same graph with plain dots (no quantization), accumulating
in float32 (float64 if an input is float64), for the control and gradcheck-style tests: exact
fp32 products at HIGHEST precision, except that bf16 operands run on bf16 tensor cores (fp32
accumulation) when the kernels' GEMM is not the exact reference (``dequant_dot``) -- the same
"accumulation order only" trade as the MXFP8 ``dequant_bf16_dot`` path.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from common.formats import (
    ALL_PLANES,
    MXFP8_BLOCKS,
    Plane,
    PlaneData,
    ScaleBlocks,
    block_padded,
    parse_planes,
)
from common.gemm_roles import GemmRole
from common.kernels import GemmImpl, KernelConfig
from common.modes import LinearMode
from jax_side import block_scaled
from jax_side.bf16_linear import bf16_linear
from jax_side.mxfp8 import MXFP8Tensor, matmul, quantize
from jax_side.mxfp8 import blocked_operands as blocked
from jax_side.mxfp8.kernels import ResolvedKernels, resolve_kernels

__all__ = [
    "BackwardOut",
    "FlatPlane",
    "ForwardOut",
    "LinearFn",
    "backward",
    "forward",
    "gemm_dtype",
    "high_precision_linear",
    "hp_backward",
    "hp_forward",
    "linear_fn",
    "mxfp8_linear",
    "pad_tokens",
    "padded_tokens",
    "quantize_activation",
    "quantize_weight",
    "quantize_weight_program",
    "runs_blocked",
]


@dataclasses.dataclass(frozen=True)
class FlatPlane:
    """One block-scaled plane of an (N, K) weight held in flat byte buffers.

    data: 1-D uint8 (or float8_e4m3fn) buffer whose elements ``[data_offset, data_offset + N*K)``
    are the plane's (N, K) data, row-major; scale: 1-D uint8 (or float8_e8m0fnu) buffer whose
    elements from ``scale_offset`` are its compact scales (``blocks.scale_shape``: MXFP8's
    (N, K/32) rowwise, (N/32, K) colwise). ``blocks``: the format of the plane (the weight's
    ``common.formats.ScaleBlocks``; MXFP8's by default): MXFP8 planes are read by
    ``jax_side.mxfp8``'s kernels (``tensor``), those of any other block format by
    ``jax_side.block_scaled`` (``dequantized``). Offsets, shape, plane and blocks are static
    (part of the compiled program).
    """

    data: jax.Array
    scale: jax.Array
    data_offset: int
    scale_offset: int
    shape: tuple[int, int]
    plane: Plane
    blocks: ScaleBlocks = MXFP8_BLOCKS

    @property
    def is_mxfp8(self) -> bool:
        """Whether ``jax_side.mxfp8``'s kernels read this plane (``tensor``)."""
        return self.blocks == MXFP8_BLOCKS

    def _cut(self) -> tuple[jax.Array, jax.Array]:
        """(data (N, K), scale ``blocks.scale_shape``) in their stored dtypes (slices, fused by
        XLA under jit)."""
        n, k = self.shape
        ss = self.blocks.scale_shape(self.shape, self.plane)
        data = lax.slice(self.data, (self.data_offset,), (self.data_offset + n * k,))
        scale = lax.slice(self.scale, (self.scale_offset,), (self.scale_offset + ss[0] * ss[1],))
        return data.reshape(n, k), scale.reshape(ss)

    def tensor(self) -> MXFP8Tensor:
        """The plane as an ``MXFP8Tensor`` (slices and bitcasts); MXFP8 planes only."""
        if not self.is_mxfp8:
            raise ValueError(
                f"FlatPlane of blocks {self.blocks} is not an MXFP8 plane; read it with "
                f"dequantized() (jax_side.block_scaled)"
            )
        data, scale = self._cut()
        data, scale = _bitcast(data, jnp.float8_e4m3fn), _bitcast(scale, jnp.float8_e8m0fnu)
        return MXFP8Tensor({self.plane: PlaneData(data, scale)}, self.shape,
                           jnp.dtype(jnp.bfloat16))

    def dequantized(self) -> jax.Array:
        """fp32 (N, K) of the plane, in any block format ``jax_side.block_scaled`` reads."""
        data, scale = self._cut()
        return block_scaled.dequantize_plane(data, scale, self.plane, self.blocks)


jax.tree_util.register_dataclass(
    FlatPlane,
    data_fields=["data", "scale"],
    meta_fields=["data_offset", "scale_offset", "shape", "plane", "blocks"],
)


def _bitcast(a: jax.Array, dtype: DTypeLike) -> jax.Array:
    return a if a.dtype == dtype else lax.bitcast_convert_type(a, dtype)


_MXFP8_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


class ForwardOut(NamedTuple):
    y: jax.Array  # (T, N), out_dtype
    # for wgrad: the colwise plane of the padded x (T_pad, K); with an fp8_blocked GEMM, x^T in
    # the GEMM's 128x128 tiles instead (jax_side.mxfp8.blocked_operands)
    x_colwise: MXFP8Tensor | blocked.KeptTiles | None


class BackwardOut(NamedTuple):
    dx: jax.Array | None  # (T, K)
    dw: jax.Array | None  # (N, K)
    # with packed=True: dx's bytes then dw's bytes in one uint8 array (one crossing back to Torch
    # instead of two; dx and dw are then None)
    packed: jax.Array | None = None


def _packed(out: BackwardOut) -> BackwardOut:
    parts = [lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)
             for a in (out.dx, out.dw) if a is not None]
    return BackwardOut(None, None, jnp.concatenate(parts) if parts else None)


def padded_tokens(tokens: int) -> int:
    """Token count after zero-padding: the next multiple of 32, and at least 32."""
    return block_padded(tokens)


def pad_tokens(x2d: jax.Array) -> jax.Array:
    """(T, C) -> (padded_tokens(T), C), appended rows are zero."""
    t = x2d.shape[0]
    return jnp.pad(x2d, ((0, padded_tokens(t) - t), (0, 0)))


def _kernels(kernels: ResolvedKernels | KernelConfig | None) -> ResolvedKernels:
    return resolve_kernels(kernels)  # a ResolvedKernels passes through unchanged


def gemm_dtype(dtype: DTypeLike) -> jnp.dtype:
    """The GEMM's own output dtype for a result wanted in ``dtype``: bf16 or fp32 directly (the
    kernel rounds once), anything else from fp32."""
    d = jnp.dtype(dtype)
    return d if d in _MXFP8_DTYPES else jnp.dtype(jnp.float32)


def _gemm(a: MXFP8Tensor, b: MXFP8Tensor | FlatPlane, role: GemmRole, kernels: ResolvedKernels,
          out_dtype: DTypeLike = jnp.float32) -> jax.Array:
    """``a`` (a quantized activation or gradient) times ``b``: an ``MXFP8Tensor``, or a weight's
    ``FlatPlane``, which its blocks say how to read (``FlatPlane.is_mxfp8``)."""
    if isinstance(b, FlatPlane):
        if not b.is_mxfp8:
            return block_scaled.matmul(a, b.dequantized(), role, kernels.gemm).astype(out_dtype)
        b = b.tensor()
    return matmul(a, b, role, out_dtype=out_dtype, kernels=kernels)


@functools.partial(jax.jit, static_argnames=("planes", "kernels"))
def quantize_weight_program(
    w: jax.Array, *, planes: tuple[Plane, ...], kernels: ResolvedKernels
) -> MXFP8Tensor:
    """The jitted program behind ``quantize_weight`` (resolved kernels only)."""
    return quantize(w.astype(jnp.bfloat16), planes=planes, kernels=kernels)


def quantize_weight(
    w: jax.Array,
    *,
    planes: tuple[Plane, ...] = ALL_PLANES,
    kernels: ResolvedKernels | KernelConfig | None = None,
) -> MXFP8Tensor:
    """MXFP8 ``planes`` of ``bf16(w)`` for a high-precision (N, K) weight, N and K multiples of
    32."""
    planes = parse_planes(planes, "quantize_weight")
    return quantize_weight_program(w, planes=planes, kernels=_kernels(kernels))


@functools.partial(jax.jit, static_argnames=("kernels",))
def _quantize_activation(x: jax.Array, *, kernels: ResolvedKernels) -> MXFP8Tensor:
    return quantize(pad_tokens(x), planes=ALL_PLANES, kernels=kernels)


def quantize_activation(
    x: jax.Array, *, kernels: ResolvedKernels | KernelConfig | None = None
) -> MXFP8Tensor:
    """Both MXFP8 planes of a (T, C) activation or gradient, padded to (padded_tokens(T), C)."""
    return _quantize_activation(x, kernels=_kernels(kernels))


@functools.partial(jax.jit, static_argnames=("out_dtype", "keep_x_colwise", "kernels"))
def forward(
    x2d: jax.Array,
    w_rowwise: MXFP8Tensor | FlatPlane,
    *,
    out_dtype: DTypeLike,
    keep_x_colwise: bool,
    kernels: ResolvedKernels,
) -> ForwardOut:
    """y = x W^T. x2d (T, K) bf16/fp32; w needs its rowwise plane. Returns y (T, N) out_dtype and,
    if ``keep_x_colwise``, the colwise plane of the padded x for wgrad (with an fp8_blocked GEMM,
    its x^T tiles: ``blocked_operands.KeptTiles``)."""
    if runs_blocked(kernels, w_rowwise):
        return ForwardOut(*blocked.forward(x2d, w_rowwise, jnp.dtype(out_dtype),
                                           gemm_dtype(out_dtype), keep_x_colwise, kernels))
    planes = ALL_PLANES if keep_x_colwise else (Plane.ROWWISE,)
    xq = quantize(pad_tokens(x2d), planes=planes, kernels=kernels)
    y = _gemm(xq, w_rowwise, GemmRole.FORWARD, kernels, out_dtype)[: x2d.shape[0]]
    return ForwardOut(y, xq.only(Plane.COLWISE) if keep_x_colwise else None)


def runs_blocked(kernels: ResolvedKernels, w: MXFP8Tensor | FlatPlane | None) -> bool:
    """Whether x and dy are quantized straight into the fp8_blocked GEMM's operands: with that
    GEMM and MXFP8 weight planes (planes of another block format take the reference GEMM)."""
    return kernels.gemm in blocked.BLOCKED_GEMMS and not (
        isinstance(w, FlatPlane) and not w.is_mxfp8)


@functools.partial(jax.jit, static_argnames=("dx_dtype", "dw_dtype", "kernels", "packed"))
def backward(dy2d: jax.Array, w_colwise: MXFP8Tensor | FlatPlane | None,
             x_colwise: MXFP8Tensor | blocked.KeptTiles | None, *, dx_dtype: DTypeLike,
             dw_dtype: DTypeLike, kernels: ResolvedKernels, packed: bool = False) -> BackwardOut:
    """dgrad (if ``w_colwise`` is given) and wgrad (if ``x_colwise`` is given), jitted.

    dy2d (T, N) bf16/fp32; w_colwise: colwise plane of W (N, K); x_colwise: colwise plane of the
    padded x (T_pad, K) from ``forward`` (with an fp8_blocked GEMM: its x^T tiles). dx (T, K)
    dx_dtype, dW (N, K) dw_dtype; with ``packed`` their bytes come back in one uint8 array
    (``BackwardOut.packed``).
    """
    return backward_traced(dy2d, w_colwise, x_colwise, dx_dtype=dx_dtype, dw_dtype=dw_dtype,
                           kernels=kernels, packed=packed)


def backward_traced(dy2d: jax.Array | tuple[jax.Array, ...],
                    w_colwise: MXFP8Tensor | FlatPlane | None,
                    x_colwise: MXFP8Tensor | blocked.KeptTiles | None, *, dx_dtype: DTypeLike,
                    dw_dtype: DTypeLike, kernels: ResolvedKernels, packed: bool = False,
                    on_wgrad: Callable[[blocked.WgradOperands], None] | None = None,
                    ) -> BackwardOut:
    """``backward`` without a jit of its own, traced into the caller's program; ``on_wgrad``
    (an fp8_blocked GEMM only): also given wgrad's operands (``blocked_operands.backward``), as
    values of the caller's trace. ``dy2d`` may be column parts on the fp8_blocked path
    (``blocked_operands.forward_parts``' cotangents)."""
    if isinstance(x_colwise, blocked.KeptTiles) or (x_colwise is None
                                                     and runs_blocked(kernels, w_colwise)):
        out = BackwardOut(*blocked.backward(
            dy2d, w_colwise, x_colwise,
            (jnp.dtype(dx_dtype), gemm_dtype(dx_dtype)),
            (jnp.dtype(dw_dtype), gemm_dtype(dw_dtype)),
            kernels, on_wgrad))
        return _packed(out) if packed else out
    if isinstance(dy2d, tuple):
        raise TypeError("backward_traced: dy in column parts needs the fp8_blocked path")
    need_dx, need_dw = w_colwise is not None, x_colwise is not None
    # dgrad reads dy rowwise, wgrad dy colwise (common.gemm_roles)
    planes = tuple(p for p, need in ((Plane.ROWWISE, need_dx), (Plane.COLWISE, need_dw)) if need)
    dyq = quantize(pad_tokens(dy2d), planes=planes, kernels=kernels)
    dx = dw = None
    if w_colwise is not None:
        dx = _gemm(dyq, w_colwise, GemmRole.DGRAD, kernels, gemm_dtype(dx_dtype))
        dx = dx[: dy2d.shape[0]].astype(dx_dtype)  # a no-op where the GEMM wrote dx_dtype
    if x_colwise is not None:
        dw = _gemm(dyq, x_colwise, GemmRole.WGRAD, kernels, gemm_dtype(dw_dtype)).astype(dw_dtype)
    out = BackwardOut(dx, dw)
    return _packed(out) if packed else out


def _acc_dtype(*dtypes: DTypeLike) -> DTypeLike:
    return jnp.float64 if any(jnp.dtype(d) == jnp.float64 for d in dtypes) else jnp.float32


def _dot(a: jax.Array, b: jax.Array, contract_a: int, contract_b: int, acc: DTypeLike,
         kernels: ResolvedKernels | None = None) -> jax.Array:
    dims = (((contract_a,), (contract_b,)), ((), ()))
    tensor_cores = (
        kernels is not None
        and kernels.gemm is not GemmImpl.DEQUANT_DOT
        and a.dtype == b.dtype == jnp.bfloat16
    )
    if tensor_cores:  # exact bf16 products, fp32 accumulation in the tensor cores' order
        return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    return lax.dot_general(
        a.astype(acc),
        b.astype(acc),
        dims,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=acc,
    )


@functools.partial(jax.jit, static_argnames=("out_dtype", "kernels"))
def hp_forward(
    x2d: jax.Array, w: jax.Array, *, out_dtype: DTypeLike,
    kernels: ResolvedKernels | None = None,
) -> jax.Array:
    """y = x W^T without quantization. x2d (T, K), w (N, K) -> (T, N) out_dtype."""
    return _dot(x2d, w, 1, 1, _acc_dtype(x2d.dtype, w.dtype), kernels).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("need_dx", "need_dw", "kernels", "packed"))
def hp_backward(
    dy2d: jax.Array, x2d: jax.Array, w: jax.Array, *, need_dx: bool, need_dw: bool,
    kernels: ResolvedKernels | None = None,
    packed: bool = False,
) -> BackwardOut:
    """dx = dy W (T, K) in x's dtype, dW = dy^T x (N, K) in w's dtype, without quantization
    (``packed``: as in ``backward``)."""
    acc = _acc_dtype(dy2d.dtype, x2d.dtype, w.dtype)
    dx = _dot(dy2d, w, 1, 0, acc, kernels).astype(x2d.dtype) if need_dx else None
    dw = _dot(dy2d, x2d, 0, 0, acc, kernels).astype(w.dtype) if need_dw else None
    out = BackwardOut(dx, dw)
    return _packed(out) if packed else out


# ------------------------------------------------------------------ the Flax-facing functions


class LinearFn(Protocol):
    """``fn(x, weight, weight_q) -> y``: x (T, K), weight (N, K), weight_q MXFP8 planes or None."""

    def __call__(
        self, x: jax.Array, weight: jax.Array, weight_q: MXFP8Tensor | None
    ) -> jax.Array: ...


def _check_dtypes(what: str, allowed: tuple[DTypeLike, ...], **arrays: jax.Array) -> None:
    """Refuse dtypes outside ``allowed`` before JAX converts anything: a float64 numpy array
    would be narrowed to fp32 silently when x64 is off (then rounded again to bf16 or E4M3)."""
    for name, a in arrays.items():
        if jnp.dtype(a.dtype) not in allowed:
            raise TypeError(
                f"{what}: {name} has dtype {a.dtype}, expected "
                f"{' or '.join(jnp.dtype(d).name for d in allowed)}; cast it explicitly first "
                f"(e.g. {name}.astype(jnp.float32))"
            )


def _check(x: jax.Array, weight: jax.Array, weight_q: MXFP8Tensor | None) -> None:
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear: expected x (T, K) and weight (N, K) with the same K, got x {x.shape} and "
            f"weight {weight.shape}; flatten leading dims first: x.reshape(-1, x.shape[-1])"
        )
    if weight_q is not None and tuple(weight_q.shape) != tuple(weight.shape):
        raise ValueError(
            f"linear: weight_q has shape {weight_q.shape} but the weight (gradient slot) has "
            f"{weight.shape}; pass the planes of this very parameter"
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mxfp8_linear(x, weight, weight_q, kernels):
    return _fwd(x, weight, weight_q, kernels)[0]


def _fwd(x, weight, weight_q, kernels):
    wq = quantize_weight(weight, kernels=kernels) if weight_q is None else weight_q
    out = forward(x, wq.only(Plane.ROWWISE), out_dtype=x.dtype, keep_x_colwise=True,
                  kernels=kernels)
    # Residuals: the quantized operands the backward GEMMs read, and dtype carriers for dx, dW.
    res = (wq.only(Plane.COLWISE), out.x_colwise, jnp.zeros((), x.dtype),
           jnp.zeros((), weight.dtype))
    return out.y, res


def _bwd(kernels, res, dy):
    w_colwise, x_colwise, x_dtype, w_dtype = res
    out = backward(dy, w_colwise, x_colwise, dx_dtype=x_dtype.dtype, dw_dtype=w_dtype.dtype,
                   kernels=kernels)
    return out.dx, out.dw, None


_mxfp8_linear.defvjp(_fwd, _bwd)


def mxfp8_linear(
    x: jax.Array,
    weight: jax.Array,
    weight_q: MXFP8Tensor | None = None,
    *,
    kernels: ResolvedKernels | KernelConfig | None = None,
) -> jax.Array:
    """MXFP8 ``y = x W^T`` with the quantization points of the module table; x (T, K) f32/bf16 ->
    (T, N) in x.dtype, differentiable (``jax.grad``/``jax.vjp``: dx to x, dW to weight).

    weight_q: MXFP8 planes of W used as they are (then ``weight``'s values are never read: it is
    only the slot that receives dW), or None to quantize ``bf16(weight)`` here.
    """
    _check(x, weight, weight_q)
    _check_dtypes("mxfp8_linear", _MXFP8_DTYPES, x=x, weight=weight)
    return _mxfp8_linear(x, weight, weight_q, _kernels(kernels))


def high_precision_linear(
    x: jax.Array, weight: jax.Array, weight_q: MXFP8Tensor | None = None, *,
    kernels: ResolvedKernels | None = None,
) -> jax.Array:
    """Control ``y = x W^T`` without quantization, fp32 accumulation: at HIGHEST precision, except
    that bf16 operands run on bf16 tensor cores when ``kernels``' GEMM is not the exact reference
    (``dequant_dot``): exact bf16 products, fp32 accumulation in the tensor cores' order (the
    per-linear op's ``hp_forward`` trade).

    weight_q must be None (the control has no MXFP8 planes to use).
    """
    _check(x, weight, weight_q)
    hp = _MXFP8_DTYPES + ((jnp.dtype(jnp.float64),) if jax.config.jax_enable_x64 else ())
    _check_dtypes("high_precision_linear", hp, x=x, weight=weight)
    if weight_q is not None:
        raise ValueError(
            "high_precision_linear: got MXFP8 planes (weight_q); the high-precision control "
            "reads the weight itself -- use mxfp8_linear to run on MXFP8 planes"
        )
    w = weight.astype(x.dtype)
    tensor_cores = (kernels is not None and kernels.gemm is not GemmImpl.DEQUANT_DOT
                    and x.dtype == jnp.bfloat16)
    if tensor_cores:
        return bf16_linear(x, w)
    y = lax.dot_general(
        x,
        w,
        (((1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(x.dtype)


def linear_fn(
    mode: LinearMode | str, kernels: ResolvedKernels | KernelConfig | None = None
) -> LinearFn:
    """The ``LinearFn`` implementing a ``LinearMode`` (MXFP8 with the given kernels, or HP)."""
    mode = LinearMode.parse(mode)
    if mode is LinearMode.HIGH_PRECISION:
        return functools.partial(high_precision_linear, kernels=_kernels(kernels))
    return functools.partial(mxfp8_linear, kernels=_kernels(kernels))
