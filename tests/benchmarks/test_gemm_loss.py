"""``benchmarks/gemm_loss.py``: two runs' loss curves against the stated bound, on metrics files
written with the trainer's own writer."""

from __future__ import annotations

import json

import pytest

from apps.training.metrics import MetricsWriter, eval_record, run_record, step_record
from benchmarks import gemm_loss


def _run(path, losses, *, heldout=None, corpus="markov"):
    with MetricsWriter(path) as w:
        w.write(run_record(corpus=corpus, world_size=1, params=1000))
        for i, loss in enumerate(losses):
            w.write(step_record(step=i, loss=loss, tokens_per_s=1.0, step_s=0.1))
        if heldout is not None:
            w.write(eval_record(step=len(losses) - 1, heldout_loss=heldout))
    return path


def test_the_differences_and_the_bound(tmp_path, capsys):
    a = _run(tmp_path / "exact.jsonl", [5.0, 4.0, 3.0, 2.0], heldout=2.5)
    b = _run(tmp_path / "fast.jsonl", [5.0, 4.005, 2.99, 2.0], heldout=2.52)
    c = _run(tmp_path / "order.jsonl", [5.0, 4.0, 3.001, 2.0])
    out = tmp_path / "cmp.json"
    rc = gemm_loss.main([str(a), str(b), "--control", str(c), "--tail", "2", "--every", "2",
                         "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    pair = result["pair"]
    assert pair["max_abs_diff"] == pytest.approx(0.01) and pair["max_abs_diff_step"] == 2
    assert pair["mean_abs_diff"] == pytest.approx(0.015 / 4)
    assert pair["tail_rel_diff"] == pytest.approx((2.495 - 2.5) / 2.5)
    assert pair["heldout_diff"] == pytest.approx(0.02)
    assert result["control"]["max_abs_diff"] == pytest.approx(0.001)
    text = capsys.readouterr().out
    assert "| 2 | 3.0000 | 2.9900 (-0.0100) | 3.0010 (+0.0010) |" in text
    assert "| 3 |" in text  # the last step is always shown
    assert "within the bound" in text
    # the same pair outside a tighter bound: exit status 1
    assert gemm_loss.main([str(a), str(b), "--max-step-diff", "0.005"]) == 1
    assert "OUTSIDE" in capsys.readouterr().out


def test_a_nan_loss_is_never_within(tmp_path):
    a = _run(tmp_path / "a.jsonl", [5.0, 4.0])
    b = _run(tmp_path / "b.jsonl", [5.0, float("nan")])
    result = gemm_loss.compare(gemm_loss.load(a), gemm_loss.load(b))
    assert not gemm_loss.within(result, 1.0, 1.0)


def test_runs_that_differ_in_more_than_the_gemm_are_refused(tmp_path, capsys):
    a = _run(tmp_path / "a.jsonl", [5.0, 4.0])
    other = _run(tmp_path / "b.jsonl", [5.0, 4.0], corpus="stdlib")
    shorter = _run(tmp_path / "c.jsonl", [5.0])
    for path, words in ((other, "corpus='stdlib'"), (shorter, "same length")):
        with pytest.raises(SystemExit):
            gemm_loss.main([str(a), str(path)])
        assert words in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    with MetricsWriter(empty) as w:
        w.write(run_record(corpus="markov"))
    with pytest.raises(SystemExit):
        gemm_loss.main([str(a), str(empty)])
    assert "no step records" in capsys.readouterr().err
