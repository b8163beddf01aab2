"""``benchmarks/layout_padding.py``: the shard-layout table (issue 34) compares what FSDP builds."""

from __future__ import annotations

from benchmarks import layout_padding as lp
from torch_side import FlatLayout


def test_block_atomic_pads_at_least_as_much_and_the_table_shows_both():
    for model in lp.LAYOUT_MODELS.values():
        for w in lp.LAYOUT_WORLD_SIZES:
            lcm, atomic = lp.mxfp8_padding(model, w, 1), lp.mxfp8_padding(model, w, 32)
            assert 1.0 <= lcm <= atomic, (w, lcm, atomic)
    table = lp.layout_table().splitlines()
    assert len(table) == 2 + len(lp.LAYOUT_MODELS)
    assert table[2].startswith("| GPT-2 124M | 1.000 / 1.000 |")


def test_the_table_uses_the_layouts_fsdp_builds():
    model = lp.LAYOUT_MODELS["GPT-2 124M"]
    (label, layout), = [(n, lay) for n, lay in lp.layouts(model, 64, 32) if n == "h_0/mxfp8"]
    params = model["h_0"]["mxfp8"]
    built = FlatLayout.build([n for n, _ in params], [s for _, s in params], 64, row_block=32)
    assert (layout.unit, layout.shard_numel) == (built.unit, built.shard_numel)
    assert layout.unit == 32 * 3072  # lcm(256, 32 x 768, 32 x 3072)
