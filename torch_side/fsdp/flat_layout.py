"""Flat layout of one parameter group, its even DP shards, and the layout checker (DESIGN.md 5).

Every buffer of a group (rowwise / columnwise MXFP8 bytes, bf16/fp32 model weights, fp32 main
weights, main grads) shares ONE element-index layout:

- parameters are laid out in order, each starting at a multiple of the *unit*
  ``U = lcm(256, row sizes)`` elements (row size = prod(shape[1:]), 1 for 1-D parameters). A start
  at a multiple of 256 elements is a multiple of 256 bytes in every buffer dtype, so each
  per-parameter plane can be shared with JAX zero-copy;
- the group is padded to ``world_size * shard_numel`` with ``shard_numel`` a multiple of ``U``,
  and rank r owns the flat slice ``[r * shard_numel, (r + 1) * shard_numel)``. Shard boundaries are
  then multiples of every row size relative to every parameter start, so *shards keep rows whole*;
  a rank may own part of a parameter, several parameters, or none.

Padding elements belong to no parameter; they are zero in every buffer and never quantized.

**Block-atomic shards** (``ShardLayout.BLOCK_ATOMIC``, chosen per model by
``MixedPrecisionPolicy.shard_layout``): for a block-scaled group the unit becomes
``32 x lcm(256, row sizes)`` (``row_block`` = the format's block size), so every shard boundary
falls on a multiple of 32 rows of every parameter: each MXFP8 scale block -- a rowwise 1x32 block
and a columnwise 32x1 block -- is owned by one rank, and its scale travels with its rows
(upstream Megatron-FSDP v2's MXFP8 shards): the group's scale buffers are laid out like the
group divided by 32 (parameter i's scales at ``slot.start / 32``, 256-aligned), so rank r's
scales of both planes are the slice ``[r * shard / 32, (r + 1) * shard / 32)`` and the
distributed quantization all-gathers those uint8 slices instead of all-reducing the fp32 amax
(``weight_codecs.BlockScaledCodec``). The default ``ShardLayout.LCM`` keeps rows whole only (a
columnwise block may span two ranks; the amax reduction makes the bytes the same either way).
The trade-off is padding: the block-atomic unit is 32x larger, which costs more at large world
sizes (``benchmarks/layout_padding.py``).
Parameter offsets do not depend on the layout, so checkpoints (keyed by offsets within each
parameter) load into either layout at any world size.

Padding overhead: ``padding_ratio`` = buffer elements / parameter elements. Row sizes that
share few factors with 256 and with each other (conv kernels ``in * kh * kw`` = 147, 576, ...)
make ``U`` large, and the layout can then be mostly padding (ResNet-18 as one unit: 2.05x; the
first conv of a small CNN as its own unit: 30x; GPT-style models: <= 1.06x; measured in
docs/fsdp.md with ``benchmarks/layout_padding.py``). ``check_layout`` returns the numbers
(:class:`LayoutStats`) and warns (:class:`LayoutPaddingWarning`) when a group pads more than
``PADDING_WARN_RATIO`` times and by at least ``PADDING_WARN_MIN_ELEMENTS`` elements: the
256-element alignment alone gives small groups of 1-D parameters a large ratio but only a few
KiB of padding, which is not worth a warning.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from common.enums import Parseable
from common.formats import round_up

__all__ = [
    "ALIGN_ELEMENTS",
    "PADDING_WARN_MIN_ELEMENTS",
    "PADDING_WARN_RATIO",
    "FlatLayout",
    "LayoutError",
    "LayoutPaddingWarning",
    "LayoutStats",
    "OwnedPiece",
    "ParamSlot",
    "ShardLayout",
    "check_layout",
]

ALIGN_ELEMENTS = 256  # >= 256 bytes for every element size >= 1 byte


class ShardLayout(Parseable, enum.Enum, what="shard layout"):
    """Where a block-scaled group's shard boundaries may fall (module note)."""

    LCM = "lcm"  # rows whole: unit lcm(256, row sizes)
    BLOCK_ATOMIC = "block_atomic"  # whole 32-row scale blocks: unit lcm(256, 32 x row sizes)
