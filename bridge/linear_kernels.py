"""The JAX side of the MXFP8 linear op: jitted forward / backward pieces (no torch import).

``bridge.linear`` runs these on JAX views of Torch buffers. Numerics come only from
``jax_side.mxfp8`` (quantize / matmul); this module only decides *what* is quantized *where*:

| step    | computes      | quantized operands (DESIGN.md 4)                   |
|---------|---------------|----------------------------------------------------|
| forward | y  = x W^T    | x rowwise, W rowwise (x colwise kept for wgrad)    |
| dgrad   | dx = dy W     | dy rowwise, W colwise                              |
| wgrad   | dW = dy^T x   | dy colwise, x colwise                              |

Tokens (the flattened leading dims of x, the M of x and dy) need not be a multiple of 32: x and dy
are **zero-padded along the token dim** to the next multiple of 32 (at least 32) before they are
quantized, and outputs are sliced back to the real tokens. Zero rows never raise a block amax, so
every real element gets exactly the scale of the block of real tokens it sits in; zero rows
quantize to zero bytes and add nothing to wgrad. ``bridge.linear_reference`` uses the same rule.

``LinearMode.HIGH_PRECISION`` runs the same graph with plain dots (no quantization), accumulating in
float32 (float64 if an input is float64), for gradcheck-style tests.
"""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_side.mxfp8 import BLOCK_SIZE, GemmRole, MXFP8Tensor, matmul, quantize

__all__ = [
    "BackwardOut",
    "ForwardOut",
    "LinearMode",
    "hp_backward",
    "hp_forward",
    "mxfp8_backward",
    "mxfp8_forward",
    "only_colwise",
    "pad_tokens",
    "padded_tokens",
    "quantize_weight",
]


class LinearMode(enum.Enum):
    """MXFP8: quantized GEMMs (the real op). HIGH_PRECISION: same graph, plain matmuls."""

    MXFP8 = "mxfp8"
    HIGH_PRECISION = "high_precision"


class ForwardOut(NamedTuple):
    y: jax.Array  # (T, N), out_dtype
    x_colwise: MXFP8Tensor | None  # colwise plane of the padded x (T_pad, K), for wgrad


class BackwardOut(NamedTuple):
    dx: jax.Array | None  # (T, K)
    dw: jax.Array | None  # (N, K)


def padded_tokens(tokens: int) -> int:
    """Token count after zero-padding: the next multiple of 32, and at least 32."""
    return max(BLOCK_SIZE, -(-tokens // BLOCK_SIZE) * BLOCK_SIZE)


def pad_tokens(x2d: jax.Array) -> jax.Array:
    """(T, C) -> (padded_tokens(T), C), appended rows are zero."""
    t = x2d.shape[0]
    return jnp.pad(x2d, ((0, padded_tokens(t) - t), (0, 0)))


@functools.partial(jax.jit, static_argnames=("planes",))
def _quantize_weight(w, planes):
    return quantize(w.astype(jnp.bfloat16), rowwise="row" in planes, colwise="col" in planes)


def quantize_weight(w: jax.Array, *, rowwise: bool, colwise: bool) -> MXFP8Tensor:
    """MXFP8 planes of ``bf16(w)`` for a high-precision (N, K) weight (DESIGN.md 3: bf16 first)."""
    planes = ("row",) * rowwise + ("col",) * colwise
    return _quantize_weight(w, planes)


def only_colwise(q: MXFP8Tensor) -> MXFP8Tensor:
    return MXFP8Tensor(None, None, q.colwise_data, q.colwise_scale, q.shape, q.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "keep_x_colwise"))
def mxfp8_forward(x2d: jax.Array, w: MXFP8Tensor, *, out_dtype, keep_x_colwise: bool) -> ForwardOut:
    """y = x W^T. x2d (T, K) bf16/fp32; w needs its rowwise plane. Returns y (T, N) out_dtype."""
    xq = quantize(pad_tokens(x2d), rowwise=True, colwise=keep_x_colwise)
    y = matmul(xq, w, GemmRole.FORWARD, out_dtype=out_dtype)[: x2d.shape[0]]
    return ForwardOut(y, only_colwise(xq) if keep_x_colwise else None)


@functools.partial(jax.jit, static_argnames=("dx_dtype", "dw_dtype"))
def mxfp8_backward(
    dy2d: jax.Array,
    w_colwise: MXFP8Tensor | None,
    x_colwise: MXFP8Tensor | None,
    *,
    dx_dtype,
    dw_dtype,
) -> BackwardOut:
    """dgrad (if ``w_colwise`` is given) and wgrad (if ``x_colwise`` is given).

    dy2d (T, N) bf16/fp32; w_colwise: colwise plane of W (N, K); x_colwise: colwise plane of the
    padded x (T_pad, K) from ``mxfp8_forward``. dx (T, K) dx_dtype, dW (N, K) dw_dtype.
    """
    need_dx, need_dw = w_colwise is not None, x_colwise is not None
    dyq = quantize(pad_tokens(dy2d), rowwise=need_dx, colwise=need_dw)
    dx = dw = None
    if need_dx:
        dx = matmul(dyq, w_colwise, GemmRole.DGRAD)[: dy2d.shape[0]].astype(dx_dtype)
    if need_dw:
        dw = matmul(dyq, x_colwise, GemmRole.WGRAD).astype(dw_dtype)
    return BackwardOut(dx, dw)


def _acc_dtype(*dtypes):
    return jnp.float64 if any(jnp.dtype(d) == jnp.float64 for d in dtypes) else jnp.float32


def _dot(a, b, contract_a: int, contract_b: int, acc):
    return lax.dot_general(
        a.astype(acc),
        b.astype(acc),
        (((contract_a,), (contract_b,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=acc,
    )


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def hp_forward(x2d: jax.Array, w: jax.Array, *, out_dtype) -> jax.Array:
    """y = x W^T without quantization. x2d (T, K), w (N, K) -> (T, N) out_dtype."""
    return _dot(x2d, w, 1, 1, _acc_dtype(x2d.dtype, w.dtype)).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("need_dx", "need_dw"))
def hp_backward(dy2d, x2d, w, *, need_dx: bool, need_dw: bool) -> BackwardOut:
    """dx = dy W (T, K) in x's dtype, dW = dy^T x (N, K) in w's dtype, without quantization."""
    acc = _acc_dtype(dy2d.dtype, x2d.dtype, w.dtype)
    dx = _dot(dy2d, w, 1, 0, acc).astype(x2d.dtype) if need_dx else None
    dw = _dot(dy2d, x2d, 0, 0, acc).astype(w.dtype) if need_dw else None
    return BackwardOut(dx, dw)
