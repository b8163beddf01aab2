"""Flat layout: aligned slots, rows kept whole, even shards, every element owned once."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torch_side import FlatLayout, LayoutError, LayoutPaddingWarning, LayoutStats, check_layout
from torch_side.fsdp.flat_layout import (
    ALIGN_ELEMENTS,
    PADDING_WARN_MIN_ELEMENTS,
    PADDING_WARN_RATIO,
)

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
    with warnings.catch_warnings(record=True) as seen:  # odd random rows: padding can be huge
        warnings.simplefilter("always")
        stats = check_layout(layout, "random")
    warned = stats.padding_ratio > PADDING_WARN_RATIO and (
        stats.padding_numel >= PADDING_WARN_MIN_ELEMENTS
    )
    assert [w.category for w in seen] == ([LayoutPaddingWarning] if warned else [])
    assert stats.real_numel == sum(math.prod(sh) for sh in shapes)
    assert stats.padded_numel == layout.padded_numel >= stats.real_numel
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


# Padding overhead (module note of torch_side.fsdp.flat_layout; numbers in docs/fsdp.md).
RESNET_ROOT = [(64, 3, 7, 7), (64,), (64,), (1000, 512), (1000,)]  # conv1 + bn1 + fc: rows 147, 512
LAYER4 = [(512, 256, 3, 3), (512,), (512,), (512, 512, 3, 3), (512,), (512,), (512, 256, 1, 1)]


def _layout(shapes, world=2):
    return FlatLayout.build([f"p{i}" for i in range(len(shapes))], shapes, world)


def test_padding_ratio_is_buffer_elements_per_parameter_element():
    gpt_block = _layout([(192, 64), (64, 64), (256, 64), (64, 256)])  # rows 64 / 256: U = 256
    assert gpt_block.unit == 256 and gpt_block.padding_ratio == 1.0
    root = _layout(RESNET_ROOT)
    u = math.lcm(256, 147, 512)
    assert root.unit == u == 75264
    assert root.real_numel == 64 * 147 + 64 + 64 + 512_000 + 1000
    # starts 0, U, 2U, 3U (fc: 512000 elements, to 9.8 U), 10 U; 10 U + 1000 -> 2 shards of 6 U
    assert [s.start for s in root.slots] == [0, u, 2 * u, 3 * u, 10 * u]
    assert root.padded_numel == 2 * 6 * u
    assert root.padding_ratio == pytest.approx(1.728, abs=1e-3)
    # 1.7x but 0.38 M padding elements: no warning (pytest turns warnings into errors)
    stats = check_layout(root, "<root>/fp32")
    assert stats == LayoutStats(root.real_numel, root.padded_numel, u) == root.stats


def test_a_group_that_is_mostly_padding_warns_naming_it_and_the_fix():
    """ResNet-18's stem and last stage in one group: rows 147, 2304, 4608, 256, 512 give
    U = 2^9 * 3^2 * 7^2 = 225792 and 1.6x the parameter elements (2.6 M padding elements)."""
    layout = _layout(RESNET_ROOT + LAYER4)
    with pytest.warns(LayoutPaddingWarning) as seen:
        stats = check_layout(layout, "<root>/fp32")
    assert stats.padding_ratio > PADDING_WARN_RATIO
    assert stats.padding_numel >= PADDING_WARN_MIN_ELEMENTS
    text = str(seen[0].message)
    assert "group '<root>/fp32'" in text and f"({stats.padding_ratio:.2f}x" in text, text
    assert f"U = lcm(256, row sizes [1, 147, 256, 512, 2304, 4608]) = {layout.unit}" in text
    assert "units of their own" in text


def test_small_groups_pad_a_lot_relatively_but_do_not_warn():
    """Three 1-D parameters of 64 elements take 256 each: 4x, but a few KiB."""
    layout = _layout([(64,), (64,), (96,)])
    assert layout.padding_ratio > 3
    check_layout(layout, "h_0/fp32")  # no warning (pytest turns warnings into errors)
