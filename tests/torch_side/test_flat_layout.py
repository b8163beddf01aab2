"""Flat layout: aligned slots, rows kept whole, even shards, every element owned once."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torch_side import FlatLayout, LayoutError, check_layout
from torch_side.flat_layout import ALIGN_ELEMENTS

shapes_st = st.lists(
    st.one_of(
        st.tuples(st.integers(1, 96)),
        st.tuples(st.integers(1, 40), st.integers(1, 48)),
        st.tuples(st.sampled_from([32, 64, 96]), st.sampled_from([32, 64, 160])),
    ),
    min_size=1,
    max_size=6,
)


@given(shapes=shapes_st, world=st.integers(1, 5))
def test_layout_invariants_hold_for_random_groups(shapes, world):
    layout = FlatLayout.build([f"p{i}" for i in range(len(shapes))], shapes, world)
    check_layout(layout)
    assert layout.padded_numel % world == 0
    for s in layout.slots:
        assert s.start % ALIGN_ELEMENTS == 0  # >= 256 bytes for uint8, bf16 and fp32 buffers
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        for p in layout.owned(rank):
            row = layout.slots[p.slot_index].row_size
            assert p.param_offset % row == 0 and p.numel % row == 0  # rows whole
            assert 0 <= p.shard_offset and p.shard_offset + p.numel <= hi - lo


def test_a_rank_can_own_part_of_a_parameter_or_nothing():
    layout = FlatLayout.build(["w", "b"], [(96, 64), (64,)], world_size=4)
    # unit 256; 6208 elements -> shards of 1792: ranks 0-2 own parts of "w", rank 3 the rest + "b"
    owned = [[(p.slot_index, p.param_offset, p.numel) for p in layout.owned(r)] for r in range(4)]
    assert owned == [
        [(0, 0, 1792)],
        [(0, 1792, 1792)],
        [(0, 3584, 1792)],
        [(0, 5376, 768), (1, 0, 64)],
    ]
    big = FlatLayout.build(["b"], [(8,)], world_size=4)
    assert [len(big.owned(r)) for r in range(4)] == [1, 0, 0, 0]  # ranks 1-3 own nothing


def test_checker_rejects_overlap_and_split_rows():
    layout = FlatLayout.build(["a", "b"], [(32, 32), (32, 32)], world_size=2)
    a, b = layout.slots
    overlapping = dataclasses.replace(layout, slots=(a, dataclasses.replace(b, start=a.start)))
    with pytest.raises(LayoutError, match="overlaps"):
        check_layout(overlapping)
    split = dataclasses.replace(layout, unit=32, shard_numel=(a.numel + 32) // 2)
    with pytest.raises(LayoutError):
        check_layout(split)


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        FlatLayout.build(["a"], [(4,)], world_size=0)
