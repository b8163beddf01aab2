"""Public MXFP8 GEMM in the three training roles of DESIGN.md 4 (table in ``common.gemm_roles``),
with fp32 accumulation: validated, then run by the backend its kernels resolve to.

The kernels resolve through the one resolver (``kernels.resolve_kernels``): the same
``KernelConfig`` gives the same GEMM here, in the linear layer and in ``kernel_report``. The
``xla`` and ``pallas`` backends run the implementation ``ResolvedKernels.gemm`` names
(``gemm_impls``: exact ``dequant_dot``, the CPU default; ``dequant_bf16_dot``, the GPU default;
``scaled_matmul``); the ``te`` backend runs Transformer Engine's own GEMM (``te_backend.matmul``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from common.gemm_roles import ROLES, GemmRole, RoleSpec, role_spec
from common.kernels import Backend, GemmImpl, KernelConfig
from jax_side.mxfp8.backends import backend_impl
from jax_side.mxfp8.kernels import ResolvedKernels, resolve_call
from jax_side.mxfp8.tensor import MXFP8Tensor

__all__ = ["GemmImpl", "GemmRole", "RoleSpec", "matmul", "role_spec"]

_OUT_DTYPES = (jnp.float32, jnp.bfloat16)


def _check_operands(a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole, spec: RoleSpec) -> None:
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
                f"planes including Plane.{plane.name}"
            )
    ka, kb = a.shape[spec.a_contract], b.shape[spec.b_contract]
    if ka != kb:
        raise ValueError(
            f"matmul({role.value}, {spec.formula}): contracted dims differ: a.shape={a.shape} "
            f"axis {spec.a_contract} is {ka}, b.shape={b.shape} axis {spec.b_contract} is {kb}"
        )


def matmul(
    a: MXFP8Tensor,
    b: MXFP8Tensor,
    role: GemmRole | str = GemmRole.FORWARD,
    *,
    out_dtype: DTypeLike = jnp.float32,
    impl: GemmImpl | str | None = None,
    backend: Backend | str | None = None,
    kernels: KernelConfig | ResolvedKernels | None = None,
) -> jax.Array:
    """MXFP8 GEMM for one training role (``common.gemm_roles``); fp32 accumulation.

    kernels: a ``KernelConfig`` (None: the automatic default for JAX's default device, or the
    CPU's for operands that lie on the CPU, ``kernels.placement``; the GEMM ``kernel_report``
    names); ``impl=`` and ``backend=`` are shorthand for ``kernels=KernelConfig(backend,
    gemm=impl)``. A chosen GEMM keeps the automatic backend off ``te``; ``te`` (which runs its
    own GEMM) refuses a chosen GEMM.
    Returns ``out_dtype`` (float32 or bfloat16), rounded once from the fp32 accumulator.
    """
    role = GemmRole.parse(role)
    spec = ROLES[role]
    _check_operands(a, b, role, spec)
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise TypeError(f"matmul: out_dtype must be float32 or bfloat16, got {out_dtype}")
    resolved = resolve_call("matmul", kernels, backend, impl, operands=(a, b))
    return backend_impl(resolved.backend).matmul_rounded(a, b, role, resolved.gemm,
                                                         jnp.dtype(out_dtype))
