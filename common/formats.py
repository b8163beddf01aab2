"""Formats of model weights and the MXFP8 layout facts, in one table (DESIGN.md 3-5).

- ``BLOCK_SIZE`` (32), ``E4M3_MAX`` (448), ``E8M0_BIAS`` (127): the MXFP8 constants, defined once.
- ``Plane``: which quantized copy of a 2-D (M, K) tensor -- ``ROWWISE`` (blocks 1x32 along K,
  scales (M, K/32)) or ``COLWISE`` (blocks 32x1 along M, data *not transposed*, scales (M/32, K)).
  A high-precision weight has one plane, ``ROWWISE``: the weights themselves.
- ``WeightFormat``: the format of the model weights forward and backward read, with ``FORMATS``
  mapping each one to a ``FormatSpec``: the model weight buffer's dtype, the high-precision dtype
  the weight is made from, the planes it consists of (forward reads the first, backward the last)
  and, for block-scaled formats, ``ScaleBlocks`` (element and scale dtypes, block size, element
  max). Code asks the table; nothing branches on a derived boolean. ``NVFP4`` is described here
  so that the table shows the room left for it, but no layer implements it: each layer refuses
  it (and any format missing from its own table) with a clear error.

Dtypes are named by strings (``"bfloat16"``, ``"uint8"``, ``"float8_e4m3fn"``) so this module
stays framework-free; each layer maps names to its own dtype objects.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol, runtime_checkable

from common.enums import parse_enum

__all__ = [
    "BLOCK_SIZE",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_INF",
    "E8M0_NAN",
    "FORMATS",
    "FormatSpec",
    "ALL_PLANES",
    "Plane",
    "PlaneData",
    "PlaneFields",
    "ScaleBlocks",
    "BlockScaledParams",
    "WeightFormat",
    "block_scaled_params",
    "block_shape_problem",
    "check_mxfp8_shape",
    "format_spec",
    "parse_planes",
    "scale_shape",
]

BLOCK_SIZE = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_INF = 0xFE


class Plane(enum.Enum):
    """Which quantized copy of a tensor: blocks along K (rowwise) or along M (columnwise)."""

    ROWWISE = "rowwise"
    COLWISE = "colwise"

    @classmethod
    def parse(cls, plane: Plane | str) -> Plane:
        return parse_enum(cls, plane, what="MXFP8 plane", aliases={"columnwise": cls.COLWISE})


ALL_PLANES = (Plane.ROWWISE, Plane.COLWISE)


class PlaneData(NamedTuple):
    """One quantized plane: ``data`` (M, K) elements and its compact ``scale`` (framework arrays;
    which shapes: ``scale_shape``). The tensor classes hold ``{Plane: PlaneData}``."""

    data: Any
    scale: Any


class PlaneFields:
    """Read-only conveniences of the tensor classes that hold ``planes: {Plane: PlaneData}``:
    ``rowwise_data`` ... ``colwise_scale``, None when the plane is absent."""

    planes: dict[Plane, PlaneData]

    def _field(self, plane: Plane, i: int):
        got = self.planes.get(plane)
        return None if got is None else got[i]

    rowwise_data = property(lambda self: self._field(Plane.ROWWISE, 0))
    rowwise_scale = property(lambda self: self._field(Plane.ROWWISE, 1))
    colwise_data = property(lambda self: self._field(Plane.COLWISE, 0))
    colwise_scale = property(lambda self: self._field(Plane.COLWISE, 1))


def parse_planes(planes: Plane | str | Iterable[Plane | str], what: str) -> tuple[Plane, ...]:
    """The planes asked for, in ``Plane`` order without repeats; a clear error if none."""
    if isinstance(planes, Plane | str):
        planes = (planes,)
    asked = {Plane.parse(p) for p in planes}
    if not asked:
        raise ValueError(
            f"{what}: planes=() asks for nothing; pass Plane.ROWWISE and/or Plane.COLWISE"
        )
    return tuple(p for p in Plane if p in asked)


class WeightFormat(enum.Enum):
    """Format of the model weights that forward and backward read."""

    FP32 = "fp32"
    BF16 = "bf16"
    MXFP8_E4M3 = "mxfp8_e4m3"
    NVFP4 = "nvfp4"  # described in FORMATS; not implemented by any layer yet

    @classmethod
    def parse(cls, value: WeightFormat | str) -> WeightFormat:
        return parse_enum(cls, value, what="weight format")


@dataclasses.dataclass(frozen=True)
class ScaleBlocks:
    """Facts of a block-scaled format."""

    element_dtype: str  # e.g. "float8_e4m3fn"
    scale_dtype: str  # e.g. "float8_e8m0fnu"
    block_size: int  # elements per scale, along the blocked axis of each plane
    element_max: float  # largest finite element magnitude


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """One row of ``FORMATS``; see the module docstring."""

    buffer_dtype: str  # dtype of the model weight buffer (and of each plane's buffer)
    source_dtype: str  # high-precision dtype the model weights are made from
    planes: tuple[Plane, ...]  # forward reads planes[0], backward planes[-1]
    blocks: ScaleBlocks | None  # None: stored as is, not block-scaled

    @property
    def forward_plane(self) -> Plane:
        return self.planes[0]

    @property
    def backward_plane(self) -> Plane:
        return self.planes[-1]

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a weight of ``shape`` cannot take this format, or None if it can."""
        if self.blocks is None:
            return None
        return block_shape_problem(shape, self.blocks.block_size)


