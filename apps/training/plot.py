"""Loss curves of training runs to a PNG, from their JSONL metrics files (``metrics.py``).

Design note. One figure, two panels sharing the step axis: top, training loss per step for each
run (a line), its held-out evals (markers) and, when the run's ``"run"`` record carries a
``loss_floor``, that floor (a dashed horizontal line); bottom, tokens/s per step. Each artist
carries a gid ``"<what>/<label>"`` (what: loss, heldout, floor, tokens_per_s) so callers and tests
can find it. Matplotlib runs headless through an explicit Agg canvas (no pyplot, no global backend
switch, no display). Null values in the file (non-finite when written) are gaps in the lines.

Command line::

    python -m apps.training.plot RUN.jsonl [RUN2.jsonl ...] -o curves.png [--labels a b] [--title T]
    python -m apps.training.plot RUN.jsonl --telemetry numerics.png [--group LABEL]

``--telemetry`` draws the MXFP8 numerics of a ``--telemetry`` run (``apps.training.plot_telemetry``)
instead of, or besides (with ``-o``), the loss curves.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from apps.training.metrics import evals, read_metrics, runs, steps
from apps.training.output_path import unwritable_reason

__all__ = ["RunCurves", "build_figure", "load_run", "main", "plot_runs"]


class RunCurves(NamedTuple):
    """What is plotted of one run; NaN where the file holds null."""

    label: str
    step: np.ndarray  # int64 (S,)
    loss: np.ndarray  # float64 (S,)
    tokens_per_s: np.ndarray  # float64 (S,)
    eval_step: np.ndarray  # int64 (E,)
    heldout_loss: np.ndarray  # float64 (E,)
    loss_floor: float | None  # from the last "run" record that carries one


def _number(value: Any, where: str) -> float:
    """A JSON number as float (null: NaN); anything else is a malformed record."""
    if value is None:
        return np.nan
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} is {str(value)[:40]!r}, expected a number or null (a "
                         f"metrics file as mxfp8-train writes it)")
    return float(value)


def _floats(records: list[dict[str, Any]], key: str, path: Path) -> np.ndarray:
    return np.array([_number(r.get(key), f"{path}: step {r['step']}'s {key!r}")
                     for r in records], np.float64)


def load_run(path: str | os.PathLike, *, label: str | None = None) -> RunCurves:
    """Read one metrics file; ``label`` defaults to the file stem. Needs >= 1 step record."""
    path = Path(path)
    records = read_metrics(path)
    step_recs, eval_recs = steps(records), evals(records)
    if not step_recs:
        raise ValueError(f"{path}: no step records (kind 'step') to plot")
    try:
        return _curves(path, label, records, step_recs, eval_recs)
    except OverflowError as e:  # an integer beyond float64 or int64: not written by a run
        raise ValueError(f"{path}: a number is out of range ({e}); not a metrics file as "
                         f"mxfp8-train writes it") from None


def _curves(path: Path, label: str | None, records: list[dict[str, Any]],
            step_recs: list[dict[str, Any]], eval_recs: list[dict[str, Any]]) -> RunCurves:
    floors = [_number(r["loss_floor"], f"{path}: a run record's 'loss_floor'")
              for r in runs(records) if r.get("loss_floor") is not None]
    return RunCurves(
        label=path.stem if label is None else label,
        step=np.array([r["step"] for r in step_recs], np.int64),
        loss=_floats(step_recs, "loss", path),
        tokens_per_s=_floats(step_recs, "tokens_per_s", path),
        eval_step=np.array([r["step"] for r in eval_recs], np.int64),
        heldout_loss=_floats(eval_recs, "heldout_loss", path),
        loss_floor=floors[-1] if floors else None,
    )


def build_figure(curves: Sequence[RunCurves], *, title: str | None = None) -> Figure:
    """The two-panel figure (loss above, tokens/s below) on an Agg canvas."""
    fig = Figure(figsize=(9, 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_tps = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    for i, run in enumerate(curves):
        color = f"C{i % 10}"
        ax_loss.plot(
            run.step, run.loss, color=color, lw=1.2, label=run.label, gid=f"loss/{run.label}"
        )
        if run.eval_step.size:
            ax_loss.plot(
                run.eval_step,
                run.heldout_loss,
                linestyle="none",
                marker="o",
                color=color,
                mec="black",
                label=f"{run.label} held-out",
                gid=f"heldout/{run.label}",
            )
        if run.loss_floor is not None:
            ax_loss.axhline(
                run.loss_floor,
                color=color,
                linestyle="--",
                lw=0.8,
                label=f"{run.label} loss floor",
                gid=f"floor/{run.label}",
            )
        ax_tps.plot(
            run.step, run.tokens_per_s, color=color, lw=1.0, gid=f"tokens_per_s/{run.label}"
        )
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.grid(alpha=0.3)
    if curves:
        ax_loss.legend(fontsize="small")
    ax_tps.set_xlabel("step")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def plot_runs(
    paths: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Plot the metrics files ``paths`` into exactly the file ``out`` (parent dirs created) and
    return it: PNG, or the format its suffix names when matplotlib writes it (.svg, .pdf, ...)."""
    if not paths:
        raise ValueError("plot_runs: no metrics files given; pass one or more RUN.jsonl paths")
    if labels is not None and len(labels) != len(paths):
        raise ValueError(
            f"plot_runs: {len(labels)} labels for {len(paths)} files; give one label per file "
            f"or none (file stems are used)"
        )
    names = labels if labels is not None else [None] * len(paths)
    curves = [load_run(p, label=name) for p, name in zip(paths, names, strict=True)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = build_figure(curves, title=title)
    # An explicit format: without one, matplotlib appends ".png" to a name with no known suffix
    # ("curves" -> curves.png), and the path returned (and printed) would not be the file.
    suffix = out.suffix.lstrip(".").lower()
    fmt = suffix if suffix in fig.canvas.get_supported_filetypes() else "png"
    fig.savefig(out, dpi=120, format=fmt)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m apps.training.plot",
        description="Plot training loss, held-out evals and tokens/s of JSONL metrics files.",
    )
    p.add_argument("runs", nargs="+", type=Path, help="metrics files (RUN.jsonl)")
    p.add_argument("-o", "--out", type=Path,
                   help="output file, written as given: PNG unless the suffix names another "
                        "format matplotlib writes (.svg, .pdf)")
    p.add_argument("--labels", nargs="+", help="one legend label per file (default: file stems)")
    p.add_argument("--title", help="figure title")
    p.add_argument("--telemetry", type=Path, metavar="OUT",
                   help="also draw the MXFP8 telemetry of the first file (a run with "
                        "--telemetry) into OUT")
    p.add_argument("--group", help="with --telemetry: one parameter group (default: all summed)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line; returns the exit status: 0 ok, 1 unreadable or malformed metrics files, 2
    bad arguments (missing files, an output that cannot be written: checked before reading)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.out is None and args.telemetry is None:
        parser.error("give -o/--out (loss curves), --telemetry OUT (MXFP8 numerics), or both")
    for flag, out in (("-o/--out", args.out), ("--telemetry", args.telemetry)):
        if out is not None and (why := unwritable_reason(out)) is not None:
            parser.error(f"{flag}: {why}")
    missing = [str(p) for p in args.runs if not p.is_file()]
    if missing:
        print(f"plot: error: metrics file(s) not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        if args.out is not None:
            print(plot_runs(args.runs, args.out, labels=args.labels, title=args.title))
        if args.telemetry is not None:
            from apps.training.plot_telemetry import plot_telemetry

            print(plot_telemetry(args.runs[0], args.telemetry, group=args.group,
                                 title=args.title))
    except ValueError as err:
        print(f"plot: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
