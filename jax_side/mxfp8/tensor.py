"""``MXFP8Tensor``: the quantized form of a 2-D tensor, as a JAX pytree.

Layout (DESIGN.md 4) for a logical tensor of shape (M, K):

- rowwise plane: ``rowwise_data`` float8_e4m3fn (M, K), blocks of 1x32 along K;
  ``rowwise_scale`` float8_e8m0fnu (M, K // 32).
- columnwise plane: ``colwise_data`` float8_e4m3fn (M, K) -- same, *not transposed* layout --
  blocks of 32x1 along M; ``colwise_scale`` float8_e8m0fnu (M // 32, K).

Scales are compact and unswizzled. A plane that was not requested is ``None``.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import numpy as np

from jax_side.enum_parsing import parse_enum
from jax_side.mxfp8.formats import BLOCK_SIZE

__all__ = ["MXFP8Tensor", "Plane"]


class Plane(enum.Enum):
    """Which quantized copy of a tensor: blocks along K (rowwise) or along M (columnwise)."""

    ROWWISE = "rowwise"
    COLWISE = "colwise"

    @classmethod
    def parse(cls, plane: Plane | str) -> Plane:
        return parse_enum(cls, plane, what="MXFP8 plane", aliases={"columnwise": cls.COLWISE})


@dataclasses.dataclass(frozen=True)
class MXFP8Tensor:
    """MXFP8 planes of a logical (M, K) tensor. See the module docstring for the layout."""

    rowwise_data: jax.Array | None
    rowwise_scale: jax.Array | None
    colwise_data: jax.Array | None
    colwise_scale: jax.Array | None
    shape: tuple[int, int]
    dtype: np.dtype  # dtype of the high-precision tensor that was quantized

    def has_plane(self, plane: Plane | str) -> bool:
        plane = Plane.parse(plane)
        return (self.rowwise_data if plane is Plane.ROWWISE else self.colwise_data) is not None

    def plane(self, plane: Plane | str) -> tuple[jax.Array, jax.Array]:
        """(data, scale) of one plane; a clear error if that plane was not quantized."""
        plane = Plane.parse(plane)
        if plane is Plane.ROWWISE:
            data, scale = self.rowwise_data, self.rowwise_scale
        else:
            data, scale = self.colwise_data, self.colwise_scale
        if data is None or scale is None:
            flag = "rowwise" if plane is Plane.ROWWISE else "colwise"
            raise ValueError(
                f"this MXFP8Tensor of shape {self.shape} has no {plane.value} plane; "
                f"quantize with {flag}=True to get it"
            )
        return data, scale

    @property
    def scale_shapes(self) -> dict[Plane, tuple[int, int]]:
        m, k = self.shape
        return {Plane.ROWWISE: (m, k // BLOCK_SIZE), Plane.COLWISE: (m // BLOCK_SIZE, k)}


jax.tree_util.register_dataclass(
    MXFP8Tensor,
    data_fields=["rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale"],
    meta_fields=["shape", "dtype"],
)
