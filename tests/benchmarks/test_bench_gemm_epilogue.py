"""``benchmarks/bench_gemm_epilogue.py`` runs on the CPU in its smoke mode (one small shape, the
reference path: the exact dot, then the epilogue's reference, so every number is exact) and
refuses a timed run without a GPU."""

from __future__ import annotations

import json

import jax
import pytest

from benchmarks import bench_gemm_epilogue


def test_the_smoke_run_checks_the_numbers(tmp_path):
    out = tmp_path / "epilogue.json"
    assert bench_gemm_epilogue.main(["--smoke", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["shape"] == [128, 256, 256] and row["aux_equal"]
    assert row["gelu_max_ulps"] == row["aux_vs_reference_max_ulps"] == 0.0
    assert 0 < row["gelu_vs_unfused_differ"] < 0.5  # the accumulator's rounding before the GELU
    assert not any(k.endswith("_ms") for k in row)


def test_a_timed_run_needs_a_gpu(capsys):
    if jax.devices()[0].platform == "gpu":
        pytest.skip("CPU-only behaviour (on a GPU this is the whole benchmark)")
    with pytest.raises(SystemExit):
        bench_gemm_epilogue.main([])
    assert "no GPU" in capsys.readouterr().err
