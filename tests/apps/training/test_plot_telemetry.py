"""``mxfp8-plot --telemetry`` (apps.training.plot_telemetry) on hand-made telemetry records: the
groups are summed weighted by their elements / blocks, histograms of different exponent ranges
line up, the figure has its panels, and files without telemetry or an unknown group are refused
with the reason."""

from __future__ import annotations

import numpy as np
import pytest

from apps.training.metrics import MetricsWriter, run_record, step_record
from apps.training.plot import main
from apps.training.plot_telemetry import build_telemetry_figure, load_telemetry
from torch_side.instruments.numerics_telemetry import Headroom, PlaneTelemetry

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _plane(lo, counts, zero, sub, elements, changed, headroom):
    return PlaneTelemetry({lo + i: c for i, c in enumerate(counts) if c}, 0, sum(counts),
                          changed, zero, sub, elements, headroom).as_record()


def _write(path, telemetry=True):
    with MetricsWriter(path) as w:
        w.write(run_record(world_size=1))
        for s in range(3):
            tel = {
                "a/mxfp8": {p: _plane(-10, [1, 3], s, 0, 64, s, Headroom(4, 0.5, 0.1, 0.9, 0))
                            for p in ("rowwise", "colwise")},
                "b/mxfp8": {p: _plane(-8, [4], 0, 1, 128, 0, None if s == 2 else
                                      Headroom(4, 0.2, 0.1, 0.3, 0))
                            for p in ("rowwise", "colwise")},
            }
            extra = {"telemetry": tel} if telemetry else {}
            w.write(step_record(step=s, loss=1.0, tokens_per_s=1.0, step_s=1.0, **extra))
    return path


def test_groups_are_summed_and_aligned(tmp_path):
    t = load_telemetry(_write(tmp_path / "r.jsonl"))
    assert list(t.step) == [0, 1, 2] and list(t.exponents) == [-10, -9, -8]
    assert t.hist["rowwise"][1].tolist() == [1, 3, 4]
    assert t.zero_share["colwise"].tolist() == [0, 1 / 192, 2 / 192]
    assert t.subnormal_share["rowwise"][0] == 1 / 192
    assert t.changed_share["rowwise"].tolist() == [0, 1 / 8, 2 / 8]
    assert t.headroom_mean["rowwise"].tolist() == pytest.approx([0.35, 0.35, 0.5])
    one = load_telemetry(tmp_path / "r.jsonl", group="b/mxfp8")
    assert list(one.exponents) == [-8] and np.isnan(one.headroom_mean["rowwise"][2])
    fig = build_telemetry_figure(t)
    gids = {a.get_gid() for ax in fig.axes for a in ax.get_children() if a.get_gid()}
    assert gids >= {f"{w}/{p}" for w in ("hist", "zero", "subnormal", "changed", "headroom")
                    for p in ("rowwise", "colwise")}


def test_the_command_line_draws_it_and_refuses_what_it_cannot(tmp_path, capsys):
    path = _write(tmp_path / "r.jsonl")
    out = tmp_path / "t.png"
    assert main([str(path), "--telemetry", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert capsys.readouterr().out.strip() == str(out)
    assert main([str(path), "--telemetry", str(out), "--group", "nope"]) == 1
    assert "no telemetry for group 'nope'; groups: ['a/mxfp8', 'b/mxfp8']" in (
        capsys.readouterr().err)
    plain = _write(tmp_path / "plain.jsonl", telemetry=False)
    assert main([str(plain), "--telemetry", str(out)]) == 1
    assert "no step record carries telemetry; train with --telemetry" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(path)])  # neither -o nor --telemetry
    assert "give -o/--out" in capsys.readouterr().err


def test_malformed_telemetry_and_an_output_directory_are_refused(tmp_path, capsys):
    """A record whose telemetry lacks a field, or an --telemetry OUT that is a directory, was a
    traceback (KeyError; IsADirectoryError after drawing)."""
    path = _write(tmp_path / "r.jsonl")
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace('"scale_exp"', '"scale_exponents"')
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    assert main([str(bad), "--telemetry", str(tmp_path / "t.png")]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: malformed telemetry record (KeyError: 'scale_exp'); expected what" in err, err
    with pytest.raises(SystemExit) as e:
        main([str(path), "--telemetry", str(tmp_path)])
    assert e.value.code == 2
    assert f"--telemetry: {str(tmp_path)!r} is an existing directory" in capsys.readouterr().err
