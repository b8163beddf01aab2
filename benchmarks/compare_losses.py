"""Compare the per-step losses of ``mxfp8-train`` metrics files bit for bit (reproducibility runs).

    python -m benchmarks.compare_losses a.jsonl b.jsonl [c.jsonl ...]

Prints, for each file after the first, how many steps it shares with the first, how many of their
losses are the same float, the first step that differs and the largest difference; exits 1 if any
shared step differs. Held-out losses (``eval`` records) are compared the same way.
"""

from __future__ import annotations

import argparse
import sys

from apps.training.metrics import evals, read_metrics, steps


def _by_step(path: str) -> tuple[dict[int, float], dict[int, float]]:
    records = read_metrics(path)  # a resumed run's re-logged steps: the last record counts
    return ({r["step"]: r["loss"] for r in steps(records)},
            {r["step"]: r["heldout_loss"] for r in evals(records)})


def _diff(a: dict[int, float], b: dict[int, float]) -> tuple[int, int, int | None, float]:
    shared = sorted(set(a) & set(b))
    differ = [s for s in shared if a[s] != b[s]]
    worst = max((abs(a[s] - b[s]) for s in differ if a[s] is not None and b[s] is not None),
                default=0.0)
    return len(shared), len(shared) - len(differ), (differ[0] if differ else None), worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    if len(args.files) < 2:
        p.error("give at least two metrics files")
    ref_steps, ref_evals = _by_step(args.files[0])
    ok = True
    for path in args.files[1:]:
        run_steps, run_evals = _by_step(path)
        n, same, first, worst = _diff(ref_steps, run_steps)
        en, esame, _, eworst = _diff(ref_evals, run_evals)
        ok &= same == n and esame == en
        where = "identical" if first is None else f"first differs at step {first}"
        print(f"{path} vs {args.files[0]}: {same}/{n} step losses equal ({where}, max |diff| "
              f"{worst:.3g}); held-out {esame}/{en} equal (max |diff| {eworst:.3g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
