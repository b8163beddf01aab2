"""``benchmarks/bench_train_step.py`` runs end to end on the CPU (one rank, the tiny GPT): the
project's MXFP8 step beside PyTorch FSDP2's, one row each, memory and ratio columns filled."""

from __future__ import annotations

import json

from benchmarks import bench_train_step


def test_the_step_benchmark_runs_ours_beside_fsdp2_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "step.json"
    bench_train_step.main(["--device", "cpu", "--nproc", "1", "--config", "tiny", "--steps", "1",
                           "--warmup", "1", "--runs", "mxfp8,fsdp2", "--out", str(out)])
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"mxfp8", "fsdp2"}
    assert rows["fsdp2"]["ratio_to_fsdp2"] == 1.0 and rows["mxfp8"]["ratio_to_fsdp2"] > 0
    assert (rows["mxfp8"]["peak_torch_gib"], rows["mxfp8"]["peak_jax_gib"]) == (0.0, 0.0)
    assert "| mxfp8 |" in capsys.readouterr().out


def test_an_unknown_gemm_is_refused_by_name(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench_train_step.main(["--gemm", "fp9"])
    assert "fp9" in capsys.readouterr().err
