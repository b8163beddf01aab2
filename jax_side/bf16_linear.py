"""bf16 ``y = x W^T`` whose three GEMMs run on bf16 tensor cores with fp32 accumulation: the
high-precision control's fast path (``jax_side.linear.high_precision_linear`` with kernels whose
GEMM is not the exact reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["bf16_linear"]

_Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]
_XW_T: _Dims = (((1,), (1,)), ((), ()))  # x (T, K) . w (N, K) -> (T, N)
_DY_W: _Dims = (((1,), (0,)), ((), ()))  # dy (T, N) . w (N, K) -> (T, K)
_DY_T_X: _Dims = (((0,), (0,)), ((), ()))  # dy (T, N) . x (T, K) -> (N, K)


def _dot(a: jax.Array, b: jax.Array, dims: _Dims) -> jax.Array:
    """A bf16 GEMM with its bf16 result written by the GEMM itself: on the GPU the tensor cores
    accumulate in fp32 and round once to bf16 (cuBLAS's 32F compute type, Triton's fp32
    accumulator), the bytes of an fp32 result rounded by a cast. Asked for the fp32 result and a
    cast, XLA ran most of these GEMMs as its own Triton fusions; asked for bf16 it hands them to
    cuBLAS (GPT 1.3B on the H200: the step's GEMMs 84.9 instead of 89.4 ms; BENCHMARKS.md,
    session 10)."""
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16)


@jax.custom_vjp
def bf16_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """bf16 ``y = x W^T`` whose three GEMMs all run on bf16 operands (fp32 accumulation).
    JAX's own transpose of an fp32-accumulating dot hands the backward an fp32 cotangent and
    so runs dgrad and wgrad as fp32 (TF32 on Hopper) GEMMs; here dy is the cotangent of a bf16
    output (bf16 values exactly), so dgrad and wgrad take it as bf16: the same exact products,
    fp32 accumulation, only the accumulation order differs."""
    return _dot(x, w, _XW_T)


def _fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return bf16_linear(x, w), (x, w)


def _bwd(res: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    dy = dy.astype(jnp.bfloat16)  # already bf16: the cotangent of y (bf16)
    return _dot(dy, w, _DY_W), _dot(dy, x, _DY_T_X)


bf16_linear.defvjp(_fwd, _bwd)
