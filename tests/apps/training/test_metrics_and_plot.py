"""JSONL metrics (exact floats, null for non-finite, clear errors) and the loss-curve plot
(apps/training/metrics.py, apps/training/plot.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from apps.training.metrics import (
    MetricsWriter,
    eval_record,
    evals,
    read_metrics,
    run_record,
    runs,
    step_record,
    steps,
)
from apps.training.plot import build_figure, load_run, main, plot_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO_ROOT = Path(__file__).resolve().parents[3]

# --- metrics ----------------------------------------------------------------------------------


def _random_floats(n: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 and float32 (n,) over many magnitudes, with random bit patterns, all finite."""
    rng = np.random.default_rng(0)
    f64 = rng.standard_normal(n) * 10.0 ** rng.integers(-300, 300, n)
    f64_bits = rng.integers(0, 2**64, n, dtype=np.uint64).view(np.float64)
    f32_bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    f32 = np.concatenate([rng.standard_normal(n).astype(np.float32), f32_bits])
    extremes = [5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 0.1, 1 / 3, -0.0]
    f64 = np.concatenate([f64, f64_bits, extremes])
    return f64[np.isfinite(f64)], f32[np.isfinite(f32)]


def test_floats_round_trip_exactly(tmp_path):
    f64, f32 = _random_floats(2000)
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        for i, (x, y) in enumerate(zip(f64, f32, strict=False)):
            w.write(step_record(step=i, loss=x, tokens_per_s=abs(y), step_s=0.5, f32=y))
        w.write({"kind": "dump", "f64": f64, "f32": f32})  # numpy arrays become lists
    records = read_metrics(path)
    back = steps(records)
    n = len(back)
    assert n == min(len(f64), len(f32))
    loss = np.array([r["loss"] for r in back])
    assert loss.tobytes() == f64[:n].tobytes()  # bit for bit, -0.0 included
    assert np.array([r["f32"] for r in back], np.float32).tobytes() == f32[:n].tobytes()
    assert np.array(records[-1]["f64"]).tobytes() == f64.tobytes()
    assert np.array(records[-1]["f32"], np.float32).tobytes() == f32.tobytes()


def test_non_finite_values_are_written_as_null_and_the_file_is_strict_json(tmp_path):
    path = tmp_path / "nested" / "dir" / "m.jsonl"  # parent dirs are created
    with MetricsWriter(path) as w:
        w.write(step_record(step=0, loss=math.nan, tokens_per_s=math.inf, step_s=1.0))
        w.write(eval_record(step=0, heldout_loss=np.float32("-inf"), extra=[1.0, math.nan]))
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    for line in text.splitlines():  # a strict parser (NaN tokens rejected) reads every line
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))
    step, ev = read_metrics(path)
    assert step["loss"] is None and step["tokens_per_s"] is None and step["step_s"] == 1.0
    assert ev == {"kind": "eval", "step": 0, "heldout_loss": None, "extra": [1.0, None]}


def test_records_and_their_validation():
    assert step_record(step=3, loss=2.5, tokens_per_s=1000, step_s=0.1, lr=1e-3) == {
        "kind": "step",
        "step": 3,
        "loss": 2.5,
        "tokens_per_s": 1000.0,
        "step_s": 0.1,
        "lr": 1e-3,
    }
    assert eval_record(step=np.int64(4), heldout_loss=1.5)["step"] == 4
    assert run_record(config="tiny", world_size=2, loss_floor=np.float64(1.25)) == {
        "kind": "run",
        "config": "tiny",
        "world_size": 2,
        "loss_floor": 1.25,
    }
    with pytest.raises(ValueError, match="step=-1 must be an int >= 0"):
        step_record(step=-1, loss=1.0, tokens_per_s=1.0, step_s=1.0)
    with pytest.raises(ValueError, match=r"step=1\.0 must be an int >= 0"):
        eval_record(step=1.0, heldout_loss=1.0)
    with pytest.raises(TypeError, match="loss='1' must be a real number"):
        step_record(step=0, loss="1", tokens_per_s=1.0, step_s=1.0)
    with pytest.raises(ValueError, match="step_s=-1.0 must be >= 0"):
        step_record(step=0, loss=1.0, tokens_per_s=1.0, step_s=-1.0)
    with pytest.raises(ValueError, match=r"extra fields \['kind'\] would overwrite"):
        eval_record(step=0, heldout_loss=1.0, kind="step")
    with pytest.raises(ValueError, match="'kind' is set by run_record"):
        run_record(kind="x")


