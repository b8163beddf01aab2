"""Public MXFP8 dequantize (DESIGN.md 3 step 5): exact, and the same on every backend.

It builds the fp32 bits of ``e4m3(y) * 2**(E - 127)`` directly (``xla_impl``), so it needs no
kernel choice; the GEMM implementations (``gemm_impls``) dequantize through it.
"""

from __future__ import annotations

import jax

from jax_side.mxfp8 import xla_impl
from jax_side.mxfp8.tensor import MXFP8Tensor, Plane, scale_bytes

__all__ = ["dequantize"]


def dequantize(t: MXFP8Tensor, plane: Plane | str = Plane.ROWWISE) -> jax.Array:
    """float32 (M, K): ``e4m3(y) * 2**(E - 127)`` of one plane, exact (DESIGN.md 3 step 5)."""
    if not isinstance(t, MXFP8Tensor):
        raise TypeError(f"dequantize: expected an MXFP8Tensor, got {type(t).__name__}")
    plane = Plane.parse(plane)
    data, scale = t.plane(plane)
    scale_b = scale_bytes(scale, t.scale_shapes[plane], f"dequantize {plane.value} scale")
    expand = xla_impl.expand_rowwise if plane is Plane.ROWWISE else xla_impl.expand_colwise
    return xla_impl.dequantize_plane(data, expand(scale_b))
