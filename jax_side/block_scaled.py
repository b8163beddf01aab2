"""Weight planes of block-scaled formats other than MXFP8, read by the reference numerics.

FSDP stores, gathers and hands over the planes of any block-scaled format its table describes
(``common.formats.ScaleBlocks``: element and scale dtypes, block size, the scale shape of each
plane); ``jax_side.mxfp8``'s kernels read one of them, MXFP8 (E4M3 elements, E8M0 scales,
32-element blocks). The one JAX linear (``jax_side.linear``, hence the Torch op, the unit
programs and the Flax twin) reads every other weight plane here, by asking its ``ScaleBlocks``:

- ``dequantize_plane``: fp32 (N, K) of one plane whose elements are E4M3 bytes and whose scales
  are E8M0 bytes, for any block size: ``e4m3(y) * 2**(E - 127)`` with each scale repeated over
  its block along the plane's blocked axis, exactly as MXFP8's dequantize (DESIGN.md 3 step 5,
  ``jax_side.mxfp8.xla_impl.dequantize_plane``). Other element or scale dtypes (4-bit elements
  packed two per byte, E4M3 scales, a tensor-level scale: ``NVFP4``) are refused by name; their
  dequantize belongs here.
- ``matmul``: a GEMM of one training role (``common.gemm_roles``) between a quantized MXFP8
  operand (the activation or gradient, quantized by ``jax_side.mxfp8`` as for any weight) and
  such a dequantized weight plane, fp32 accumulation: at HIGHEST precision (the ``dequant_dot``
  reference), or with bf16 products when the kernels' GEMM is ``dequant_bf16_dot`` (E4M3 times
  a power of two is exact in bf16, as there). There is no fast kernel for these formats: a
  format that needs speed adds its kernels beside ``jax_side.mxfp8``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from common.formats import Plane, ScaleBlocks
from common.gemm_roles import ROLES, GemmRole
from common.kernels import GemmImpl
from jax_side.mxfp8 import MXFP8Tensor, dequantize
from jax_side.mxfp8.xla_impl import dequantize_plane as _e4m3_times_e8m0

__all__ = ["check_readable", "dequantize_plane", "matmul"]

_ELEMENTS, _SCALES = "float8_e4m3fn", "float8_e8m0fnu"


def check_readable(blocks: ScaleBlocks) -> None:
    """A clear error unless ``dequantize_plane`` reads planes of ``blocks``."""
    if (blocks.element_dtype, blocks.scale_dtype, blocks.elements_per_byte,
            blocks.tensor_scale_dtype) != (_ELEMENTS, _SCALES, 1, None):
        raise NotImplementedError(
            f"jax_side.block_scaled reads planes of {_ELEMENTS} elements (one per byte) with "
            f"{_SCALES} block scales and no tensor scale, at any block size; got {blocks}. Add "
            f"the format's dequantize to jax_side/block_scaled.py (docs/extending.md, 'A "
            f"weight format')"
        )


def _bitcast(a: jax.Array, dtype: DTypeLike) -> jax.Array:
    return a if a.dtype == dtype else lax.bitcast_convert_type(a, dtype)


def dequantize_plane(
    data: jax.Array, scale: jax.Array, plane: Plane, blocks: ScaleBlocks
) -> jax.Array:
    """float32 (N, K) of one plane: ``data`` (N, K) E4M3 (or its uint8 bytes), ``scale``
    ``blocks.scale_shape((N, K), plane)`` E8M0 (or uint8), blocked along K (rowwise) or N
    (columnwise) by ``blocks.block_size``; exact."""
    check_readable(blocks)
    exp = jnp.repeat(_bitcast(scale, jnp.uint8), blocks.block_size,
                     axis=1 if plane is Plane.ROWWISE else 0)
    return _e4m3_times_e8m0(_bitcast(data, jnp.float8_e4m3fn), exp)


def matmul(a: MXFP8Tensor, w32: jax.Array, role: GemmRole, gemm: GemmImpl | None) -> jax.Array:
    """fp32 GEMM of role ``role``: ``a``'s plane of that role (dequantized exactly) against a
    dequantized weight plane ``w32`` (N, K) fp32, fp32 accumulation (module note)."""
    spec = ROLES[role]
    a32 = dequantize(a, spec.a_plane)
    dims = (((spec.a_contract,), (spec.b_contract,)), ((), ()))
    if gemm is GemmImpl.DEQUANT_BF16_DOT:
        return lax.dot_general(a32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16), dims,
                               preferred_element_type=jnp.float32)
    return lax.dot_general(a32, w32, dims, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
