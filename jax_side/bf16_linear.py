"""bf16 ``y = x W^T`` whose three GEMMs run on bf16 tensor cores with fp32 accumulation: the
high-precision control's fast path (``jax_side.linear.high_precision_linear`` with kernels whose
GEMM is not the exact reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["bf16_linear"]

_XW_T = (((1,), (1,)), ((), ()))  # x (T, K) . w (N, K) -> (T, N)
_DY_W = (((1,), (0,)), ((), ()))  # dy (T, N) . w (N, K) -> (T, K)
_DY_T_X = (((0,), (0,)), ((), ()))  # dy (T, N) . x (T, K) -> (N, K)


@jax.custom_vjp
def bf16_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """bf16 ``y = x W^T`` whose three GEMMs all run on bf16 operands (fp32 accumulation).
    JAX's own transpose of an fp32-accumulating dot hands the backward an fp32 cotangent and
    so runs dgrad and wgrad as fp32 (TF32 on Hopper) GEMMs; here dy is the cotangent of a bf16
    output (bf16 values exactly), so dgrad and wgrad take it as bf16: the same exact products,
    fp32 accumulation, only the accumulation order differs."""
    return lax.dot_general(x, w, _XW_T, preferred_element_type=jnp.float32).astype(x.dtype)


def _fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return bf16_linear(x, w), (x, w)


def _bwd(res: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    dy = dy.astype(jnp.bfloat16)  # already bf16: the cotangent of y (bf16)
    dx = lax.dot_general(dy, w, _DY_W, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = lax.dot_general(dy, x, _DY_T_X, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


bf16_linear.defvjp(_fwd, _bwd)
