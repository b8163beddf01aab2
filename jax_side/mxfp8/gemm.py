"""MXFP8 GEMM in the three training roles of DESIGN.md 4 (table in ``common.gemm_roles``), with
fp32 accumulation.

Implementations (``common.kernels.GemmImpl``) of the ``xla`` (and kernel) backends:
- ``DEQUANT_DOT`` (the reference and the CPU default): exact dequantize of both planes to fp32,
  then ``dot_general`` with fp32 accumulation at HIGHEST precision. Bit-reproducible for a given
  program; ``jax.nn.scaled_matmul`` has no CPU lowering.
- ``DEQUANT_BF16_DOT``: dequantize both planes to bf16 and a bf16 dot with fp32 accumulation.
  An E4M3 element times its E8M0 scale has at most 4 significant bits, so it is exactly a bf16
  value wherever it is finite and its exponent is at least -130 (bf16 keeps 8 significant bits
  down to 2^-126 and subnormals down to 2^-133); only values below 2^-130 -- elements of blocks
  whose scale is below 2^-121, far under anything a trained weight or activation holds -- are
  rounded (on GPU, to the nearest bf16 subnormal; where XLA flushes subnormals, as on CPU, to
  zero). Products of two bf16 values are exact in fp32, so this path differs from the reference
  only in how the fp32 sum is accumulated (order, and the tensor cores' internal rounding).
- ``SCALED_MATMUL`` (GPU only): ``jax.nn.scaled_matmul`` on the same bytes; agrees with the
  reference to fp32-accumulation level, not bit for bit.
The ``te`` backend runs Transformer Engine's own GEMM instead (``te_backend.matmul``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from common.gemm_roles import ROLES, GemmRole, RoleSpec, role_spec
from common.kernels import Backend, GemmImpl
from jax_side.mxfp8.backends import backend_module, resolve_backend
from jax_side.mxfp8.quantize import dequantize
from jax_side.mxfp8.tensor import MXFP8Tensor, Plane

__all__ = ["GemmImpl", "GemmRole", "RoleSpec", "matmul", "role_spec"]

_OUT_DTYPES = (jnp.float32, jnp.bfloat16)


def _check_operands(a, b, role: GemmRole, spec: RoleSpec) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, MXFP8Tensor):
            raise TypeError(
                f"matmul({role.value}): operand {name} must be an MXFP8Tensor "
                f"(jax_side.mxfp8.quantize(...)), got {type(t).__name__}"
            )
    for name, t, plane in (("a", a, spec.a_plane), ("b", b, spec.b_plane)):
        if not t.has_plane(plane):
            raise ValueError(
                f"matmul({role.value}, {spec.formula}): operand {name} of shape {t.shape} needs "
                f"its {plane.value} plane, which was not quantized; quantize it with "
                f"{plane.value}=True"
            )
    ka, kb = a.shape[spec.a_contract], b.shape[spec.b_contract]
    if ka != kb:
        raise ValueError(
            f"matmul({role.value}, {spec.formula}): contracted dims differ: a.shape={a.shape} "
            f"axis {spec.a_contract} is {ka}, b.shape={b.shape} axis {spec.b_contract} is {kb}"
        )


def _dequant_dot(a, b, spec: RoleSpec) -> jax.Array:
    a32 = dequantize(a, spec.a_plane)
    b32 = dequantize(b, spec.b_plane)
    return lax.dot_general(
        a32,
        b32,
        (((spec.a_contract,), (spec.b_contract,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _dequant_bf16_dot(a, b, spec: RoleSpec) -> jax.Array:
    a16 = dequantize(a, spec.a_plane).astype(jnp.bfloat16)
    b16 = dequantize(b, spec.b_plane).astype(jnp.bfloat16)
    return lax.dot_general(
        a16,
        b16,
        (((spec.a_contract,), (spec.b_contract,)), ((), ())),
        preferred_element_type=jnp.float32,
    )


def _contract_last(t: MXFP8Tensor, plane: Plane, contract: int):
    """(rows, contracted) data and (rows, contracted/32) scales for jax.nn.scaled_matmul."""
    data, scale = t.plane(plane)
    if contract == 1:
        return data, scale  # rowwise plane: blocks already along the last axis
    return data.T, scale.T  # colwise (M, K) blocked along M -> (K, M) blocked along M


def _scaled(a, b, spec: RoleSpec) -> jax.Array:
    if jax.devices()[0].platform != "gpu":
        raise ValueError(
            "matmul: impl='scaled_matmul' needs a GPU (jax.nn.scaled_matmul has no CPU "
            "lowering); use impl='dequant_dot'"
        )
    ad, as_ = _contract_last(a, spec.a_plane, spec.a_contract)
    bd, bs = _contract_last(b, spec.b_plane, spec.b_contract)
    out = jax.nn.scaled_matmul(
        ad[None], bd[None], as_[None], bs[None], preferred_element_type=jnp.float32
    )
    return out[0]


_IMPLS = {
    GemmImpl.DEQUANT_DOT: _dequant_dot,
    GemmImpl.DEQUANT_BF16_DOT: _dequant_bf16_dot,
    GemmImpl.SCALED_MATMUL: lambda a, b, spec: _scaled(a, b, spec),
}


def matmul(
    a: MXFP8Tensor,
    b: MXFP8Tensor,
    role: GemmRole | str = GemmRole.FORWARD,
    *,
    out_dtype=jnp.float32,
    impl: GemmImpl | str | None = None,
    backend: Backend | str | None = None,
) -> jax.Array:
    """MXFP8 GEMM for one training role (``common.gemm_roles``); fp32 accumulation.

    ``impl`` selects the implementation of the ``xla`` backend (None: ``dequant_dot``); an
    explicit ``impl`` with ``backend=None`` means ``xla``; ``backend="te"`` runs TE's own GEMM and
    refuses an explicit ``impl``.
    Returns ``out_dtype`` (float32 or bfloat16), rounded once from the fp32 accumulator.
    """
    role = GemmRole.parse(role)
    impl_given = impl is not None
    impl = GemmImpl.parse(impl) if impl_given else GemmImpl.DEQUANT_DOT
    spec = ROLES[role]
    _check_operands(a, b, role, spec)
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise TypeError(f"matmul: out_dtype must be float32 or bfloat16, got {out_dtype}")
    choice = resolve_backend(Backend.XLA if impl_given and backend is None else backend)
    if choice.backend is Backend.TE:
        if impl_given:
            raise ValueError(
                f"matmul: impl={impl.value!r} selects an implementation of the 'xla' backend, "
                "but the backend is 'te' (TE runs its own GEMM); drop impl or pass backend='xla'"
            )
        out = backend_module(Backend.TE).matmul(a, b, role)
    else:
        out = _IMPLS[impl](a, b, spec)
    return out.astype(out_dtype)
