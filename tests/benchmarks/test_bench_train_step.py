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


def test_a_recompute_run_trains_as_the_plain_run(tmp_path):
    """``mxfp8:u2:r``: the same losses as ``mxfp8:u2``, bit for bit (recompute runs the same
    forward again)."""
    out = tmp_path / "step.json"
    bench_train_step.main(["--device", "cpu", "--nproc", "1", "--config", "tiny", "--steps", "2",
                           "--warmup", "1", "--runs", "mxfp8:u2,mxfp8:u2:r", "--out", str(out)])
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["mxfp8:u2:r"]["losses"] == rows["mxfp8:u2"]["losses"]


def test_the_recompute_suffix_reaches_the_models_units(single_rank_world):
    """The run's model has every block's unit forward in recompute mode (what ``:r`` asks for),
    and the plain run's none."""
    import argparse

    from bridge.units import UnitForward
    from common.model_config import PRESETS

    args = argparse.Namespace(device="cpu", gemm="")
    for run, want in (("mxfp8:u2:r", True), ("mxfp8:u2", False)):
        model = bench_train_step._build(run, PRESETS["tiny"], args)[0]
        units = [m.forward for m in model.modules() if isinstance(m.forward, UnitForward)]
        assert units and all(u.recompute is want for u in units), run


def test_recompute_on_a_peer_run_is_refused_by_name(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench_train_step.main(["--runs", "fsdp2:r"])
    assert "fsdp2" in capsys.readouterr().err
