"""Loss curves of two training runs that differ only in their GEMM, compared against a stated
bound (issue 33: the ``fp8_blocked`` GEMM against the exact MXFP8 GEMM over 200 steps of GPT-2
124M on a GPU; ``scripts/gpu/gemm_loss.sh`` runs them).

Inputs are ``mxfp8-train --metrics`` files of runs with the same seed, data, model and schedule
(the corpus, parameter count, world and mesh of their run records must agree, and their
steps). Per pair (the reference run first):

- ``max_abs_diff``: the largest |loss_b - loss_a| of one step, over the steps from ``--skip``;
- ``mean_abs_diff``: the mean of those differences;
- ``tail_rel_diff``: (mean of b's last ``--tail`` losses - mean of a's) / mean of a's;
- the held-out losses at the end, where both files have them.

``--control C.jsonl``: a third run against the same reference (for example the exact GEMM with
another accumulation order: ``--gemm dequant_dot``), reported beside the pair as the size of a
difference that changes nothing but the order of fp32 sums.

The bound (stated before the runs): ``max_abs_diff <= --max-step-diff`` (0.05 nats) and
``|tail_rel_diff| <= --max-tail-rel`` (0.5 %). The exit status is 0 within the bound, 1 outside.

    python3 -m benchmarks.gemm_loss exact.jsonl fp8_blocked.jsonl --control dequant_dot.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.training.metrics import evals, read_metrics, runs, steps  # noqa: E402

__all__ = ["Curve", "compare", "load", "main", "table"]

# run-record fields that must agree between the compared runs (where both files carry them)
_SAME = ("corpus", "params", "world_size", "mesh", "loss_floor")


class Curve(NamedTuple):
    """One run's step losses (step -> loss; a null loss is NaN), its last held-out loss and its
    last run record."""

    path: Path
    loss: dict[int, float]
    heldout: float | None
    run: dict[str, Any]


def load(path: str | Path) -> Curve:
    """Read a metrics file; refused (ValueError naming it) without step records."""
    path = Path(path)
    records = read_metrics(path)
    step_recs = steps(records)
    if not step_recs:
        raise ValueError(f"{path}: no step records (kind 'step'); pass a metrics file that "
                         f"mxfp8-train --metrics wrote")
    loss = {int(r["step"]): math.nan if r.get("loss") is None else float(r["loss"])
            for r in step_recs}
    held = [r.get("heldout_loss") for r in evals(records)]
    run_recs = runs(records)
    return Curve(path, loss, None if not held or held[-1] is None else float(held[-1]),
                 run_recs[-1] if run_recs else {})


def _check_same(a: Curve, b: Curve) -> None:
    for key in _SAME:
        if key in a.run and key in b.run and a.run[key] != b.run[key]:
            raise ValueError(f"{b.path}: its run has {key}={b.run[key]!r} but {a.path} has "
                             f"{a.run[key]!r}; compare runs that differ only in their GEMM")
    if sorted(a.loss) != sorted(b.loss):
        raise ValueError(f"{b.path}: its steps ({len(b.loss)}, {min(b.loss)}..{max(b.loss)}) "
                         f"are not those of {a.path} ({len(a.loss)}, {min(a.loss)}.."
                         f"{max(a.loss)}); compare runs of the same length")


def compare(a: Curve, b: Curve, *, skip: int = 0, tail: int = 50) -> dict[str, Any]:
    """The differences of ``b`` to the reference ``a`` (module docstring)."""
    _check_same(a, b)
    order = sorted(a.loss)
    kept = [s for s in order if s >= skip]
    if not kept:
        raise ValueError(f"--skip {skip} leaves no step of {a.path} (last step {order[-1]})")
    diffs = [abs(b.loss[s] - a.loss[s]) for s in kept]
    last = order[-min(tail, len(order)):]
    mean_a = sum(a.loss[s] for s in last) / len(last)
    mean_b = sum(b.loss[s] for s in last) / len(last)
    worst = max(range(len(kept)), key=lambda i: -1.0 if math.isnan(diffs[i]) else diffs[i])
    out: dict[str, Any] = {
        "steps": len(order), "from_step": kept[0],
        "max_abs_diff": math.nan if any(map(math.isnan, diffs)) else diffs[worst],
        "max_abs_diff_step": kept[worst],
        "mean_abs_diff": sum(diffs) / len(diffs),
        "tail_steps": len(last), "tail_mean_a": mean_a, "tail_mean_b": mean_b,
        "tail_rel_diff": (mean_b - mean_a) / mean_a,
    }
    if a.heldout is not None and b.heldout is not None:
        out.update(heldout_a=a.heldout, heldout_b=b.heldout, heldout_diff=b.heldout - a.heldout)
    return out


def within(result: dict[str, Any], max_step_diff: float, max_tail_rel: float) -> bool:
    """Whether a comparison is within the bound (NaN is never within)."""
    return bool(result["max_abs_diff"] <= max_step_diff
                and abs(result["tail_rel_diff"]) <= max_tail_rel)


def table(curves: Sequence[Curve], every: int = 20) -> str:
    """A markdown table of the losses every ``every`` steps (and the last), the reference first,
    each other run as its loss and its difference to the reference."""
    ref = curves[0]
    order = sorted(ref.loss)
    shown = [s for s in order if s % every == 0] + ([order[-1]] if order[-1] % every else [])
    head = ["step", ref.path.stem] + [f"{c.path.stem} (diff)" for c in curves[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in shown:
        cells = [str(s), f"{ref.loss[s]:.4f}"]
        cells += [f"{c.loss[s]:.4f} ({c.loss[s] - ref.loss[s]:+.4f})" for c in curves[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reference", type=Path, help="metrics of the reference run (exact GEMM)")
    p.add_argument("other", type=Path, help="metrics of the run compared with it")
    p.add_argument("--control", type=Path, help="a third run compared with the reference too")
    p.add_argument("--skip", type=int, default=0, help="first step counted in the step bound")
    p.add_argument("--tail", type=int, default=50, help="steps averaged at the end")
    p.add_argument("--max-step-diff", type=float, default=0.05)
    p.add_argument("--max-tail-rel", type=float, default=0.005)
    p.add_argument("--every", type=int, default=20, help="table row every this many steps")
    p.add_argument("--out", type=Path, help="write the comparison as JSON here")
    args = p.parse_args(argv)
    try:
        curves = [load(args.reference), load(args.other)]
        if args.control:
            curves.append(load(args.control))
        result: dict[str, Any] = {"pair": compare(curves[0], curves[1], skip=args.skip,
                                                  tail=args.tail)}
        if args.control:
            result["control"] = compare(curves[0], curves[2], skip=args.skip, tail=args.tail)
    except (ValueError, OSError) as e:
        p.error(str(e))
    ok = within(result["pair"], args.max_step_diff, args.max_tail_rel)
    result.update(bound={"max_step_diff": args.max_step_diff, "max_tail_rel": args.max_tail_rel},
                  within_bound=ok)
    print(table(curves, args.every))
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.other.name} against {args.reference.name}: "
          f"{'within' if ok else 'OUTSIDE'} the bound")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