_MXFP8_BLOCKS = ScaleBlocks("float8_e4m3fn", "float8_e8m0fnu", BLOCK_SIZE, E4M3_MAX)


FORMATS: dict[WeightFormat, FormatSpec] = {
    WeightFormat.FP32: FormatSpec("float32", "float32", (Plane.ROWWISE,), None),
    WeightFormat.BF16: FormatSpec("bfloat16", "bfloat16", (Plane.ROWWISE,), None),
    WeightFormat.MXFP8_E4M3: FormatSpec("uint8", "bfloat16", ALL_PLANES, _MXFP8_BLOCKS),
    WeightFormat.NVFP4: FormatSpec(
        "uint8", "bfloat16", ALL_PLANES, ScaleBlocks("float4_e2m1fn", "float8_e4m3fn", 16, 6.0)
    ),
}


@runtime_checkable
class BlockScaledParams(Protocol):
    """A module that declares which of its own parameters are block-scaled (MXFP8) weights.

    ``mxfp8_params()`` returns the names of direct parameters (``module.<name>``) that the
    policy's block-scaled weight format applies to (e.g. ``("weight",)`` for
    ``bridge.MXFP8Linear`` in ``LinearMode.MXFP8``, ``()`` otherwise). FSDP hands such a
    parameter's planes to the module through its forward's ``weight_planes`` argument, so a module
    declares at most one. A module without the method declares none.
    """

    def mxfp8_params(self) -> tuple[str, ...]: ...


def block_scaled_params(module) -> tuple[str, ...]:
    """The parameter names ``module`` declares block-scaled (``BlockScaledParams``), validated."""
    if not isinstance(module, BlockScaledParams):
        return ()
    names = tuple(module.mxfp8_params())
    where = f"{type(module).__name__}.mxfp8_params()"
    if len(names) > 1:
        raise ValueError(
            f"{where} returned {names}; a module can declare at most one block-scaled parameter "
            f"(its planes arrive through the forward's single weight_planes argument): split the "
            f"module"
        )
    for name in names:
        if not isinstance(name, str) or not hasattr(module, name):
            raise ValueError(
                f"{where} returned {name!r}, which is not an attribute of the module; return the "
                f"names of its own parameters, e.g. ('weight',)"
            )
    return names


def format_spec(fmt: WeightFormat | str) -> FormatSpec:
    """The table row of a format (accepts the enum or its value)."""
    return FORMATS[WeightFormat.parse(fmt)]


def scale_shape(shape: tuple[int, int], plane: Plane) -> tuple[int, int]:
    """Compact E8M0 scale shape of one MXFP8 plane of a logical (M, K) tensor (DESIGN.md 4):
    rowwise (M, K/32), columnwise (M/32, K)."""
    m, k = shape
    if plane is Plane.ROWWISE:
        return (m, k // BLOCK_SIZE)
    return (m // BLOCK_SIZE, k)


def _round_up(d: int) -> int:
    return max(BLOCK_SIZE, -(-d // BLOCK_SIZE) * BLOCK_SIZE)


def block_shape_problem(shape, block: int = BLOCK_SIZE) -> str | None:
    """Why ``shape`` cannot be block-scaled with ``block``-element blocks, or None if it can.

    The one block-shape rule (DESIGN.md 4): 2-D (M, K) with M and K *positive* multiples of the
    block. Empty dimensions are refused everywhere (an empty tensor has no blocks and no scales
    to agree on; keep it in a non-block-scaled format instead).
    """
    if len(shape) != 2:
        return f"a block-scaled tensor must be 2-D (M, K), got {len(shape)}-D shape {shape}"
    if not all(d > 0 and d % block == 0 for d in shape):
        return (
            f"a block-scaled tensor needs M and K positive multiples of {block} "
            f"(non-empty), got shape (M, K) = {shape}"
        )
    return None


def check_mxfp8_shape(shape, what: str) -> tuple[int, int]:
    """(M, K) of a valid MXFP8 tensor shape, else a ValueError naming ``what`` and the fix.

    Every layer (JAX and Torch tensor classes, quantize, the linear op, distributed quantize)
    checks MXFP8 shapes through this function, so they all accept and refuse the same shapes.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2:
        raise ValueError(
            f"{what}: MXFP8 needs a 2-D (M, K) tensor, got shape {shape} ({len(shape)}-D); "
            f"reshape to 2-D first (e.g. x.reshape(-1, x.shape[-1]))"
        )
    if block_shape_problem(shape) is not None:
        m, k = shape
        raise ValueError(
            f"{what}: MXFP8 needs M % 32 == 0 and K % 32 == 0 (non-empty), got shape (M, K) = "
            f"{shape}; pad to {_round_up(m), _round_up(k)} or keep this tensor in a non-MXFP8 "
            f"format"
        )
    return shape