PADDING_WARN_RATIO = 1.25  # buffer elements / parameter elements above which check_layout warns
PADDING_WARN_MIN_ELEMENTS = 1 << 20  # ... when the padding is at least this many elements


class LayoutError(ValueError):
    """A flat layout that breaks an invariant (overlap, gap in ownership, split row)."""


class LayoutPaddingWarning(UserWarning):
    """A group's flat layout is mostly padding (see the module note)."""


class LayoutStats(NamedTuple):
    """What a layout costs: elements of the parameters vs of every buffer of the group."""

    real_numel: int  # elements of the parameters
    padded_numel: int  # elements of each buffer of the group (world_size * shard_numel)
    unit: int  # U = lcm(256, row sizes): every parameter start and the shard size are multiples

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - self.real_numel

    @property
    def padding_ratio(self) -> float:
        """Buffer elements per parameter element (1.0 means no padding)."""
        return self.padded_numel / self.real_numel if self.real_numel else 1.0


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the group's flat index space."""

    name: str
    shape: tuple[int, ...]
    start: int  # first flat element (a multiple of the layout unit)
    numel: int

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(M, K) of a 2-D parameter (block-scaled ones are)."""
        m, k = self.shape
        return (m, k)

    @property
    def row_size(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1


class OwnedPiece(NamedTuple):
    """The part of one parameter that a rank owns."""

    slot_index: int
    param_offset: int  # first owned element, in the parameter's own flat row-major order
    shard_offset: int  # where it sits inside the rank's shard
    numel: int


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Layout of a group: slots in order, the unit, and the even shard size; see module note."""

    slots: tuple[ParamSlot, ...]
    unit: int
    shard_numel: int
    world_size: int
    row_block: int = 1  # rows no shard boundary splits (32: block-atomic MXFP8 shards)

    @classmethod
    def build(cls, names: Sequence[str], shapes: Iterable[Iterable[int]],
              world_size: int, row_block: int = 1) -> FlatLayout:
        """row_block: rows that no shard boundary may split (32 for block-atomic MXFP8 shards;
        1: rows whole)."""
        if world_size < 1:
            raise ValueError(f"FlatLayout: world_size must be >= 1, got {world_size}")
        if isinstance(row_block, bool) or not isinstance(row_block, int) or row_block < 1:
            raise ValueError(f"FlatLayout: row_block must be an int >= 1, got {row_block!r}")
        dims = [tuple(int(d) for d in s) for s in shapes]
        rows = [math.prod(s[1:]) if len(s) > 1 else 1 for s in dims]
        # row_block > 1: also every parameter's scales (one per row_block elements) start at a
        # multiple of 256 in a scale buffer laid out like the group / row_block
        unit = row_block * math.lcm(ALIGN_ELEMENTS, *[r for r in rows if r > 0])
        slots, cursor = [], 0
        for name, shape in zip(names, dims, strict=True):
            start = round_up(cursor, unit)
            slots.append(ParamSlot(name, shape, start, math.prod(shape)))
            cursor = start + math.prod(shape)
        shard = max(unit, round_up(cursor, world_size * unit) // world_size)  # >= 1 unit
        return cls(tuple(slots), unit, shard, world_size, row_block)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def real_numel(self) -> int:
        """Elements of the parameters (the rest of ``padded_numel`` is padding)."""
        return sum(s.numel for s in self.slots)

    @property
    def padding_ratio(self) -> float:
        """``padded_numel / real_numel``: buffer elements per parameter element."""
        return self.stats.padding_ratio

    @property
    def stats(self) -> LayoutStats:
        return LayoutStats(self.real_numel, self.padded_numel, self.unit)

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def owned(self, rank: int) -> list[OwnedPiece]:
        """Pieces of parameters inside rank's shard, in slot order (empty pieces left out)."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, s in enumerate(self.slots):
            a, b = max(lo, s.start), min(hi, s.end)
            if a < b:
                out.append(OwnedPiece(i, a - s.start, a - lo, b - a))
        return out


def check_layout(layout: FlatLayout, label: str = "") -> LayoutStats:
    """Raise :class:`LayoutError` unless: slots are aligned and disjoint, inside the padded
    buffer; every element of every parameter is owned by exactly one rank; no shard splits a row
    (with ``row_block`` > 1: a block of that many rows; a parameter's last block may be short).

    Returns the layout's :class:`LayoutStats`, and warns (:class:`LayoutPaddingWarning`, naming
    ``label``, the group) when the buffers are mostly padding (module note).
    """
    prev_end = 0
    for s in layout.slots:
        if s.start % layout.unit or s.start % ALIGN_ELEMENTS:
            raise LayoutError(f"slot {s.name!r} starts at {s.start}, not a multiple of the unit")
        if s.start < prev_end:
            raise LayoutError(f"slot {s.name!r} [{s.start}, {s.end}) overlaps the previous slot")
        prev_end = s.end
    if prev_end > layout.padded_numel or layout.shard_numel % layout.unit:
        raise LayoutError(
            f"padded size {layout.padded_numel} (shard {layout.shard_numel}) does not hold the "
            f"{prev_end} laid-out elements in unit multiples of {layout.unit}"
        )
    _check_ownership(layout)
    stats = layout.stats
    if (
        stats.padding_ratio > PADDING_WARN_RATIO
        and stats.padding_numel >= PADDING_WARN_MIN_ELEMENTS
    ):
        rows = sorted({s.row_size for s in layout.slots})
        warnings.warn(
            LayoutPaddingWarning(
                f"flat layout of group {label or '<unnamed>'!r}: its buffers hold "
                f"{stats.padded_numel} elements for {stats.real_numel} parameter elements "
                f"({stats.padding_ratio:.2f}x, {stats.padding_numel} padding elements in every "
                f"buffer of the group) at world size {layout.world_size}. The layout unit "
                f"U = lcm(256, row sizes {rows}) = {stats.unit} sets every parameter start and "
                f"the shard size. Give the parameters whose row size (prod(shape[1:])) shares "
                f"few factors with 256 and with the others units of their own (fewer row sizes "
                f"per group), or use row sizes that divide 256 or a common multiple"
            ),
            stacklevel=2,
        )
    return stats


def _check_ownership(layout: FlatLayout) -> None:
    """Every element owned by exactly one rank, no piece splitting a row (or a row block)."""
    owned = [0] * len(layout.slots)
    for rank in range(layout.world_size):
        for p in layout.owned(rank):
            s = layout.slots[p.slot_index]
            if p.param_offset != owned[p.slot_index]:
                raise LayoutError(
                    f"rank {rank} owns {s.name!r} from element {p.param_offset}, but elements "
                    f"[0, {owned[p.slot_index]}) are already owned: overlap or gap"
                )
            block = s.row_size * layout.row_block
            if p.param_offset % block or (p.numel % block
                                          and p.param_offset + p.numel < s.numel):
                what = (f"a row of {s.row_size} elements" if layout.row_block == 1 else
                        f"a block of {layout.row_block} rows of {s.row_size} elements")
                raise LayoutError(
                    f"rank {rank}'s piece of {s.name!r} [{p.param_offset}, "
                    f"{p.param_offset + p.numel}) splits {what}"
                )
            owned[p.slot_index] += p.numel
    for s, n in zip(layout.slots, owned, strict=True):
        if n != s.numel:
            raise LayoutError(f"{s.name!r}: {n} of {s.numel} elements owned by some rank")
