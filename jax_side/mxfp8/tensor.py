"""``MXFP8Tensor``: the quantized form of a 2-D tensor, as a JAX pytree; and the result types of
the slice building blocks (``BlockAmax``, ``SliceCast``).

Layout (DESIGN.md 4) for a logical tensor of shape (M, K):

- rowwise plane: ``rowwise_data`` float8_e4m3fn (M, K), blocks of 1x32 along K;
  ``rowwise_scale`` float8_e8m0fnu (M, K // 32).
- columnwise plane: ``colwise_data`` float8_e4m3fn (M, K) -- same, *not transposed* layout --
  blocks of 32x1 along M; ``colwise_scale`` float8_e8m0fnu (M // 32, K).

Scales are compact and unswizzled. A plane that was not requested is ``None``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from common.formats import Plane, scale_shape

__all__ = ["BlockAmax", "MXFP8Tensor", "Plane", "SliceCast"]


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
        return {p: scale_shape(self.shape, p) for p in Plane}

    def only(self, plane: Plane | str) -> MXFP8Tensor:
        """The same tensor with only one plane kept (the other set to None)."""
        plane = Plane.parse(plane)
        if plane is Plane.ROWWISE:
            return MXFP8Tensor(
                self.rowwise_data, self.rowwise_scale, None, None, self.shape, self.dtype
            )
        return MXFP8Tensor(
            None, None, self.colwise_data, self.colwise_scale, self.shape, self.dtype
        )


jax.tree_util.register_dataclass(
    MXFP8Tensor,
    data_fields=["rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale"],
    meta_fields=["shape", "dtype"],
)


class BlockAmax(NamedTuple):
    """Per-block amax, fp32, full scale-tensor shapes; zeros where nothing contributed."""

    rowwise: jax.Array | None  # float32 (M, K // 32), blocks 1x32 along K
    colwise: jax.Array | None  # float32 (M // 32, K), blocks 32x1 along M


class SliceCast(NamedTuple):
    """Quantized elements of one flat slice, as 1-D float8_e4m3fn of the slice's length."""

    rowwise: jax.Array | None
    colwise: jax.Array | None
