"""``benchmarks/bench_blocked_operands.py`` runs on the CPU in its smoke mode (one small shape,
the kernel interpreted) and refuses a timed run without a GPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_blocked_operands


def test_the_smoke_run_times_every_variant(tmp_path):
    out = tmp_path / "blocked.json"
    assert bench_blocked_operands.main(["--smoke", "--warps", "4", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["shape"] == [128, 256]
    for name in ("quantize", "planes_fwd", "planes_bwd", "fused_fwd[4]", "fused_bwd[4]",
                 "fused_rows[4]", "fused_tiles_t[4]"):
        assert row[f"{name}_us"] > 0 and row[f"{name}_gbs"] > 0, name


def test_a_timed_run_needs_a_gpu(capsys):
    import jax

    if jax.devices()[0].platform == "gpu":
        pytest.skip("CPU-only behaviour (on a GPU this is the whole benchmark)")
    with pytest.raises(SystemExit):
        bench_blocked_operands.main([])
    assert "no GPU" in capsys.readouterr().err
