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
    names = ["quantize", "planes_fwd", "planes_bwd", "tiles_t[128x128,w4]"]
    names += [f"rows[{r}x128,w4]" for r in (32, 64, 128)]
    names += [f"rows_t[128x{c},w4]" for c in (32, 64, 128)]
    names += [f"rows_t[128x{c},w4,whole]" for c in (32, 64, 128)] + ["tiles_t[128x128,w4,whole]"]
    names += ["rows+rows_t[128x128,w4]", "rows+tiles_t[128x128,w4]"]
    for name in names:
        assert row[f"{name}_us"] > 0 and row[f"{name}_gbs"] > 0, name
    assert not [k for k in row if k.endswith("_error")], row


def test_a_timed_run_needs_a_gpu(capsys):
    import jax

    if jax.devices()[0].platform == "gpu":
        pytest.skip("CPU-only behaviour (on a GPU this is the whole benchmark)")
    with pytest.raises(SystemExit):
        bench_blocked_operands.main([])
    assert "no GPU" in capsys.readouterr().err
