"""The linear-layer math of the Flax twin: ``y = x W^T`` as an injectable function.

A ``LinearFn`` is ``fn(x, weight, weight_q) -> y`` with x (T, K) float32/bfloat16 (T tokens, any
T >= 1), weight (N, K) high precision, weight_q an ``MXFP8Tensor`` of W (both planes) or None, and
y (T, N) in x's dtype. Flax layers receive one as a field (injection, like Flax's ``dot_general=``);
they never subclass a quantized layer.

- ``mxfp8_linear``: MXFP8 GEMMs from ``jax_side.mxfp8`` under a ``jax.custom_vjp`` whose
  quantization points are exactly those of the bridge's Torch op (DESIGN.md 4 roles):

  | pass    | GEMM (jax_side.mxfp8.matmul) | operands                    | result dtype |
  |---------|------------------------------|-----------------------------|--------------|
  | forward | FORWARD  y  = x W^T          | x rowwise,  W rowwise       | x.dtype      |
  | dgrad   | DGRAD    dx = dy W           | dy rowwise, W colwise       | x.dtype      |
  | wgrad   | WGRAD    dW = dy^T x         | dy colwise, x colwise       | weight.dtype |

  W is ``weight_q`` when given (e.g. FSDP's all-gathered planes, used as-is; then ``weight``'s
  values are never read: it is only the slot that receives dW), else ``quantize(bf16(weight))``
  (DESIGN.md 3: master weights are quantized from their bf16 rounding).

- ``high_precision_linear``: the control, fp32 dot at HIGHEST precision, no quantization.

Compilation: forward (quantize x, GEMM) and backward (quantize dy, dgrad, wgrad) are each one
jitted function per shape -- the same split and the same operations as the bridge op's kernels,
so that both compile to the same code (meant to keep the bytes equal also where XLA picks GEMM
algorithms per program, as on GPU; on the H200 run of scripts/gpu/parity.sh the teacher-forced
linears were identical). Layers of equal shapes share compiled code; an eager model compiles each
distinct linear shape once; under an outer ``jax.jit`` they are inlined. Rounding to x's dtype
happens once, after the fp32 GEMM.

Token counts that are not a multiple of 32 (``pad_tokens``): x and dy are zero-padded along the
token axis to the next multiple of 32 before quantizing, and results are sliced back to T rows.
Zero rows never raise a block amax and quantize to zero bytes, so: the rowwise bytes of real rows
are unchanged; the last, partial 32x1 colwise block is scaled by the amax of its real rows only;
the padded rows contribute exactly 0 to dW. This is the same rule as the bridge op (tested bytewise
in tests/bridge/test_parity.py).
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax

from jax_side.models.config import MatmulMode
from jax_side.mxfp8 import BLOCK_SIZE, GemmRole, MXFP8Tensor, matmul, quantize

__all__ = [
    "LinearFn",
    "high_precision_linear",
    "linear_fn",
    "mxfp8_linear",
    "pad_tokens",
    "quantize_activation",
    "quantize_weight",
]


class LinearFn(Protocol):
    def __call__(
        self, x: jax.Array, weight: jax.Array, weight_q: MXFP8Tensor | None
    ) -> jax.Array: ...


def pad_tokens(x: jax.Array) -> jax.Array:
    """Zero-pad a (T, C) array along T to the next multiple of 32 (no-op when T % 32 == 0)."""
    pad = -x.shape[0] % BLOCK_SIZE
    return x if pad == 0 else jnp.pad(x, ((0, pad), (0, 0)))


@jax.jit
def quantize_activation(x: jax.Array) -> MXFP8Tensor:
    """Both MXFP8 planes of a (T, C) activation or gradient, padded to (ceil32(T), C)."""
    return quantize(pad_tokens(x), rowwise=True, colwise=True)


@jax.jit
def quantize_weight(weight: jax.Array) -> MXFP8Tensor:
    """Both MXFP8 planes of ``bf16(weight)``, weight (N, K) with N, K multiples of 32."""
    return quantize(weight.astype(jnp.bfloat16), rowwise=True, colwise=True)


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


def _plane_only(q: MXFP8Tensor, rowwise: bool) -> MXFP8Tensor:
    if rowwise:
        return MXFP8Tensor(q.rowwise_data, q.rowwise_scale, None, None, q.shape, q.dtype)
    return MXFP8Tensor(None, None, q.colwise_data, q.colwise_scale, q.shape, q.dtype)


@jax.jit
def _forward(x: jax.Array, w_rowwise: MXFP8Tensor) -> tuple[jax.Array, MXFP8Tensor]:
    """y (T, N) in x.dtype, and the colwise plane of the padded x kept for wgrad."""
    xq = quantize_activation(x)
    y = matmul(xq, w_rowwise, GemmRole.FORWARD, out_dtype=x.dtype)[: x.shape[0]]
    return y, _plane_only(xq, rowwise=False)


@functools.partial(jax.jit, static_argnames=("dx_dtype", "dw_dtype"))
def _backward(dy, w_colwise: MXFP8Tensor, x_colwise: MXFP8Tensor, *, dx_dtype, dw_dtype):
    """dx (T, K) = dy W (dy rowwise, W colwise); dW (N, K) = dy^T x (dy, x colwise)."""
    dyq = quantize_activation(dy)
    dx = matmul(dyq, w_colwise, GemmRole.DGRAD)[: dy.shape[0]].astype(dx_dtype)
    dw = matmul(dyq, x_colwise, GemmRole.WGRAD).astype(dw_dtype)
    return dx, dw


@jax.custom_vjp
def _mxfp8_linear(x, weight, weight_q):
    return _fwd(x, weight, weight_q)[0]


def _fwd(x, weight, weight_q):
    wq = quantize_weight(weight) if weight_q is None else weight_q
    y, x_colwise = _forward(x, _plane_only(wq, rowwise=True))
    # Residuals: the quantized operands the backward GEMMs read, and dtype carriers for dx, dW.
    res = (_plane_only(wq, rowwise=False), x_colwise, jnp.zeros((), x.dtype),
           jnp.zeros((), weight.dtype))
    return y, res


def _bwd(res, dy):
    w_colwise, x_colwise, x_dtype, w_dtype = res
    dx, dw = _backward(dy, w_colwise, x_colwise, dx_dtype=x_dtype.dtype, dw_dtype=w_dtype.dtype)
    return dx, dw, None


_mxfp8_linear.defvjp(_fwd, _bwd)


def mxfp8_linear(
    x: jax.Array, weight: jax.Array, weight_q: MXFP8Tensor | None = None
) -> jax.Array:
    """MXFP8 ``y = x W^T``; x (T, K) f32/bf16 -> (T, N) in x.dtype. See the module docstring."""
    _check(x, weight, weight_q)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"mxfp8_linear: x must be float32 or bfloat16, got {x.dtype}")
    return _mxfp8_linear(x, weight, weight_q)


def high_precision_linear(
    x: jax.Array, weight: jax.Array, weight_q: MXFP8Tensor | None = None
) -> jax.Array:
    """Control ``y = x W^T`` without quantization: fp32 accumulation at HIGHEST precision.

    weight_q must be None (the control has no MXFP8 planes to use).
    """
    _check(x, weight, weight_q)
    if weight_q is not None:
        raise ValueError(
            "high_precision_linear: got MXFP8 planes (weight_q); the high-precision control "
            "reads the weight itself -- use mxfp8_linear to run on MXFP8 planes"
        )
    y = lax.dot_general(
        x,
        weight.astype(x.dtype),
        (((1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(x.dtype)


_LINEAR_FNS: dict[MatmulMode, LinearFn] = {
    MatmulMode.MXFP8: mxfp8_linear,
    MatmulMode.HIGH_PRECISION: high_precision_linear,
}


def linear_fn(mode: MatmulMode | str) -> LinearFn:
    """The ``LinearFn`` implementing a ``MatmulMode``."""
    return _LINEAR_FNS[MatmulMode.parse(mode)]
