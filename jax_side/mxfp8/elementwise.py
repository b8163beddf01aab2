"""Elementwise prologues: a function of x's values that a quantize kernel applies as it loads x.

A prologue ``pre`` maps an array to one of the same shape and dtype, element by element (the
GPT's GELU, ``models.gpt_math.gelu_tanh``): the blocked-operand kernel
(``pallas_blocked.quantize_blocked_2d(pre=...)``) then quantizes ``pre(x)`` without ``pre(x)``
ever being written to memory, and applies ``pre`` to each block it loads -- which gives
``pre(x)``'s values only if ``pre`` treats every element on its own. ``check`` makes sure of
that from ``pre``'s jaxpr, so a reduction, a reshape or a gather across elements (whose result
would depend on the kernel's block) is refused by name instead of quantizing wrong values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["ELEMENTWISE", "Prologue", "check"]

Prologue = Callable[[jax.Array], jax.Array]  # pre(x), of x's shape and dtype

# Primitives that compute each output element from the same element of their operands (scalars
# broadcast: constants); calls of nested jaxprs (jit, custom_jvp / custom_vjp, checkpoint) are
# looked into.
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq",
    "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow",
    "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg",
    "nextafter", "not", "one_minus_square", "or", "pow", "reduce_precision", "rem", "round",
    "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh", "xor",
})
_SCALAR_BROADCASTS = frozenset({"broadcast_in_dim"})  # allowed where the operand is a scalar


def _inner(value: Any) -> list[Any]:
    """The jaxprs inside an equation parameter (a closed jaxpr, a jaxpr, or none)."""
    if hasattr(value, "eqns"):
        return [value]
    inner = getattr(value, "jaxpr", None)
    return [inner] if hasattr(inner, "eqns") else []


def _refused(jaxpr: Any) -> list[str]:
    out = [f"a captured array of shape {tuple(v.aval.shape)}" for v in jaxpr.constvars
           if tuple(getattr(v.aval, "shape", ())) != ()]  # per position, not per element
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        nested = [j for v in eqn.params.values() for j in _inner(v)]
        if nested:
            for j in nested:
                out += _refused(j)
        elif name in _SCALAR_BROADCASTS:
            if any(getattr(getattr(v, "aval", None), "shape", ()) != () for v in eqn.invars):
                out.append(f"{name} of a non-scalar")
        elif name not in ELEMENTWISE:
            out.append(name)
    return out


def check(pre: Prologue, dtype: Any, what: str) -> None:
    """A clear error unless ``pre`` maps a 2-D ``dtype`` array to one array of its shape and
    dtype using elementwise primitives only (``ELEMENTWISE``; ``what`` names the caller)."""
    if not callable(pre):
        raise TypeError(f"{what}: pre must be a function of an array, got {pre!r}")
    probe = jax.ShapeDtypeStruct((32, 128), dtype)
    try:
        closed = jax.make_jaxpr(pre)(probe)
    except Exception as e:  # noqa: BLE001 -- any tracing failure, reported with its cause
        raise TypeError(f"{what}: pre={pre!r} could not be traced on a {np.dtype(dtype).name}"
                        f"(32, 128) array ({type(e).__name__}: {e}); it must be a function "
                        f"of one array, elementwise") from e
    outs = closed.out_avals
    if len(outs) != 1 or outs[0].shape != probe.shape or outs[0].dtype != probe.dtype:
        raise ValueError(f"{what}: pre={pre!r} must return one array of its input's shape and "
                         f"dtype ({np.dtype(dtype).name}(32, 128) here), got "
                         f"{[f'{a.dtype}{tuple(a.shape)}' for a in outs]}; round its result "
                         f"back to the input's dtype (as models.gpt_math.gelu_tanh does)")
    refused = sorted(set(_refused(closed.jaxpr)))
    if refused:
        raise ValueError(f"{what}: pre={pre!r} is not known to be elementwise: it uses "
                         f"{refused}, which may combine elements or depend on their position, "
                         f"so a kernel applying it block by block could quantize other values "
                         f"than pre(x). Apply it to x before the linear instead; a primitive "
                         f"that is elementwise (a JAX version's new one) belongs in "
                         f"jax_side.mxfp8.elementwise.ELEMENTWISE (now {sorted(ELEMENTWISE)})")
