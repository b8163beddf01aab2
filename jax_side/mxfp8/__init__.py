"""MXFP8 numerics in JAX: quantize, dequantize, GEMM, and the distributed-quantization blocks.

Contract: DESIGN.md section 3 (numerics, bit-exact to the Transformer Engine kernel recipe) and
section 4 (layout). No torch import anywhere in ``jax_side``. The shared facts (block size,
planes, GEMM roles, ``KernelConfig``) are defined in ``common`` and re-exported here.

Which kernels run is decided in one place, ``resolve_kernels`` (module ``kernels``), from a
``KernelConfig`` that every public function takes as ``kernels=``; ``kernel_report`` says what
runs and why. Backends implement one declared interface (``backend_api.KernelBackend``) and sit
in one table (module ``backends``), which ``register_backend`` extends.
"""

from common.formats import BLOCK_SIZE, E4M3_MAX
from common.gemm_roles import GemmRole
from common.kernels import GemmImpl, KernelConfig, Platform
from jax_side.mxfp8.backends import (
    Backend,
    BackendChoice,
    decide_backend,
    register_backend,
    unregister_backend,
)
from jax_side.mxfp8.dequantize import dequantize
from jax_side.mxfp8.gemm import matmul
from jax_side.mxfp8.kernels import ResolvedKernels, kernel_report, resolve_kernels
from jax_side.mxfp8.quantize import quantize
from jax_side.mxfp8.slices import (
    cast_slice,
    cast_slice_into,
    partial_block_amax,
    quantize_slice_into,
    scales_from_amax,
)
from jax_side.mxfp8.te_probe import TEPath, TEProbe
from jax_side.mxfp8.tensor import BlockAmax, MXFP8Tensor, Plane, PlaneData, SliceCast

__all__ = [
    "BLOCK_SIZE",
    "E4M3_MAX",
    "Backend",
    "BackendChoice",
    "BlockAmax",
    "GemmImpl",
    "GemmRole",
    "KernelConfig",
    "MXFP8Tensor",
    "Plane",
    "PlaneData",
    "Platform",
    "ResolvedKernels",
    "SliceCast",
    "TEPath",
    "TEProbe",
    "cast_slice",
    "cast_slice_into",
    "decide_backend",
    "dequantize",
    "kernel_report",
    "matmul",
    "partial_block_amax",
    "quantize",
    "quantize_slice_into",
    "register_backend",
    "resolve_kernels",
    "scales_from_amax",
    "unregister_backend",
]
