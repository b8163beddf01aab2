"""MXFP8 numerics in JAX: quantize, dequantize, GEMM, and the distributed-quantization blocks.

Contract: DESIGN.md section 3 (numerics, bit-exact to the Transformer Engine kernel recipe) and
section 4 (layout). No torch import anywhere in ``jax_side``.
"""

from jax_side.mxfp8.backends import (
    Backend,
    BackendChoice,
    TEPath,
    TEProbe,
    backend_report,
    decide_backend,
    resolve_backend,
)
from jax_side.mxfp8.formats import BLOCK_SIZE, E4M3_MAX, FORMATS, ScalingFormat
from jax_side.mxfp8.gemm import GemmImpl, GemmRole, matmul
from jax_side.mxfp8.quantize import (
    BlockAmax,
    SliceCast,
    cast_slice,
    dequantize,
    partial_block_amax,
    quantize,
    scales_from_amax,
)
from jax_side.mxfp8.tensor import MXFP8Tensor, Plane

__all__ = [
    "BLOCK_SIZE",
    "E4M3_MAX",
    "FORMATS",
    "Backend",
    "BackendChoice",
    "BlockAmax",
    "GemmImpl",
    "GemmRole",
    "MXFP8Tensor",
    "Plane",
    "ScalingFormat",
    "SliceCast",
    "TEPath",
    "TEProbe",
    "backend_report",
    "cast_slice",
    "decide_backend",
    "dequantize",
    "matmul",
    "partial_block_amax",
    "quantize",
    "resolve_backend",
    "scales_from_amax",
]