def test_writer_rejects_what_json_cannot_hold(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl") as w:
        with pytest.raises(TypeError, match=r"record\.path=.*PosixPath is not JSON-serialisable"):
            w.write({"path": Path("x")})
        with pytest.raises(TypeError, match="key 1 must be a str"):
            w.write({1: 2})
        with pytest.raises(TypeError, match="record must be a dict"):
            w.write([1, 2])
    with pytest.raises(ValueError, match="write after close"):
        w.write({"a": 1})
    assert (tmp_path / "m.jsonl").read_text() == ""  # nothing half-written


def test_malformed_lines_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind": "step", "step": 0}\n{"kind": "step", "step":\n')
    with pytest.raises(ValueError, match=rf"{path}:2: malformed metrics line"):
        read_metrics(path)
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{path}:2: expected a JSON object per line, got list"):
        read_metrics(path)
    path.write_text('{"loss": NaN}\n')
    with pytest.raises(ValueError, match=rf"{path}:1: .*non-standard JSON constant NaN"):
        read_metrics(path)
    with pytest.raises(FileNotFoundError, match="metrics file .*missing.jsonl' does not exist"):
        read_metrics(tmp_path / "missing.jsonl")
    path.write_text('{"a": 1}\n{"deep": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(ValueError, match=rf"{path}:2: malformed metrics line: nested deeper"):
        read_metrics(path)  # was a RecursionError


def test_append_resumes_a_run_and_later_records_of_a_step_win(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        w.write(run_record(config="tiny", loss_floor=1.0))
        for s in range(3):
            w.write(step_record(step=s, loss=5.0 - s, tokens_per_s=1.0, step_s=1.0))
    with open(path, "a") as f:
        f.write('{"kind": "step", "st')  # a crash cut this write
    with MetricsWriter(path, append=True) as w:  # resume from a checkpoint at step 2
        w.write(run_record(config="tiny", loss_floor=1.0, resumed_from=2))
        w.write(step_record(step=2, loss=2.5, tokens_per_s=1.0, step_s=1.0))
        w.write(step_record(step=3, loss=2.0, tokens_per_s=1.0, step_s=1.0))
        w.write(eval_record(step=4, heldout_loss=2.2))
    records = read_metrics(path)
    assert len(runs(records)) == 2
    assert [(r["step"], r["loss"]) for r in steps(records)] == [
        (0, 5.0),
        (1, 4.0),
        (2, 2.5),
        (3, 2.0),
    ]
    assert [r["heldout_loss"] for r in evals(records)] == [2.2]
    with MetricsWriter(path) as w:  # the default truncates
        w.write(run_record(config="small"))
    assert read_metrics(path) == [{"kind": "run", "config": "small"}]


# --- plot -------------------------------------------------------------------------------------


def _write_run(path: Path, *, n_steps: int, floor: float | None, evals_every: int = 5) -> Path:
    with MetricsWriter(path) as w:
        w.write(run_record(config="tiny", loss_floor=floor))
        for s in range(n_steps):
            loss = math.nan if s == 3 else 5.0 * math.exp(-s / 10) + 1.0
            w.write(step_record(step=s, loss=loss, tokens_per_s=1e4 + s, step_s=0.1))
            if s % evals_every == 0:
                w.write(eval_record(step=s, heldout_loss=loss + 0.1))
    return path


def _gids(ax) -> list[str]:
    return sorted(line.get_gid() for line in ax.lines)


def test_figure_has_a_line_per_curve(tmp_path):
    a = load_run(_write_run(tmp_path / "mxfp8.jsonl", n_steps=20, floor=1.0))
    b = load_run(_write_run(tmp_path / "fp32.jsonl", n_steps=12, floor=None), label="control")
    assert a.label == "mxfp8" and a.loss_floor == 1.0 and b.loss_floor is None
    assert a.step.tolist() == list(range(20)) and np.isnan(a.loss[3])
    assert a.eval_step.tolist() == [0, 5, 10, 15]
    fig = build_figure([a, b], title="t")
    ax_loss, ax_tps = fig.axes
    assert _gids(ax_loss) == [
        "floor/mxfp8",
        "heldout/control",
        "heldout/mxfp8",
        "loss/control",
        "loss/mxfp8",
    ]
    assert _gids(ax_tps) == ["tokens_per_s/control", "tokens_per_s/mxfp8"]


def test_plot_runs_writes_a_png(tmp_path):
    paths = [_write_run(tmp_path / f"run{i}.jsonl", n_steps=10, floor=1.0) for i in range(2)]
    out = plot_runs(paths, tmp_path / "plots" / "curves.png", labels=["a", "b"], title="T")
    assert out == tmp_path / "plots" / "curves.png"
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    with pytest.raises(ValueError, match="1 labels for 2 files"):
        plot_runs(paths, tmp_path / "x.png", labels=["a"])
    empty = tmp_path / "empty.jsonl"
    with MetricsWriter(empty) as w:
        w.write(run_record(config="tiny"))
    with pytest.raises(ValueError, match="empty.jsonl: no step records"):
        plot_runs([empty], tmp_path / "x.png")


def test_cli_plots_two_files_and_names_missing_ones(tmp_path, capsys):
    paths = [str(_write_run(tmp_path / f"r{i}.jsonl", n_steps=8, floor=None)) for i in range(2)]
    out = tmp_path / "c.png"
    assert main([*paths, "-o", str(out), "--labels", "x", "y", "--title", "T"]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert capsys.readouterr().out.strip() == str(out)
    assert main([paths[0], str(tmp_path / "gone.jsonl"), "-o", str(out)]) == 2
    assert "not found: " + str(tmp_path / "gone.jsonl") in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    assert main([str(tmp_path / "bad.jsonl"), "-o", str(out)]) == 1
    assert "bad.jsonl:1: malformed metrics line" in capsys.readouterr().err


def test_cli_refuses_an_output_directory_and_malformed_values(tmp_path, capsys):
    """``-o <existing directory>`` was a traceback after reading and drawing (IsADirectoryError);
    so were a loss that is not a number and a deeply nested line."""
    path = str(_write_run(tmp_path / "r.jsonl", n_steps=4, floor=None))
    with pytest.raises(SystemExit) as e:
        main([path, "-o", str(tmp_path)])
    assert e.value.code == 2
    assert f"-o/--out: {str(tmp_path)!r} is an existing directory" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    for line, message in [
        ('{"kind": "step", "step": 0, "loss": {"v": 1}, "tokens_per_s": 1}',
         f"{bad}: step 0's 'loss' is \"{{'v': 1}}\", expected a number or null"),
        ('{"kind": "step", "step": 0, "loss": 1, "tokens_per_s": 1' + "0" * 400 + "}",
         f"{bad}: a number is out of range"),
        ('{"kind": "run", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
         f"{bad}:1: malformed metrics line: nested deeper"),
    ]:
        bad.write_text(line + "\n")
        assert main([str(bad), "-o", str(tmp_path / "c.png")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("plot: error: ") and message in err, err


def test_cli_runs_as_a_module(tmp_path):
    paths = [str(_write_run(tmp_path / f"r{i}.jsonl", n_steps=5, floor=1.0)) for i in range(2)]
    out = tmp_path / "m.png"
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "DISPLAY")}
    env["PYTHONPATH"] = str(REPO_ROOT)  # headless, no backend chosen: plot.py needs neither
    done = subprocess.run(
        [sys.executable, "-W", "error", "-m", "apps.training.plot", *paths, "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(("name", "signature"), [
    ("curves", PNG_SIGNATURE),  # no suffix: matplotlib used to write curves.png instead
    ("curves.v2", PNG_SIGNATURE),  # a suffix that is no format: PNG, at exactly that name
    ("curves.svg", b"<?xml"),  # a suffix matplotlib writes: that format
])
def test_cli_writes_exactly_the_file_it_prints(tmp_path, capsys, name, signature):
    path = str(_write_run(tmp_path / "r.jsonl", n_steps=4, floor=None))
    out = tmp_path / name
    assert main([path, "-o", str(out)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(out)
    assert Path(printed).read_bytes().startswith(signature)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["r.jsonl", name])
