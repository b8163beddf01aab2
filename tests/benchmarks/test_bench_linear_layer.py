"""``benchmarks/bench_linear_layer.py`` runs on the CPU in its smoke mode (one tiny layer, every
run) and refuses a timed run without a GPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_linear_layer


def test_the_smoke_run_times_every_path(tmp_path):
    out = tmp_path / "linear.json"
    assert bench_linear_layer.main(["--smoke", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["layers"]
    assert row["shape"] == [128, 128, 256]
    for run in bench_linear_layer.RUNS:
        assert row[f"{run}_fwd_ms"] > 0 and row[f"{run}_bwd_ms"] > 0
        assert row[f"{run}_vs_bf16"] == pytest.approx(row["bf16_ms"] / row[f"{run}_ms"])


def test_a_timed_run_needs_a_gpu(capsys):
    import jax

    if jax.devices()[0].platform == "gpu":
        pytest.skip("CPU-only behaviour (on a GPU this is the whole benchmark)")
    with pytest.raises(SystemExit):
        bench_linear_layer.main([])
    assert "no GPU" in capsys.readouterr().err
