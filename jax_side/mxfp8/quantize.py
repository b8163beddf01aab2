"""Public MXFP8 quantize (DESIGN.md 3 numerics, 4 layout), validated and dispatched.

``quantize`` validates its input and runs the ``quantize`` operation of the backend that its
kernels resolve to (``kernels.resolve_kernels``, one resolver for every public function; the
table ``backends.backend_impl`` maps it to its ``backend_api.KernelBackend``): ``xla`` (the
reference, every platform), ``pallas`` or ``te``. ``dequantize`` (module ``dequantize``) is exact
and backend-independent.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from common.formats import ALL_PLANES, Plane, check_mxfp8_shape, parse_planes
from common.kernels import Backend, KernelConfig
from jax_side.mxfp8.backends import backend_impl
from jax_side.mxfp8.kernels import ResolvedKernels, resolve_call
from jax_side.mxfp8.slices import check_dtype
from jax_side.mxfp8.tensor import MXFP8Tensor

__all__ = ["quantize"]


def _check_array(x: object) -> None:
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
    planes: Plane | str | Iterable[Plane | str] = ALL_PLANES,
    backend: Backend | str | None = None,
    kernels: KernelConfig | ResolvedKernels | None = None,
) -> MXFP8Tensor:
    """Quantize a 2-D (M, K) bf16/fp32 array (jax or numpy) to MXFP8 (DESIGN.md 3 numerics, 4
    layout). Lists, tuples and Python scalars are refused (TypeError): give the dtype explicitly.

    planes: which planes to make (default both; a ``Plane``, its name, or several):
    ``Plane.ROWWISE``, blocks 1x32 along K -> data (M, K) e4m3, scale (M, K/32) e8m0;
    ``Plane.COLWISE``, blocks 32x1 along M -> data (M, K) e4m3 (not transposed), scale (M/32, K)
    e8m0. kernels: a ``KernelConfig`` (None: the automatic default for
    JAX's default device, or the CPU's for an x that lies on the CPU -- ``kernels.placement``;
    ``kernel_report`` says what runs); ``backend="xla"`` is shorthand for
    ``kernels=KernelConfig(backend="xla")``.
    """
    _check_array(x)
    check_dtype(x, "quantize")  # before jnp.asarray, which narrows float64 to fp32 (x64 off)
    x = jnp.asarray(x)
    check_mxfp8_shape(x.shape, "quantize")
    check_dtype(x, "quantize")
    planes = parse_planes(planes, "quantize")
    impl = backend_impl(resolve_call("quantize", kernels, backend, operands=(x,)).backend)
    return impl.quantize(x, planes=planes)
