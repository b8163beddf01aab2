"""The ``--telemetry`` records of a metrics file as a figure (``mxfp8-plot RUN.jsonl --telemetry
OUT.png``; ``apps.training.instruments`` writes them).

Design note. One run, all its MXFP8 groups summed (or one group, ``group=``), four panels sharing
the step axis: the E8M0 scale-exponent histogram of the rowwise and of the columnwise plane over
the steps (heatmaps, log10 of the block count, exponent on the y axis); the shares of elements
quantized to zero and to subnormal E4M3 values (rowwise solid, columnwise dashed); the share of
scale blocks whose byte changed since the previous step, with the mean amax headroom in bits on
a second axis. Sums over groups weight each group by its elements (shares) or blocks (headroom).
Artists carry gids ``"<what>/<plane>"`` (hist, zero, subnormal, changed, headroom).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from apps.training.metrics import read_metrics, steps

__all__ = ["PLANES", "TelemetrySeries", "build_telemetry_figure", "load_telemetry",
           "plot_telemetry"]

PLANES = ("rowwise", "colwise")


class TelemetrySeries(NamedTuple):
    """Per plane, per step (NaN where a step has no value, e.g. no headroom after a skip)."""

    label: str
    step: np.ndarray  # (S,)
    exponents: np.ndarray  # (E,) the histogram rows: lowest to highest exponent seen
    hist: dict[str, np.ndarray]  # plane -> (S, E) block counts
    zero_share: dict[str, np.ndarray]
    subnormal_share: dict[str, np.ndarray]
    changed_share: dict[str, np.ndarray]
    headroom_mean: dict[str, np.ndarray]


def _pick(record: dict, group: str | None, where: str) -> list[dict]:
    groups = record["telemetry"]
    if group is None:
        return list(groups.values())
    if group not in groups:
        raise ValueError(f"{where}: no telemetry for group {group!r}; groups: {list(groups)}")
    return [groups[group]]


def load_telemetry(path: str | os.PathLike, *, group: str | None = None) -> TelemetrySeries:
    """The telemetry of one metrics file, every MXFP8 group summed (or only ``group``)."""
    path = Path(path)
    recs = [r for r in steps(read_metrics(path)) if r.get("telemetry")]
    if not recs:
        raise ValueError(f"{path}: no step record carries telemetry; train with --telemetry "
                         f"--metrics {path}")
    try:
        return _summed(path, recs, group)
    except (KeyError, TypeError, IndexError, AttributeError, OverflowError) as e:
        raise ValueError(
            f"{path}: malformed telemetry record ({type(e).__name__}: {str(e)[:80]}); expected "
            f"what --telemetry writes (docs/training.md, 'Numerics telemetry')") from None


def _summed(path: Path, recs: list[dict], group: str | None) -> TelemetrySeries:
    """The series of the telemetry records ``recs`` (``load_telemetry``)."""
    chosen = [_pick(r, group, f"{path} step {r['step']}") for r in recs]
    lows = [p["scale_exp"]["lo"] for gs in chosen for g in gs for p in g.values()
            if p["scale_exp"]["counts"]]
    highs = [p["scale_exp"]["lo"] + len(p["scale_exp"]["counts"]) - 1
             for gs in chosen for g in gs for p in g.values() if p["scale_exp"]["counts"]]
    lo, hi = (min(lows), max(highs)) if lows else (0, 0)
    out = {k: {p: np.full(len(recs), np.nan) for p in PLANES}
           for k in ("zero", "subnormal", "changed", "headroom")}
    hist = {p: np.zeros((len(recs), hi - lo + 1)) for p in PLANES}
    for i, groups in enumerate(chosen):
        for plane in PLANES:
            stats = [g[plane] for g in groups if plane in g]
            elements = sum(s["elements"] for s in stats)
            blocks = sum(s["blocks"] for s in stats)
            for s in stats:
                counts = s["scale_exp"]["counts"]
                start = s["scale_exp"]["lo"] - lo
                hist[plane][i, start:start + len(counts)] += counts
            if elements:
                out["zero"][plane][i] = sum(s["zero"] for s in stats) / elements
                out["subnormal"][plane][i] = sum(s["subnormal"] for s in stats) / elements
            if blocks:
                out["changed"][plane][i] = sum(s["changed_blocks"] for s in stats) / blocks
            h = [s["headroom_bits"] for s in stats if s["headroom_bits"]]
            n = sum(x["blocks"] for x in h)
            if n:
                out["headroom"][plane][i] = sum(x["mean"] * x["blocks"] for x in h) / n
    return TelemetrySeries(
        label=path.stem if group is None else f"{path.stem} {group}",
        step=np.array([r["step"] for r in recs], np.int64), exponents=np.arange(lo, hi + 1),
        hist=hist,
        zero_share=out["zero"], subnormal_share=out["subnormal"],
        changed_share=out["changed"], headroom_mean=out["headroom"],
    )


def build_telemetry_figure(t: TelemetrySeries, *, title: str | None = None) -> Figure:
    fig = Figure(figsize=(9, 10), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(4, 1, sharex=True, height_ratios=[2, 2, 1.5, 1.5])
    edges_x = np.concatenate([t.step - 0.5, [t.step[-1] + 0.5]])
    edges_y = np.concatenate([t.exponents - 0.5, [t.exponents[-1] + 0.5]])
    for ax, plane in zip(axes[:2], PLANES, strict=True):
        with np.errstate(divide="ignore"):
            z = np.where(t.hist[plane] > 0, np.log10(t.hist[plane]), np.nan)
        mesh = ax.pcolormesh(edges_x, edges_y, z.T, cmap="viridis", gid=f"hist/{plane}")
        fig.colorbar(mesh, ax=ax, label="log10 blocks")
        ax.set_ylabel(f"{plane} scale\nexponent (E-127)")
    ax = axes[2]
    for plane, style in zip(PLANES, ("-", "--"), strict=True):
        ax.plot(t.step, t.zero_share[plane], style, color="C0", label=f"zero, {plane}",
                gid=f"zero/{plane}")
        ax.plot(t.step, t.subnormal_share[plane], style, color="C1",
                label=f"subnormal, {plane}", gid=f"subnormal/{plane}")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylabel("share of\nelements")
    ax.legend(fontsize="small", ncol=2)
    ax = axes[3]
    twin = ax.twinx()
    for plane, style in zip(PLANES, ("-", "--"), strict=True):
        ax.plot(t.step, t.changed_share[plane], style, color="C2",
                label=f"scales changed, {plane}", gid=f"changed/{plane}")
        twin.plot(t.step, t.headroom_mean[plane], style, color="C3",
                  label=f"mean headroom, {plane}", gid=f"headroom/{plane}")
    ax.set_ylabel("share of blocks\nwith a new scale")
    twin.set_ylabel("amax headroom (bits)")
    ax.legend(fontsize="small", loc="upper left")
    twin.legend(fontsize="small", loc="upper right")
    axes[3].set_xlabel("step")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(title or f"MXFP8 telemetry: {t.label}")
    return fig


def plot_telemetry(path: str | os.PathLike, out: str | os.PathLike, *,
                   group: str | None = None, title: str | None = None) -> Path:
    """Draw ``path``'s telemetry into exactly ``out`` (PNG unless its suffix names another
    format matplotlib writes) and return it."""
    fig = build_telemetry_figure(load_telemetry(path, group=group), title=title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    suffix = out.suffix.lstrip(".").lower()
    fig.savefig(out, dpi=110, format=suffix if suffix in fig.canvas.get_supported_filetypes()
                else "png")
    return out
