"""``benchmarks/bench_quantize.py --refresh`` on the CPU (interpreted, one small weight): every
tiles variant of the refresh's kernel is timed after a byte check against the default's, and
the module's ``DEFAULT_TILES`` entry is left as it was."""

from __future__ import annotations

import argparse

from benchmarks import bench_quantize
from jax_side.mxfp8 import pallas_impl as pk
from jax_side.mxfp8.pallas_tiles import DEFAULT_TILES, KernelKind, TileKey


def test_the_refresh_sweep_times_each_variant_and_restores_the_default():
    key = TileKey(KernelKind.QUANTIZE, "float32", pk.COMPILED_DEFAULT)
    before = DEFAULT_TILES.get(key)
    args = argparse.Namespace(interpret=True, calls=1, reps=1)
    tiles = bench_quantize.parse_tiles("default,32x64x1pc64")
    rows = bench_quantize.bench_refresh((64, 128), args, tiles)
    assert [r["variant"] for r in rows] == ["refresh[default]", "refresh[32x64x1pc64]",
                                            "copy_f32"]
    assert all(r["us"] > 0 and r["bytes"] == 6 * 64 * 128 for r in rows)
    assert DEFAULT_TILES.get(key) == before
