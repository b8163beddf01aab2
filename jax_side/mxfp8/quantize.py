"""Public MXFP8 quantize / dequantize (DESIGN.md 3 numerics, 4 layout), validated and dispatched.

``quantize`` validates its input and hands it to the backend module that ``backend`` resolves to
(``backends.backend_module``): ``xla`` (the reference, every platform), a kernel backend, or
``te``. ``dequantize`` is exact (it builds the fp32 bits) and backend-independent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from common.formats import check_mxfp8_shape
from common.kernels import Backend
from jax_side.mxfp8 import xla_impl
from jax_side.mxfp8.backends import backend_module, resolve_backend
from jax_side.mxfp8.slices import check_dtype, scale_bytes
from jax_side.mxfp8.tensor import MXFP8Tensor, Plane

__all__ = ["dequantize", "quantize"]


def _check_planes(rowwise: bool, colwise: bool) -> None:
    if not (rowwise or colwise):
        raise ValueError("quantize: rowwise=False and colwise=False asks for nothing; set one")


def _check_array(x) -> None:
    # A list, tuple or Python scalar has no dtype: jnp.asarray would pick float32 (or int32) for
    # it silently, so the caller never said which precision the MXFP8 bytes come from.
    if not isinstance(x, jax.Array | np.ndarray):
        raise TypeError(
            f"quantize: x is a {type(x).__name__}, not an array; pass a jnp or np array of dtype "
            f"bfloat16 or float32, e.g. quantize(jnp.asarray(x, jnp.bfloat16))"
        )


def quantize(
    x: jax.Array,
    *,
    rowwise: bool = True,
    colwise: bool = True,
    backend: Backend | str | None = None,
) -> MXFP8Tensor:
    """Quantize a 2-D (M, K) bf16/fp32 array (jax or numpy) to MXFP8 (DESIGN.md 3 numerics, 4
    layout). Lists, tuples and Python scalars are refused (TypeError): give the dtype explicitly.

    rowwise: blocks 1x32 along K -> rowwise_data (M, K) e4m3, rowwise_scale (M, K/32) e8m0.
    colwise: blocks 32x1 along M -> colwise_data (M, K) e4m3 (not transposed),
    colwise_scale (M/32, K) e8m0. backend: None (automatic, see ``backend_report``), "xla",
    "te" (or another implemented backend).
    """
    _check_array(x)
    check_dtype(x, "quantize")  # before jnp.asarray, which narrows float64 to fp32 (x64 off)
    x = jnp.asarray(x)
    check_mxfp8_shape(x.shape, "quantize")
    check_dtype(x, "quantize")
    _check_planes(rowwise, colwise)
    impl = backend_module(resolve_backend(backend).backend)
    return impl.quantize(x, rowwise=bool(rowwise), colwise=bool(colwise))


def dequantize(t: MXFP8Tensor, plane: Plane | str = Plane.ROWWISE) -> jax.Array:
    """float32 (M, K): ``e4m3(y) * 2**(E - 127)`` of one plane, exact (DESIGN.md 3 step 5)."""
    if not isinstance(t, MXFP8Tensor):
        raise TypeError(f"dequantize: expected an MXFP8Tensor, got {type(t).__name__}")
    plane = Plane.parse(plane)
    data, scale = t.plane(plane)
    scale_b = scale_bytes(scale, t.scale_shapes[plane], f"dequantize {plane.value} scale")
    expand = xla_impl.expand_rowwise if plane is Plane.ROWWISE else xla_impl.expand_colwise
    return xla_impl.dequantize_plane(data, expand(scale_b))
