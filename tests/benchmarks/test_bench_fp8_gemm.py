"""``benchmarks/bench_fp8_gemm.py`` runs on the CPU in its smoke mode (one tiny GEMM, the Pallas
kernel interpreted) and refuses a timed run without a GPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_fp8_gemm


def test_the_smoke_run_times_bf16_and_the_kernel(tmp_path):
    out = tmp_path / "fp8.json"
    assert bench_fp8_gemm.main(["--smoke", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["gemm"]
    assert row["shape"] == [128, 128, 128]
    assert row["bf16_ms"] > 0 and row["kernel[128,128,8,3]_ms"] > 0


def test_a_timed_run_needs_a_gpu(capsys):
    import jax

    if jax.devices()[0].platform == "gpu":
        pytest.skip("CPU-only behaviour (on a GPU this is the whole benchmark)")
    with pytest.raises(SystemExit):
        bench_fp8_gemm.main([])
    assert "no GPU" in capsys.readouterr().err
