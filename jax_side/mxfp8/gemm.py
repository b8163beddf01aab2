"""MXFP8 GEMM in the three training roles of DESIGN.md 4, with fp32 accumulation.

| role    | computes       | a (shape, plane)     | b (shape, plane)     | out    | contracted |
|---------|----------------|----------------------|----------------------|--------|------------|
| FORWARD | y  = x W^T     | x  (M, K) rowwise    | W  (N, K) rowwise    | (M, N) | K          |
| DGRAD   | dx = dy W      | dy (M, N) rowwise    | W  (N, K) colwise    | (M, K) | N          |
| WGRAD   | dW = dy^T x    | dy (M, N) colwise    | x  (M, K) colwise    | (N, K) | M          |

In every role both operands are blocked along the contracted dimension, which is what makes the
block scales factor out of the dot products.

Implementations (``GemmImpl``):
- ``DEQUANT_DOT`` (default, every platform): exact dequantize of both planes to fp32, then
  ``dot_general`` with fp32 accumulation at HIGHEST precision. ``jax.nn.scaled_matmul`` has no CPU
  lowering, and this is the reference for any faster path.
- ``SCALED_MATMUL`` (GPU only, opt-in): ``jax.nn.scaled_matmul`` on the same bytes; agrees with
  the reference to fp32-accumulation level, not bit for bit (different summation order).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_side.enum_parsing import parse_enum
from jax_side.mxfp8.backends import Backend, resolve_backend
from jax_side.mxfp8.quantize import dequantize
from jax_side.mxfp8.tensor import MXFP8Tensor, Plane

__all__ = ["GemmImpl", "GemmRole", "RoleSpec", "matmul", "role_spec"]


class GemmRole(enum.Enum):
    FORWARD = "forward"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


class GemmImpl(enum.Enum):
    DEQUANT_DOT = "dequant_dot"
    SCALED_MATMUL = "scaled_matmul"


class RoleSpec(NamedTuple):
    """Which plane of each operand a role reads and which axis of it is contracted."""

    a_plane: Plane
    b_plane: Plane
    a_contract: int  # contracted axis of a's logical (rows, cols)
    b_contract: int
    formula: str


_ROLES: dict[GemmRole, RoleSpec] = {
    GemmRole.FORWARD: RoleSpec(Plane.ROWWISE, Plane.ROWWISE, 1, 1, "y = x @ W.T"),
    GemmRole.DGRAD: RoleSpec(Plane.ROWWISE, Plane.COLWISE, 1, 0, "dx = dy @ W"),
    GemmRole.WGRAD: RoleSpec(Plane.COLWISE, Plane.COLWISE, 0, 0, "dW = dy.T @ x"),
}


def role_spec(role: GemmRole | str) -> RoleSpec:
    """The operand planes and contracted axes of a GEMM role (the table in the module docstring)."""
    return _ROLES[parse_enum(GemmRole, role, what="matmul role")]

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


def matmul(
    a: MXFP8Tensor,
    b: MXFP8Tensor,
    role: GemmRole | str = GemmRole.FORWARD,
    *,
    out_dtype=jnp.float32,
    impl: GemmImpl | str | None = None,
    backend: Backend | str | None = None,
) -> jax.Array:
    """MXFP8 GEMM for one training role (table in the module docstring); fp32 accumulation.

    ``impl`` selects the ``xla`` backend's implementation (None: ``dequant_dot``); an explicit
    ``impl`` with ``backend=None`` means ``xla``; ``backend="te"`` runs TE's own GEMM and refuses
    an explicit ``impl``.
    Returns ``out_dtype`` (float32 or bfloat16), rounded once from the fp32 accumulator.
    """
    role = parse_enum(GemmRole, role, what="matmul role")
    impl_given = impl is not None
    impl = parse_enum(GemmImpl, impl if impl_given else GemmImpl.DEQUANT_DOT, what="matmul impl")
    spec = _ROLES[role]
    _check_operands(a, b, role, spec)
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise TypeError(f"matmul: out_dtype must be float32 or bfloat16, got {out_dtype}")
    choice = resolve_backend(Backend.XLA if impl_given and backend is None else backend)
    if choice.backend is Backend.TE:
        from jax_side.mxfp8 import te_backend

        if impl_given:
            raise ValueError(
                f"matmul: impl={impl.value!r} selects an implementation of the 'xla' backend, "
                "but the backend is 'te' (TE runs its own GEMM); drop impl or pass backend='xla'"
            )
        out = te_backend.matmul(a, b, role)
    elif impl is GemmImpl.SCALED_MATMUL:
        out = _scaled(a, b, spec)
    else:
        out = _dequant_dot(a, b, spec)
    return out.astype(out_dtype)
