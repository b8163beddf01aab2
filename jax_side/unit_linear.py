"""The MXFP8 linear inside a unit program (``jax_side.unit_program``), and the trace-time scope
its backward rule reads.

``unit_linear(x2d, w_row, carrier, index, kernels)`` is a ``jax.custom_vjp``: its forward is
``jax_side.linear.forward`` on the weight's rowwise plane; its residual is the x colwise plane
only. Its backward rule runs while ``unit_backward`` applies the saved linearization, and reads
the weight's colwise plane (which FSDP gathers for the backward only) from the innermost
``backward_scope`` -- a table opened around that call and read, never written, by the rules.
dW leaves as the cotangent of ``carrier`` (zeros of the weight's shape in dW's dtype that the
forward does not read), so autodiff sums it where a layer is called twice.
``unit_linear_parts`` is the same linear with its output in column parts (q, k and v), and
``unit_linear_pre`` the linear of ``pre(x2d)`` for an elementwise ``pre`` that the quantize of
x applies as it loads x (the GPT's GELU), and ``unit_linear_post`` the GELU of the linear's output
written by the GEMM's epilogue with its input (``jax_side.mxfp8.epilogue``), with the same rule
around them.

**dW written in place.** For the linears a scope is opened with in ``defer``, the rule also
records its wgrad operands (``blocked_operands.WgradOperands``) in the scope; ``writers`` then
hands the gradient groups one writer per linear whose rule ran exactly once, and
``unit_grads.pack_grads`` lets that GEMM write dW where the group's buffer holds it (the
``fp8_blocked`` GEMM's in-place variant, ``cublaslt.blocked_gemm_into``) instead of copying a
returned dW there. The autodiff dW of such a linear is then unused and XLA drops its GEMM. A
linear called twice keeps the autodiff sum.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_side.linear import (
    FlatPlane,
    backward,
    backward_traced,
    forward,
    gemm_dtype,
    runs_blocked,
)
from jax_side.mxfp8 import MXFP8Tensor
from jax_side.mxfp8.blocked_operands import (
    KeptTiles,
    WgradOperands,
    forward_parts,
    forward_post,
    row_parts,
)
from jax_side.mxfp8.blocked_operands import forward as forward_blocked
from jax_side.mxfp8.elementwise import Prologue
from jax_side.mxfp8.epilogue import EPILOGUES
from jax_side.mxfp8.kernels import ResolvedKernels
from jax_side.mxfp8.reblock import GROUP
from jax_side.unit_grads import Writer

__all__ = ["backward_scope", "fuses", "fuses_post", "splits", "unit_linear", "unit_linear_parts",
           "unit_linear_post", "unit_linear_pre"]

class BackwardScope:
    """The colwise planes of one ``unit_backward`` trace (read by the rules, never written),
    and the wgrad operands of the linears in ``defer`` (``unit_program._deferrable``),
    recorded by their rules for the gradient groups to write dW in place
    (``unit_grads.Writer``)."""

    def __init__(self, cols: Sequence[Any], defer: frozenset[int] = frozenset()) -> None:
        self.cols = cols
        self.defer = defer
        self.wgrads: dict[int, list[WgradOperands]] = {}

    def on_wgrad(self, index: int) -> Callable[[WgradOperands], None] | None:
        if index not in self.defer:
            return None
        return lambda ops: self.wgrads.setdefault(index, []).append(ops)

    def writers(self, n_params: int) -> dict[int, Writer]:
        """Gradient index -> writer, for each linear whose rule ran once (a linear called twice
        has its dW summed by autodiff: no writer)."""
        return {n_params + i: ops[0] for i, ops in self.wgrads.items() if len(ops) == 1}


_SCOPES = threading.local()


def _scope() -> BackwardScope:
    stack = getattr(_SCOPES, "stack", None)
    if not stack:
        raise AssertionError(
            "unit_program: an MXFP8 linear's backward rule ran outside unit_backward (its colwise "
            "weight plane comes from there); differentiate a unit function only through "
            "unit_forward / unit_backward"
        )
    return stack[-1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def unit_linear(x2d: jax.Array, w_row: Any, carrier: jax.Array, index: int,
                kernels: ResolvedKernels) -> jax.Array:
    """y = x2d @ w^T (the forward reads ``w_row``); ``carrier``: zeros of dW's shape and dtype,
    whose cotangent is dW (module docstring)."""
    return forward(x2d, w_row, out_dtype=x2d.dtype, keep_x_colwise=False, kernels=kernels).y


def _unit_linear_fwd(x2d, w_row, carrier, index, kernels):
    out = forward(x2d, w_row, out_dtype=x2d.dtype, keep_x_colwise=True, kernels=kernels)
    return out.y, (out.x_colwise, jnp.zeros((), x2d.dtype), jnp.zeros((), carrier.dtype))


def _unit_linear_bwd(index, kernels, res, dy):
    x_colwise, x_dtype, dw_dtype = res
    scope = _scope()
    on_wgrad = scope.on_wgrad(index)
    run = backward if on_wgrad is None else functools.partial(backward_traced, on_wgrad=on_wgrad)
    out = run(dy, scope.cols[index], x_colwise, dx_dtype=x_dtype.dtype, dw_dtype=dw_dtype.dtype,
              kernels=kernels)
    return out.dx, None, out.dw


unit_linear.defvjp(_unit_linear_fwd, _unit_linear_bwd)


def splits(w_row: Any, parts: int, kernels: ResolvedKernels) -> bool:
    """Whether ``unit_linear_parts`` runs this linear as ``parts`` GEMMs: the fp8_blocked GEMM on
    MXFP8 planes, and N/parts a multiple of 128 rows (each part's tiles are the whole weight's,
    so the operand bytes are those of the one GEMM)."""
    if not isinstance(w_row, (FlatPlane, MXFP8Tensor)) or not runs_blocked(kernels, w_row):
        return False
    n = w_row.shape[0]
    return parts > 1 and n % parts == 0 and (n // parts) % GROUP == 0


def _parts_forward(x2d: jax.Array, w_row: Any, parts: int, kernels: ResolvedKernels,
                   keep: bool) -> tuple[tuple[jax.Array, ...], KeptTiles | None]:
    dtype = jnp.dtype(x2d.dtype)
    return forward_parts(x2d, row_parts(w_row, parts), dtype, gemm_dtype(dtype), keep, kernels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def unit_linear_parts(x2d: jax.Array, w_row: Any, carrier: jax.Array, index: int,
                      kernels: ResolvedKernels, parts: int) -> tuple[jax.Array, ...]:
    """``unit_linear``'s y as ``parts`` column parts (q, k and v of the qkv linear), each from
    its own GEMM against its rows of the weight (``splits`` says when), so no part is cut out of
    one output; the backward takes their cotangents as they come and quantizes them into the
    dgrad and wgrad operands part by part (``blocked_operands.quantize_operands``): no
    concatenation either."""
    return _parts_forward(x2d, w_row, parts, kernels, keep=False)[0]


def _unit_linear_parts_fwd(x2d, w_row, carrier, index, kernels, parts):
    ys, kept = _parts_forward(x2d, w_row, parts, kernels, keep=True)
    return ys, (kept, jnp.zeros((), x2d.dtype), jnp.zeros((), carrier.dtype))


def _unit_linear_parts_bwd(index, kernels, parts, res, dys):
    return _unit_linear_bwd(index, kernels, res, tuple(dys))


unit_linear_parts.defvjp(_unit_linear_parts_fwd, _unit_linear_parts_bwd)


def fuses(w_row: Any, kernels: ResolvedKernels) -> bool:
    """Whether ``unit_linear_pre`` runs: the fp8_blocked GEMM on MXFP8 planes (x and dy quantized
    straight into its operands, where an elementwise ``pre`` can be applied as x is loaded)."""
    return isinstance(w_row, (FlatPlane, MXFP8Tensor)) and runs_blocked(kernels, w_row)


def _pre_forward(x2d: jax.Array, w_row: Any, kernels: ResolvedKernels, pre: Prologue,
                 keep: bool) -> tuple[jax.Array, KeptTiles | None]:
    dtype = jnp.dtype(x2d.dtype)
    return forward_blocked(x2d, w_row, dtype, gemm_dtype(dtype), keep, kernels, pre)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def unit_linear_pre(x2d: jax.Array, w_row: Any, carrier: jax.Array, index: int,
                    kernels: ResolvedKernels, pre: Prologue) -> jax.Array:
    """``unit_linear`` of ``pre(x2d)`` (``pre`` elementwise, x's shape and dtype: the GPT's GELU
    before its MLP's second linear), with ``pre`` applied inside the quantize of x
    (``blocked_operands.quantize_operands(pre=...)``), so ``pre(x2d)`` is never written out
    (``fuses`` says when). Residuals: ``pre(x2d)``'s tiles for wgrad and ``x2d`` itself (what
    ``jax.checkpoint(pre)`` keeps); the backward takes the linear's dx, the cotangent of
    ``pre(x2d)``, through ``jax.vjp(pre, x2d)`` -- the values of ``unit_linear(
    jax.checkpoint(pre)(x2d), ...)``, forward and backward."""
    return _pre_forward(x2d, w_row, kernels, pre, keep=False)[0]


def _unit_linear_pre_fwd(x2d, w_row, carrier, index, kernels, pre):
    y, kept = _pre_forward(x2d, w_row, kernels, pre, keep=True)
    return y, (kept, x2d, jnp.zeros((), carrier.dtype))


def _unit_linear_pre_bwd(index, kernels, pre, res, dy):
    kept, x2d, dw_dtype = res
    dh, _, dw = _unit_linear_bwd(index, kernels, (kept, x2d, dw_dtype), dy)
    return jax.vjp(pre, x2d)[1](dh)[0], None, dw


unit_linear_pre.defvjp(_unit_linear_pre_fwd, _unit_linear_pre_bwd)


def fuses_post(w_row: Any, kernels: ResolvedKernels, dtype: Any) -> bool:
    """Whether ``unit_linear_post`` runs: ``fuses``, and bfloat16 activations (the epilogue
    writes bfloat16)."""
    return fuses(w_row, kernels) and jnp.dtype(dtype) == jnp.bfloat16


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def unit_linear_post(x2d: jax.Array, w_row: Any, carrier: jax.Array, index: int,
                     kernels: ResolvedKernels, post: str) -> jax.Array:
    """``EPILOGUES[post].fn`` of ``unit_linear``'s y (the GPT's GELU after its MLP's first linear)
    written by the GEMM's epilogue from the fp32 accumulator, with y itself, in one pass
    (``blocked_operands.forward_post``; ``fuses_post`` says when). Residuals: x's tiles for
    wgrad and y (what ``jax.checkpoint(post)`` keeps); the backward takes the cotangent of
    ``post(y)`` through ``jax.vjp(post, y)``, then ``unit_linear``'s rule. The values differ from
    ``jax.checkpoint(post)(unit_linear(...))`` by the rounding of the accumulator to bfloat16
    before the GELU (``jax_side.mxfp8.epilogue``)."""
    return forward_post(x2d, w_row, post, False, kernels)[0]


def _unit_linear_post_fwd(x2d, w_row, carrier, index, kernels, post):
    g, h, kept = forward_post(x2d, w_row, post, True, kernels)
    return g, (kept, h, jnp.zeros((), x2d.dtype), jnp.zeros((), carrier.dtype))


def _unit_linear_post_bwd(index, kernels, post, res, dg):
    kept, h, x_dtype, dw_dtype = res
    dh = jax.vjp(EPILOGUES[post].fn, h)[1](dg)[0]
    return _unit_linear_bwd(index, kernels, (kept, x_dtype, dw_dtype), dh)


unit_linear_post.defvjp(_unit_linear_post_fwd, _unit_linear_post_bwd)


@contextlib.contextmanager
def backward_scope(cols: Sequence[Any],
                   defer: frozenset[int] = frozenset()) -> Iterator[BackwardScope]:
    """Open a ``BackwardScope`` for the backward rules traced inside the ``with`` block."""
    stack = _SCOPES.__dict__.setdefault("stack", [])
    scope = BackwardScope(cols, defer)
    stack.append(scope)
    try:
        yield scope
    finally:
        stack.pop()
