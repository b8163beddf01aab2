"""The three GEMM roles of an MXFP8 linear layer and the planes each operand reads (DESIGN.md 4).

| role    | computes       | a (shape, plane)     | b (shape, plane)     | out    | contracted |
|---------|----------------|----------------------|----------------------|--------|------------|
| FORWARD | y  = x W^T     | x  (M, K) rowwise    | W  (N, K) rowwise    | (M, N) | K          |
| DGRAD   | dx = dy W      | dy (M, N) rowwise    | W  (N, K) colwise    | (M, K) | N          |
| WGRAD   | dW = dy^T x    | dy (M, N) colwise    | x  (M, K) colwise    | (N, K) | M          |

In every role both operands are blocked along the contracted dimension, which is what makes the
block scales factor out of the dot products. ``ROLES`` is the table; every backend reads it.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from common.enums import Parseable
from common.formats import Plane

__all__ = ["ROLES", "GemmRole", "RoleSpec", "role_spec"]


class GemmRole(Parseable, enum.Enum, what="matmul role"):
    FORWARD = "forward"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


class RoleSpec(NamedTuple):
    """Which plane of each operand a role reads and which axis of it is contracted."""

    a_plane: Plane
    b_plane: Plane
    a_contract: int  # contracted axis of a's logical (rows, cols)
    b_contract: int
    formula: str


ROLES: dict[GemmRole, RoleSpec] = {
    GemmRole.FORWARD: RoleSpec(Plane.ROWWISE, Plane.ROWWISE, 1, 1, "y = x @ W.T"),
    GemmRole.DGRAD: RoleSpec(Plane.ROWWISE, Plane.COLWISE, 1, 0, "dx = dy @ W"),
    GemmRole.WGRAD: RoleSpec(Plane.COLWISE, Plane.COLWISE, 0, 0, "dW = dy.T @ x"),
}


def role_spec(role: GemmRole | str) -> RoleSpec:
    """The operand planes and contracted axes of a GEMM role (the table above)."""
    return ROLES[GemmRole.parse(role)]
