"""``benchmarks/bench_grad_layout.py`` runs on CPU (a tiny unit) and its in-place layout, the one
the unit programs use, checks its bytes against the concatenation before it reports."""

from __future__ import annotations

import json

from benchmarks import bench_grad_layout


def test_the_layout_benchmark_runs_and_reports_every_variant(tmp_path, capsys):
    out = tmp_path / "layout.json"
    bench_grad_layout.main(["--config", "tiny", "--tokens", "64", "--calls", "1", "--reps", "1",
                            "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report["ms"]) == {"dots", "concat", "concat_only", "dus", "add_donated",
                                 "set_donated", "copy"}
    assert report["hlo"]["concat_only"]["concatenate"] > 0 == report["hlo"]["dus"]["concatenate"]
    assert "layout" in capsys.readouterr().out
