"""Slow, obvious reference of the MXFP8 linear layer: a custom VJP spelled out with
``jax_side.mxfp8.quantize`` / ``matmul`` calls, one per quantization point.

Same quantization points as ``jax_side.linear`` (its module table) and the same token rule
(zero-pad the token dim to a multiple of 32, at least 32, then slice back), written independently
of it so that a test comparing the two -- directly, and through the Torch op ``bridge.mxfp8_linear``
-- checks the fast code's plumbing (padding, plane selection, reshapes, dtypes, DLPack glue).
Always the exact kernels (``xla`` quantize, fp32 dequantize + dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from common.formats import Plane, block_padded
from common.kernels import KernelConfig
from jax_side.mxfp8 import GemmRole, matmul, quantize

__all__ = ["mxfp8_linear_reference"]

_EXACT = KernelConfig.reference()  # xla quantize, fp32 dequantize + dot


def _pad(a: jax.Array) -> jax.Array:
    t = a.shape[0]
    target = block_padded(t)
    return jnp.concatenate([a, jnp.zeros((target - t, a.shape[1]), a.dtype)], axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear2d(x2d, w, out_dtype):
    xq = quantize(_pad(x2d), planes=(Plane.ROWWISE,), kernels=_EXACT)
    wq = quantize(w.astype(jnp.bfloat16), planes=(Plane.ROWWISE,), kernels=_EXACT)
    return matmul(xq, wq, GemmRole.FORWARD, out_dtype=out_dtype, kernels=_EXACT)[: x2d.shape[0]]


def _fwd(x2d, w, out_dtype):
    return _linear2d(x2d, w, out_dtype), (x2d, w)


def _bwd(out_dtype, residuals, dy):
    x2d, w = residuals
    t = x2d.shape[0]
    dy_row = quantize(_pad(dy), planes=(Plane.ROWWISE,), kernels=_EXACT)
    dy_col = quantize(_pad(dy), planes=(Plane.COLWISE,), kernels=_EXACT)
    w_col = quantize(w.astype(jnp.bfloat16), planes=(Plane.COLWISE,), kernels=_EXACT)
    x_col = quantize(_pad(x2d), planes=(Plane.COLWISE,), kernels=_EXACT)
    dx = matmul(dy_row, w_col, GemmRole.DGRAD, kernels=_EXACT)[:t].astype(x2d.dtype)
    dw = matmul(dy_col, x_col, GemmRole.WGRAD, kernels=_EXACT).astype(w.dtype)
    return dx, dw


_linear2d.defvjp(_fwd, _bwd)


def mxfp8_linear_reference(
    x: jax.Array, w: jax.Array, *, out_dtype: DTypeLike | None = None
) -> jax.Array:
    """y = x W^T with MXFP8 GEMMs. x (..., K) bf16/fp32, w (N, K) high precision -> (..., N).

    Differentiable with ``jax.grad`` / ``jax.vjp``: dgrad uses dy rowwise and W colwise, wgrad dy
    colwise and x colwise; W is quantized as ``bf16(w)``.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead = x.shape[:-1]
    y = _linear2d(x.reshape(-1, x.shape[-1]), w, out_dtype)
    return y.reshape(*lead, w.shape[0])
