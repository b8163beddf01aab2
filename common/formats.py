"""Formats of model weights and the MXFP8 layout facts, in one table (DESIGN.md 3-5).

- ``BLOCK_SIZE`` (32), ``E4M3_MAX`` (448), ``E8M0_BIAS`` (127): the MXFP8 constants, defined once;
  ``MXFP8_BLOCKS`` is MXFP8's ``ScaleBlocks`` built from them.
- ``Plane``: which quantized copy of a 2-D (M, K) tensor -- ``ROWWISE`` (blocks along K) or
  ``COLWISE`` (blocks along M, data *not transposed*). A high-precision weight has one plane,
  ``ROWWISE``: the weights themselves.
- ``WeightFormat``: the built-in formats of the model weights forward and backward read, with
  ``FORMATS`` mapping each one to a ``FormatSpec``: the model weight buffer's dtype, the
  high-precision dtype the weight is made from, the planes it consists of (forward reads the
  first, backward the last) and, for block-scaled formats, ``ScaleBlocks``: the per-format object
  every layer asks instead of assuming MXFP8 -- element and scale dtypes, block size and block
  shape per plane, scale shape per plane, elements per byte, an optional tensor-level scale,
  element max. Code asks the table; nothing branches on a derived boolean. ``NVFP4`` is
  described completely (4-bit elements, two per byte, E4M3 block scales and an fp32 tensor
  scale) so that the table shows the room left for it, but no layer implements it: each layer
  refuses it (and any format missing from its own table) with a clear error.
- ``register_format``: a format added at run time (a ``RegisteredFormat`` key and its row of
  ``FORMATS``) -- how a new format plugs in without editing this file (docs/extending.md, "A
  weight format"). Everything that takes a format takes a ``FormatKey``: a ``WeightFormat``
  member or a ``RegisteredFormat``.

Dtypes are named by strings (``"bfloat16"``, ``"uint8"``, ``"float8_e4m3fn"``) so this module
stays framework-free; each layer maps names to its own dtype objects.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from common.enums import Parseable

__all__ = [
    "BLOCK_SIZE",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_INF",
    "E8M0_NAN",
    "FORMATS",
    "MXFP8_BLOCKS",
    "FormatKey",
    "FormatSpec",
    "ALL_PLANES",
    "Plane",
    "PlaneData",
    "PlaneFields",
    "RegisteredFormat",
    "ScaleBlocks",
    "BlockScaledParams",
    "WeightFormat",
    "block_padded",
    "block_scaled_params",
    "block_shape_problem",
    "check_mxfp8_shape",
    "format_spec",
    "parse_format",
    "parse_planes",
    "register_format",
    "round_up",
    "scale_shape",
]

BLOCK_SIZE = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_INF = 0xFE


class Plane(Parseable, enum.Enum, what="MXFP8 plane", aliases={"columnwise": "colwise"}):
    """Which quantized copy of a tensor: blocks along K (rowwise) or along M (columnwise)."""

    ROWWISE = "rowwise"
    COLWISE = "colwise"


ALL_PLANES = (Plane.ROWWISE, Plane.COLWISE)


class PlaneData(NamedTuple):
    """One quantized plane: ``data`` (M, K) elements and its compact ``scale`` (framework arrays;
    which shapes: ``scale_shape``). The tensor classes hold ``{Plane: PlaneData}``."""

    data: Any
    scale: Any


class PlaneFields:
    """Read-only conveniences of the tensor classes that hold ``planes: {Plane: PlaneData}``:
    ``rowwise_data`` ... ``colwise_scale``, None when the plane is absent."""

    planes: Mapping[Plane, PlaneData]

    def _field(self, plane: Plane, i: int) -> Any:
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


class WeightFormat(Parseable, enum.Enum, what="weight format"):
    """Format of the model weights that forward and backward read."""

    FP32 = "fp32"
    BF16 = "bf16"
    MXFP8_E4M3 = "mxfp8_e4m3"
    NVFP4 = "nvfp4"  # described in FORMATS; not implemented by any layer yet
    # formats of one's own: common.formats.register_format (a RegisteredFormat key)


_FORMAT_VALUE = re.compile(r"[a-z0-9_]+")  # a format's value names groups (param_group)


@dataclasses.dataclass(frozen=True)
class ScaleBlocks:
    """Facts of a block-scaled format: what one plane of a logical (M, K) tensor holds.

    Data: ``data_shape(shape)`` bytes, (M, K / elements_per_byte), row-major and not transposed
    in either plane. Scales: one ``scale_dtype`` value per block of ``block_size`` consecutive
    elements along the plane's blocked axis (``block_shape``: rowwise 1 x b along K, columnwise
    b x 1 along M), compact, ``scale_shape(shape, plane)``: rowwise (M, K/b), columnwise
    (M/b, K). ``tensor_scale_dtype``: a second-level scale per tensor that multiplies every block
    scale (NVFP4's fp32 scale), or None.
    """

    element_dtype: str  # e.g. "float8_e4m3fn"
    scale_dtype: str  # e.g. "float8_e8m0fnu"
    block_size: int  # elements per scale, along the blocked axis of each plane
    element_max: float  # largest finite element magnitude
    elements_per_byte: int = 1  # 2 for 4-bit elements packed two per byte
    tensor_scale_dtype: str | None = None  # a per-tensor second-level scale, if any

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.elements_per_byte not in (1, 2) or (
            self.block_size % self.elements_per_byte
        ):
            raise ValueError(
                f"ScaleBlocks: block_size={self.block_size}, elements_per_byte="
                f"{self.elements_per_byte}: expected a positive block size and 1 or 2 elements "
                f"per byte that divide it"
            )

    def block_shape(self, plane: Plane) -> tuple[int, int]:
        """(rows, columns) of one block of ``plane``: (1, b) rowwise, (b, 1) columnwise."""
        b = self.block_size
        return (1, b) if plane is Plane.ROWWISE else (b, 1)

    def scale_shape(self, shape: tuple[int, int], plane: Plane) -> tuple[int, int]:
        """Compact scale shape of ``plane`` of a logical (M, K) tensor."""
        (m, k), (bm, bk) = shape, self.block_shape(plane)
        return (m // bm, k // bk)

    def scale_numel(self, shape: tuple[int, int]) -> int:
        """Scales per plane (M * K / block_size; the same for both planes)."""
        return shape[0] * shape[1] // self.block_size

    def data_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """Byte shape of one plane's data: (M, K / elements_per_byte)."""
        return (shape[0], shape[1] // self.elements_per_byte)

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a tensor of ``shape`` cannot take this format, or None if it can."""
        return block_shape_problem(shape, self.block_size)


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
        return self.blocks.shape_problem(shape)


@dataclasses.dataclass(frozen=True)
class RegisteredFormat:
    """A weight format added at run time by ``register_format``, beside the built-in
    ``WeightFormat`` members; ``value`` names it as a member's value does (group labels,
    checkpoint metadata, errors)."""

    value: str

    @property
    def name(self) -> str:
        return self.value.upper()


FormatKey = WeightFormat | RegisteredFormat  # what every layer takes as "a format"

MXFP8_BLOCKS = ScaleBlocks("float8_e4m3fn", "float8_e8m0fnu", BLOCK_SIZE, E4M3_MAX)


FORMATS: dict[FormatKey, FormatSpec] = {
    WeightFormat.FP32: FormatSpec("float32", "float32", (Plane.ROWWISE,), None),
    WeightFormat.BF16: FormatSpec("bfloat16", "bfloat16", (Plane.ROWWISE,), None),
    WeightFormat.MXFP8_E4M3: FormatSpec("uint8", "bfloat16", ALL_PLANES, MXFP8_BLOCKS),
    WeightFormat.NVFP4: FormatSpec("uint8", "bfloat16", ALL_PLANES, ScaleBlocks(
        "float4_e2m1fn", "float8_e4m3fn", 16, 6.0, elements_per_byte=2,
        tensor_scale_dtype="float32",
    )),
}


def register_format(value: str, spec: FormatSpec) -> RegisteredFormat:
    """Add a format to ``FORMATS`` under a new key named ``value`` and return the key.

    Registering the same value with an equal row again returns the same key (a module that
    registers at import may be imported by several processes or twice); another row under a
    taken value, or a built-in format's value, is refused. The format's implementations are
    separate tables of each layer (e.g. ``torch_side.fsdp.weight_codecs.CODECS``); removing the row
    (``del FORMATS[key]``) unregisters it.
    """
    if not isinstance(value, str) or not _FORMAT_VALUE.fullmatch(value):
        raise ValueError(
            f"register_format: value {value!r} must be lower-case letters, digits and '_' "
            f"(it names parameter groups and checkpoint entries), e.g. 'mxfp8_b16'"
        )
    if not isinstance(spec, FormatSpec):
        raise TypeError(f"register_format({value!r}): expected a FormatSpec, got {spec!r}")
    key = RegisteredFormat(value)
    taken = {f.value: f for f in FORMATS}
    if value in taken and (taken[value] != key or FORMATS[key] != spec):
        raise ValueError(
            f"register_format: {value!r} is already the format {taken[value]!r} with row "
            f"{FORMATS[taken[value]]}; choose another value"
        )
    FORMATS[key] = spec
    return key


def parse_format(fmt: FormatKey | str) -> FormatKey:
    """The ``FORMATS`` key of a format: a key itself, or its value (case-insensitive)."""
    if isinstance(fmt, FormatKey) and fmt in FORMATS:
        return fmt
    value = fmt.value if isinstance(fmt, FormatKey) else str(fmt).lower()
    for key in FORMATS:
        if key.value == value:
            return key
    raise ValueError(
        f"unknown weight format {fmt!r}: expected one of {[f.value for f in FORMATS]} (a format "
        f"of one's own is added by common.formats.register_format)"
    )


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


def block_scaled_params(module: object) -> tuple[str, ...]:
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


def format_spec(fmt: FormatKey | str) -> FormatSpec:
    """The table row of a format (accepts a key or its value)."""
    return FORMATS[parse_format(fmt)]


def scale_shape(
    shape: tuple[int, int], plane: Plane, blocks: ScaleBlocks = MXFP8_BLOCKS
) -> tuple[int, int]:
    """Compact scale shape of one plane of a logical (M, K) tensor in the format of ``blocks``
    (``ScaleBlocks.scale_shape``); MXFP8 by default (DESIGN.md 4): rowwise (M, K/32),
    columnwise (M/32, K)."""
    m, k = shape
    return blocks.scale_shape((m, k), plane)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (> 0) that is >= ``n`` (an int >= 0)."""
    return -(-n // multiple) * multiple


def block_padded(n: int, block: int = BLOCK_SIZE) -> int:
    """``n`` rounded up to whole blocks, at least one: the size a dimension is padded to (tokens,
    ``jax_side.linear.padded_tokens``) or that an error suggests for a weight's dimension."""
    return max(block, round_up(n, block))


def block_shape_problem(shape: Sequence[int], block: int = BLOCK_SIZE) -> str | None:
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


def check_mxfp8_shape(shape: Iterable[int], what: str) -> tuple[int, int]:
    """(M, K) of a valid MXFP8 tensor shape, else a ValueError naming ``what`` and the fix.

    Every layer (JAX and Torch tensor classes, quantize, the linear op, distributed quantize)
    checks MXFP8 shapes through this function, so they all accept and refuse the same shapes.
    """
    dims = tuple(int(d) for d in shape)
    if len(dims) != 2:
        raise ValueError(
            f"{what}: MXFP8 needs a 2-D (M, K) tensor, got shape {dims} ({len(dims)}-D); "
            f"reshape to 2-D first (e.g. x.reshape(-1, x.shape[-1]))"
        )
    m, k = dims
    if block_shape_problem(dims) is not None:
        raise ValueError(
            f"{what}: MXFP8 needs M % 32 == 0 and K % 32 == 0 (non-empty), got shape (M, K) = "
            f"{dims}; pad to {block_padded(m), block_padded(k)} or keep this tensor in a "
            f"non-MXFP8 format"
        )
    return (m, k)
