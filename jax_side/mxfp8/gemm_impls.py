"""The GEMM implementations (``common.kernels.GemmImpl``) of the ``xla`` and ``pallas`` backends,
fp32 accumulation, in the three roles of ``common.gemm_roles`` (DESIGN.md 4).

- ``DEQUANT_DOT`` (the reference and the CPU default): exact dequantize of both planes to fp32,
  then ``dot_general`` with fp32 accumulation at HIGHEST precision. Bit-reproducible for a given
  program; ``jax.nn.scaled_matmul`` has no CPU lowering.
- ``DEQUANT_BF16_DOT`` (the GPU default): dequantize both planes to bf16 and a bf16 dot with fp32
  accumulation. An E4M3 element times its E8M0 scale has at most 4 significant bits, so it is
  exactly a bf16 value wherever it is finite and its exponent is at least -130 (bf16 keeps 8
  significant bits down to 2^-126 and subnormals down to 2^-133); only values below 2^-130 --
  elements of blocks whose scale is below 2^-121, far under anything a trained weight or
  activation holds -- are rounded (on GPU, to the nearest bf16 subnormal; where XLA flushes
  subnormals, as on CPU, to zero). Products of two bf16 values are exact in fp32, so this path
  differs from the reference only in how the fp32 sum is accumulated (order, and the tensor
  cores' internal rounding).
- ``SCALED_MATMUL`` (GPU only): ``jax.nn.scaled_matmul`` on the same bytes; agrees with the
  reference to fp32-accumulation level, not bit for bit.
- ``FP8_BLOCKED`` (Hopper's FP8 tensor cores, DESIGN.md 11): both operands re-blocked
  (``reblock``: a in 1x128 blocks, b in 128x128 tiles, codes of smaller sub-blocks shifted with
  round-to-nearest-even), then cuBLASLt's block-scaled FP8 GEMM through an XLA FFI call
  (``cublaslt``) on a GPU; ``FP8_BLOCKED_PALLAS`` runs the same re-blocked GEMM with the Pallas
  kernel of ``fp8_blocked_kernel`` instead. On the CPU (also a program placed on the CPU of a
  GPU machine: ``lax.platform_dependent``) both run the exact fp32 dot of the re-blocked values
  (the same numbers up to the order of fp32 sums). The cuBLASLt kernel writes a bf16 result
  itself (``out_dtype``: the same bytes as rounding its fp32 result, tested on the GPU). Not
  the MXFP8 values exactly: elements that the shift makes e4m3 subnormal or zero change
  (bounded in tests/jax_side/mxfp8/test_fp8_blocked.py).

The ``te`` backend runs Transformer Engine's own GEMM instead (``te_backend.matmul``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from common.formats import round_up
from common.gemm_roles import ROLES, GemmRole, RoleSpec
from common.kernels import GemmImpl
from jax_side.mxfp8 import cublaslt, reblock
from jax_side.mxfp8.dequantize import dequantize
from jax_side.mxfp8.fp8_blocked_kernel import blocked_matmul
from jax_side.mxfp8.tensor import MXFP8Tensor, Plane, scale_bytes

__all__ = ["b_tiles", "blocked_product", "blocked_product_into", "run_gemm", "writes_directly"]

_F32 = jnp.dtype(jnp.float32)


def _dequant_dot(a: MXFP8Tensor, b: MXFP8Tensor, spec: RoleSpec) -> jax.Array:
    a32 = dequantize(a, spec.a_plane)
    b32 = dequantize(b, spec.b_plane)
    return lax.dot_general(
        a32,
        b32,
        (((spec.a_contract,), (spec.b_contract,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _dequant_bf16_dot(a: MXFP8Tensor, b: MXFP8Tensor, spec: RoleSpec) -> jax.Array:
    a16 = dequantize(a, spec.a_plane).astype(jnp.bfloat16)
    b16 = dequantize(b, spec.b_plane).astype(jnp.bfloat16)
    return lax.dot_general(
        a16,
        b16,
        (((spec.a_contract,), (spec.b_contract,)), ((), ())),
        preferred_element_type=jnp.float32,
    )


def _contract_last(t: MXFP8Tensor, plane: Plane, contract: int) -> tuple[jax.Array, jax.Array]:
    """(rows, contracted) data and (rows, contracted/32) scales for jax.nn.scaled_matmul."""
    data, scale = t.plane(plane)
    if contract == 1:
        return data, scale  # rowwise plane: blocks already along the last axis
    return data.T, scale.T  # colwise (M, K) blocked along M -> (K, M) blocked along M


def _scaled(a: MXFP8Tensor, b: MXFP8Tensor, spec: RoleSpec) -> jax.Array:
    if jax.devices()[0].platform != "gpu":
        raise ValueError(
            "matmul: gemm 'scaled_matmul' needs a GPU (jax.nn.scaled_matmul has no CPU "
            "lowering); use gemm='dequant_dot'"
        )
    ad, as_ = _contract_last(a, spec.a_plane, spec.a_contract)
    bd, bs = _contract_last(b, spec.b_plane, spec.b_contract)
    out = jax.nn.scaled_matmul(
        ad[None], bd[None], as_[None], bs[None], preferred_element_type=jnp.float32
    )
    return out[0]


def b_tiles(b: MXFP8Tensor, spec: RoleSpec) -> tuple[reblock.Reblocked, int]:
    """b re-blocked into 128x128 tiles, padded with zero codes to whole tiles (rows and K to
    multiples of 128), and b's row count (the GEMM's N) before padding."""
    bd, bs = _contract_last(b, spec.b_plane, spec.b_contract)
    n, k = bd.shape
    bs = scale_bytes(bs, bs.shape, "fp8_blocked: b's scale")
    return reblock.reblock_tiles(*reblock.pad_to(bd, bs, round_up(n, reblock.GROUP),
                                                 round_up(k, reblock.GROUP))), n


def _a_rows(a: MXFP8Tensor, spec: RoleSpec) -> reblock.Reblocked:
    """a in 1x128 blocks, padded with zero codes (K to a multiple of 128, rows to 16)."""
    ad, as_ = _contract_last(a, spec.a_plane, spec.a_contract)
    m, k = ad.shape
    as_ = scale_bytes(as_, as_.shape, "fp8_blocked: a's scale")
    return reblock.reblock_rows(*reblock.pad_to(ad, as_, round_up(m, 16),
                                                round_up(k, reblock.GROUP)))


def blocked_product(ra: reblock.Reblocked, rb: reblock.Reblocked, m: int, n: int,
                    out_dtype: jnp.dtype = _F32, *, pallas: bool = False) -> jax.Array:
    """(m, n) of ``ra @ rb^T`` for re-blocked operands (a in 1x128 blocks, b in 128x128 tiles,
    the same padded K): cuBLASLt's (or, ``pallas``, the Pallas kernel's) FP8 GEMM where the
    program runs on a GPU, the exact fp32 dot of the same values elsewhere."""

    def exact(ra: reblock.Reblocked, rb: reblock.Reblocked) -> jax.Array:
        return reblock.blocked_dot_reference(ra, rb).astype(out_dtype)

    def kernel(ra: reblock.Reblocked, rb: reblock.Reblocked) -> jax.Array:
        if pallas:
            return blocked_matmul(ra, rb).astype(out_dtype)
        # cuBLASLt rounds its fp32 accumulator to out_dtype itself: no fp32 pass over the output
        return cublaslt.blocked_gemm(ra, rb, out_dtype=out_dtype)

    if jax.devices()[0].platform != "gpu":
        out = exact(ra, rb)
    else:  # by where the program runs: operands placed on the CPU of a GPU machine take exact
        out = lax.platform_dependent(ra, rb, cuda=kernel, default=exact)
    return out[:m, :n]


def writes_directly(dtype: jnp.dtype, start: int, ra: reblock.Reblocked, rb: reblock.Reblocked,
                    m: int, n: int, *, pallas: bool = False) -> bool:
    """Whether ``blocked_product_into`` of these operands into a ``dtype`` buffer at ``start``
    may be written by cuBLASLt itself (on a GPU: the compiled program's CUDA branch), rather than
    computed and then copied in by an update."""
    aligned = start * jnp.dtype(dtype).itemsize % cublaslt.INTO_ALIGN_BYTES == 0
    return (not pallas and aligned and (m, n) == (ra.data.shape[0], rb.data.shape[0])
            and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)
            and jax.devices()[0].platform == "gpu")


def blocked_product_into(buf: jax.Array, start: int, ra: reblock.Reblocked,
                         rb: reblock.Reblocked, m: int, n: int, *,
                         pallas: bool = False) -> jax.Array:
    """``buf`` (1-D) with ``blocked_product(ra, rb, m, n, buf.dtype)`` written row-major at
    element ``start``: the same bytes as ``lax.dynamic_update_slice`` of it. On a GPU, where
    the product needs no cut (m and n are the padded dims), cuBLASLt writes it there itself
    (``cublaslt.blocked_gemm_into``: no temporary, no copy; a weight gradient straight into its
    grad bucket); otherwise the product, then the update."""
    def update(buf: jax.Array, ra: reblock.Reblocked, rb: reblock.Reblocked) -> jax.Array:
        out = blocked_product(ra, rb, m, n, buf.dtype, pallas=pallas)
        return lax.dynamic_update_slice(buf, out.reshape(-1), (start,))

    if not writes_directly(buf.dtype, start, ra, rb, m, n, pallas=pallas):
        return update(buf, ra, rb)
    return lax.platform_dependent(
        buf, ra, rb, cuda=lambda buf, ra, rb: cublaslt.blocked_gemm_into(buf, start, ra, rb),
        default=update)


def _fp8_blocked(a: MXFP8Tensor, b: MXFP8Tensor, spec: RoleSpec, out_dtype: jnp.dtype = _F32,
                 *, pallas: bool = False) -> jax.Array:
    rb, n = b_tiles(b, spec)
    return blocked_product(_a_rows(a, spec), rb, a.shape[1 - spec.a_contract], n, out_dtype,
                           pallas=pallas)


def _fp8_blocked_pallas(a: MXFP8Tensor, b: MXFP8Tensor, spec: RoleSpec,
                        out_dtype: jnp.dtype = _F32) -> jax.Array:
    return _fp8_blocked(a, b, spec, out_dtype, pallas=True)


_IMPLS: dict[GemmImpl, Callable[[MXFP8Tensor, MXFP8Tensor, RoleSpec], jax.Array]] = {
    GemmImpl.DEQUANT_DOT: _dequant_dot,
    GemmImpl.DEQUANT_BF16_DOT: _dequant_bf16_dot,
    GemmImpl.SCALED_MATMUL: _scaled,
}
_ROUNDING: dict[GemmImpl, Callable[[MXFP8Tensor, MXFP8Tensor, RoleSpec, jnp.dtype], jax.Array]] = {
    GemmImpl.FP8_BLOCKED: _fp8_blocked,
    GemmImpl.FP8_BLOCKED_PALLAS: _fp8_blocked_pallas,
}


def run_gemm(a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole, gemm: GemmImpl,
             out_dtype: jnp.dtype = _F32) -> jax.Array:
    """(rows, cols) of role ``role`` on validated operands, by implementation ``gemm``: the fp32
    accumulator rounded once to ``out_dtype`` (float32 or bfloat16). The ``fp8_blocked`` GEMM
    rounds inside its kernel on a GPU (the same round-to-nearest-even of the same fp32 sums);
    the others return fp32, rounded here."""
    if gemm in _ROUNDING:
        return _ROUNDING[gemm](a, b, ROLES[role], out_dtype)
    return _IMPLS[gemm](a, b, ROLES[role]).astype(out_dtype)
