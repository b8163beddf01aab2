"""Test helper: what the ``pallas_call``s of a function take (its jaxpr, sub-jaxprs included)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def pallas_operands(fn: Callable[..., Any], *args: Any) -> list[list[Any]]:
    """The operand avals (shape and dtype) of every ``pallas_call`` in ``fn(*args)``'s jaxpr, in
    order."""
    found: list[list[Any]] = []

    def walk(jaxpr: Any) -> None:
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                found.append([v.aval for v in e.invars])
                continue
            for v in e.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def pallas_operand_shapes(fn: Callable[..., Any], *args: Any) -> list[list[tuple[int, ...]]]:
    """The operand shapes of every ``pallas_call`` in ``fn(*args)``'s jaxpr, in order: a kernel
    that reads a buffer in place takes the whole buffer, one given a slice takes the slice."""
    return [[tuple(a.shape) for a in ops] for ops in pallas_operands(fn, *args)]
