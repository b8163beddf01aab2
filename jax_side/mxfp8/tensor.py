"""``MXFP8Tensor``: the quantized form of a 2-D tensor, as a JAX pytree; and the result types of
the slice building blocks (``BlockAmax``, ``SliceCast``).

Layout (DESIGN.md 4) for a logical tensor of shape (M, K):

- ``Plane.ROWWISE``: data float8_e4m3fn (M, K), blocks of 1x32 along K; scale float8_e8m0fnu
  (M, K // 32).
- ``Plane.COLWISE``: data float8_e4m3fn (M, K) -- same, *not transposed* layout -- blocks of 32x1
  along M; scale float8_e8m0fnu (M // 32, K).

The planes are one mapping, ``planes: {Plane: PlaneData(data, scale)}``, holding only the planes
that were quantized (``t.plane(p)`` gives one, with a clear error if absent). Scales are compact
and unswizzled. ``rowwise_data`` ... ``colwise_scale`` remain as read-only conveniences (None for
an absent plane). The pytree's leaves are the present planes' arrays, in ``Plane`` order; which
planes are present is static structure, like ``shape`` and ``dtype``.

Construction checks every plane that is an array (``__post_init__``): data must be
float8_e4m3fn and scales float8_e8m0fnu (uint8 bytes are refused, not guessed: ``astype`` would
turn byte 0x44 into 68.0, not the E4M3 value 3.0; reinterpret them with
``lax.bitcast_convert_type``), with the trailing (M, K) / scale shapes of the layout above.
JAX rebuilds the dataclass through ``__init__`` whenever it unflattens it (jit, vmap,
``tree_map``), with whatever leaves the transformation carries: tracers and
``ShapeDtypeStruct`` are checked like arrays (leading batch dims, as ``vmap`` stacks them, are
allowed), anything without ``dtype`` and ``shape`` (placeholders, ``in_axes`` specs) is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from common.formats import Plane, PlaneData, PlaneFields, check_mxfp8_shape, scale_shape

__all__ = ["BlockAmax", "MXFP8Tensor", "Plane", "PlaneData", "SliceCast", "scale_bytes"]

_DATA_DTYPE = np.dtype(jax.numpy.float8_e4m3fn)
_SCALE_DTYPE = np.dtype(jax.numpy.float8_e8m0fnu)
_SOURCE_DTYPES = (np.dtype(np.float32), np.dtype(jax.numpy.bfloat16))


def _is_array_like(leaf: object) -> bool:
    return hasattr(leaf, "dtype") and hasattr(leaf, "shape")


def _check_leaf(
    owner: str, field: str, leaf: Any, dtype: np.dtype, shape: tuple[int, int]
) -> None:
    if not _is_array_like(leaf):
        return
    got = np.dtype(leaf.dtype)
    if got != dtype:
        hint = (
            f"; reinterpret the bytes with jax.lax.bitcast_convert_type({field}, "
            f"jnp.{dtype.name}) (a value cast such as astype changes them)"
            if got == np.uint8 else ""
        )
        raise TypeError(f"{owner}: {field} has dtype {got}, expected {dtype.name}{hint}")
    if len(leaf.shape) < 2 or tuple(leaf.shape)[-2:] != shape:
        raise ValueError(
            f"{owner}: {field} has shape {tuple(leaf.shape)}, expected {shape} (after any "
            f"leading batch dims); DESIGN.md 4: data (M, K) not transposed, scales rowwise "
            f"(M, K/32) and colwise (M/32, K)"
        )


def _plane_mapping(owner: str, planes: object) -> dict[Plane, PlaneData]:
    if not isinstance(planes, Mapping):
        raise TypeError(
            f"{owner}: planes must be a mapping {{Plane: PlaneData(data, scale)}}, got "
            f"{type(planes).__name__}"
        )
    out: dict[Plane, PlaneData] = {}
    for key, value in planes.items():
        plane = Plane.parse(key)
        data, scale = value
        # Both None only as transient placeholders of JAX transformations (unflattening with
        # None leaves); a plane that was not quantized is left out of the mapping.
        if (data is None) != (scale is None):
            raise ValueError(
                f"{owner}: {plane.value} data and scale must both be given or both be None "
                f"(leave an absent plane out of the mapping)"
            )
        out[plane] = PlaneData(data, scale)
    return {p: out[p] for p in Plane if p in out}  # Plane order: a stable pytree structure


@dataclasses.dataclass(frozen=True)
class MXFP8Tensor(PlaneFields):
    """MXFP8 planes of a logical (M, K) tensor. See the module docstring for the layout."""

    planes: Mapping[Plane, PlaneData]  # only the planes that were quantized
    shape: tuple[int, int]
    dtype: np.dtype  # dtype of the high-precision tensor that was quantized

    def __post_init__(self) -> None:
        shape = check_mxfp8_shape(self.shape, "MXFP8Tensor")
        object.__setattr__(self, "shape", shape)
        if np.dtype(self.dtype) not in _SOURCE_DTYPES:
            raise TypeError(
                f"MXFP8Tensor{shape}: dtype (of the quantized source) must be float32 or "
                f"bfloat16, got {self.dtype}"
            )
        owner = f"MXFP8Tensor{shape}"
        planes = _plane_mapping(owner, self.planes)
        object.__setattr__(self, "planes", planes)
        for plane, (data, scale) in planes.items():
            _check_leaf(owner, f"{plane.value}_data", data, _DATA_DTYPE, shape)
            _check_leaf(
                owner, f"{plane.value}_scale", scale, _SCALE_DTYPE, scale_shape(shape, plane)
            )

    def has_plane(self, plane: Plane | str) -> bool:
        return Plane.parse(plane) in self.planes

    def plane(self, plane: Plane | str) -> PlaneData:
        """(data, scale) of one plane; a clear error if that plane was not quantized."""
        plane = Plane.parse(plane)
        if plane not in self.planes:
            raise ValueError(
                f"this MXFP8Tensor of shape {self.shape} has no {plane.value} plane; "
                f"quantize with planes including Plane.{plane.name} to get it"
            )
        return self.planes[plane]

    @property
    def scale_shapes(self) -> dict[Plane, tuple[int, int]]:
        return {p: scale_shape(self.shape, p) for p in Plane}

    def only(self, plane: Plane | str) -> MXFP8Tensor:
        """The same tensor with only one plane kept."""
        plane = Plane.parse(plane)
        return MXFP8Tensor({plane: self.plane(plane)}, self.shape, self.dtype)


_Aux = tuple[tuple[Plane, ...], tuple[int, int], np.dtype]


def _flatten(t: MXFP8Tensor) -> tuple[tuple[PlaneData, ...], _Aux]:
    return tuple(t.planes.values()), (tuple(t.planes), t.shape, t.dtype)


def _unflatten(aux: _Aux, children: Iterable[Any]) -> MXFP8Tensor:
    keys, shape, dtype = aux
    return MXFP8Tensor(dict(zip(keys, children, strict=True)), shape, dtype)


jax.tree_util.register_pytree_node(MXFP8Tensor, _flatten, _unflatten)


class BlockAmax(NamedTuple):
    """Per-block amax, fp32, full scale-tensor shapes; zeros where nothing contributed."""

    rowwise: jax.Array | None  # float32 (M, K // 32), blocks 1x32 along K
    colwise: jax.Array | None  # float32 (M // 32, K), blocks 32x1 along M


class SliceCast(NamedTuple):
    """Quantized elements of one flat slice, as 1-D float8_e4m3fn of the slice's length."""

    rowwise: jax.Array | None
    colwise: jax.Array | None


def scale_bytes(scale: jax.Array, expected: tuple[int, int], what: str) -> jax.Array:
    """uint8 view of E8M0 scales of the expected shape (float8_e8m0fnu or uint8 accepted)."""
    if tuple(scale.shape) != expected:
        raise ValueError(f"{what}: expected scale shape {expected}, got {tuple(scale.shape)}")
    if scale.dtype == jax.numpy.float8_e8m0fnu:
        return jax.lax.bitcast_convert_type(scale, jax.numpy.uint8)
    if scale.dtype == jax.numpy.uint8:
        return scale
    raise TypeError(f"{what}: expected float8_e8m0fnu (or uint8) scales, got {scale.dtype}")
