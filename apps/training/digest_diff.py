"""``mxfp8-digest-diff A.jsonl B.jsonl`` (= ``python -m apps.training.digest_diff``): the first
step, group and tensor where two runs' states differ, or that they are identical.

Both files are ``--metrics`` files of runs with ``--digest`` (``apps.training.instruments``). A
run's digests form a sequence of **points**, in the order training reaches them:

    start (state before step 0), step 0 gradient, state after step 0, step 1 gradient, ...

A step record ``s`` holds the reduced gradient of step ``s`` (``grad``) and the state after its
update (``main``, ``rowwise``/``colwise`` planes, their ``*_scale``s); a run record holds the
state the run starts from (``resumed_from`` steps done: the initial weights, or the checkpoint a
resume loaded). The points both files have are compared in that order; within a point, groups in
the file's order and tensors in the order main, grad, rowwise_scale, rowwise, colwise_scale,
colwise (the cause before its consequences: the main weights, then the scales and planes
quantized from them). A file that disagrees with itself (a resumed run whose loaded state or
re-run step hashes differently from the first time) is reported too: its resume was not exact.

Exit status: 0 identical, 1 differ, 2 bad input (a missing or malformed file, no digests or a
digest that hashes no tensor, runs of different models, no point in common), with the reason on
stderr.

The digests do not depend on the world size (``torch_side.instruments.step_digest``): runs at
different world sizes agree wherever their values are equal (the start, a resume of a checkpoint
saved at another world size); their reduced gradients are summed in another order and usually
differ.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from apps.training.metrics import read_metrics

__all__ = ["Difference", "DigestError", "DigestRun", "Verdict", "compare", "load_digests", "main"]

TENSOR_ORDER = ("main", "grad", "rowwise_scale", "rowwise", "colwise_scale", "colwise")
GRAD, STATE = 1, 0  # the phase of a point: (index, phase) sorts in training order


class DigestError(ValueError):
    """Input the diff cannot compare (exit status 2)."""


def describe(point: tuple[int, int]) -> str:
    index, phase = point
    if phase == GRAD:
        return f"step {index}, reduced gradient (before its update)"
    return "start, before step 0" if index == 0 else f"step {index - 1}, after its update"


class DigestRun(NamedTuple):
    path: str
    points: dict[tuple[int, int], dict[str, dict[str, str]]]  # point -> group -> tensor -> hex
    conflicts: list[str]  # where the file disagrees with itself
    world_sizes: list[int]


def _add(run: DigestRun, point: tuple[int, int], digests: dict, where: str) -> None:
    seen = run.points.get(point)
    if seen is not None and seen != digests:
        run.conflicts.append(
            f"{run.path}: {describe(point)} hashes differently at {where} than earlier in the "
            f"file: the run (or its resume) is not bit-exact"
        )
    run.points[point] = digests  # the later record wins, as metrics.steps() keeps it


def _check_digest(path: str | os.PathLike, lineno: int, digest: Any) -> None:
    ok = isinstance(digest, dict) and all(
        isinstance(g, dict) and all(isinstance(h, str) for h in g.values())
        for g in digest.values())
    if not ok:
        raise DigestError(f"{path}:{lineno}: 'digest' must map group -> tensor -> hex string, "
                          f"got {str(digest)[:80]}")
    if not digest or not all(digest.values()):  # else "identical" would compare nothing
        raise DigestError(f"{path}:{lineno}: 'digest' hashes no tensor (got {str(digest)[:80]}); "
                          f"--digest writes at least one group with its tensors' hashes")


def _count(path: str | os.PathLike, lineno: int, record: dict, field: str, *, minimum: int) -> int:
    """``record[field]``, an integer >= ``minimum`` (a bool is not one), else DigestError."""
    value = record.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DigestError(f"{path}:{lineno}: a {record.get('kind')!r} record's {field!r} must "
                          f"be an integer >= {minimum}, got {str(value)[:80]}; was the line "
                          f"edited? The metrics files of mxfp8-train write it so")
    return value


def load_digests(path: str | os.PathLike) -> DigestRun:
    """The digest points of one metrics file; ``DigestError`` when it has none, or when a
    record it reads has a malformed field."""
    try:
        records = read_metrics(path)
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
        raise DigestError(str(e)) from None
    run = DigestRun(str(path), {}, [], [])
    for lineno, r in enumerate(records, start=1):
        digest = r.get("digest")
        if r.get("kind") == "run" and "world_size" in r:
            run.world_sizes.append(_count(path, lineno, r, "world_size", minimum=1))
        if digest is None:
            continue
        _check_digest(path, lineno, digest)
        if r.get("kind") == "run":
            start = 0 if r.get("resumed_from") is None else _count(
                path, lineno, r, "resumed_from", minimum=0)
            _add(run, (start, STATE), digest, f"line {lineno} (the run's start)")
        elif r.get("kind") == "step":
            _count(path, lineno, r, "step", minimum=0)
            grads = {g: {t: h for t, h in d.items() if t == "grad"} for g, d in digest.items()}
            state = {g: {t: h for t, h in d.items() if t != "grad"} for g, d in digest.items()}
            if any(grads.values()):
                _add(run, (r["step"], GRAD), grads, f"line {lineno} (step {r['step']})")
            _add(run, (r["step"] + 1, STATE), state, f"line {lineno} (step {r['step']})")
    if not run.points:
        raise DigestError(
            f"{path}: no digests in this metrics file; train with --digest --metrics {path}")
    return run


class Difference(NamedTuple):
    point: tuple[int, int]
    group: str
    tensor: str
    a: str
    b: str


class Verdict(NamedTuple):
    compared: list[tuple[int, int]]  # the points compared, up to the first difference
    differences: list[Difference]  # at the first differing point, in comparison order
    conflicts: list[str]  # self-disagreements of either file

    @property
    def identical(self) -> bool:
        return not self.differences and not self.conflicts


def _point_differences(point: tuple[int, int], a: dict, b: dict, pa: str,
                       pb: str) -> list[Difference]:
    if list(a) != list(b):
        raise DigestError(
            f"{describe(point)}: the runs have different parameter groups ({pa}: {list(a)}; "
            f"{pb}: {list(b)}); compare runs of the same model and weights recipe")
    out = []
    for group in a:
        ta, tb = a[group], b[group]
        if set(ta) != set(tb):
            raise DigestError(
                f"{describe(point)}, group {group!r}: {pa} hashes {sorted(ta)} but {pb} "
                f"{sorted(tb)}; compare runs of the same model and weights recipe")
        for t in sorted(ta, key=lambda t: (TENSOR_ORDER + (t,)).index(t)):
            if ta[t] != tb[t]:
                out.append(Difference(point, group, t, ta[t], tb[t]))
    return out


def compare(a: DigestRun, b: DigestRun) -> Verdict:
    """The points both runs hashed, in training order, up to the first that differs."""
    common = sorted(set(a.points) & set(b.points))
    if not common:
        raise DigestError(
            f"no point in common: {a.path} has {describe(min(a.points))} .. "
            f"{describe(max(a.points))}, {b.path} has {describe(min(b.points))} .. "
            f"{describe(max(b.points))}")
    compared = []
    for point in common:
        compared.append(point)
        diffs = _point_differences(point, a.points[point], b.points[point], a.path, b.path)
        if diffs:
            return Verdict(compared, diffs, a.conflicts + b.conflicts)
    return Verdict(compared, [], a.conflicts + b.conflicts)


def report(a: DigestRun, b: DigestRun, v: Verdict) -> str:
    lines = list(v.conflicts)
    if set(a.world_sizes) != set(b.world_sizes):
        lines.append(
            f"note: world sizes {a.world_sizes} vs {b.world_sizes}: the digests do not depend "
            f"on the layout, but reduced gradients are summed in another order and usually "
            f"differ")
    if v.differences:
        first, rest = v.differences[0], v.differences[1:]
        lines.append(f"first difference: {describe(first.point)}: group {first.group!r}, "
                     f"tensor {first.tensor!r} ({a.path} {first.a}, {b.path} {first.b})")
        if len(v.compared) > 1:
            lines.append(f"  identical before it: {len(v.compared) - 1} points, "
                         f"{describe(v.compared[0])} .. {describe(v.compared[-2])}")
        if rest:
            also = ", ".join(f"{d.group}:{d.tensor}" for d in rest[:8])
            lines.append(f"  also differing there: {also}" + (" ..." if len(rest) > 8 else ""))
    else:
        lines.append(f"identical: {len(v.compared)} points compared, {describe(v.compared[0])} "
                     f".. {describe(v.compared[-1])}")
        only = (set(a.points) ^ set(b.points))
        if only:
            lines.append(f"  ({len(only)} points are in one file only and were not compared)")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mxfp8-digest-diff",
        description="Name the first step, group and tensor where two --digest runs differ, or "
                    "say they are identical (exit 0 identical, 1 differ, 2 bad input).",
    )
    p.add_argument("a", type=Path, help="metrics file of a run with --digest")
    p.add_argument("b", type=Path, help="metrics file of another run with --digest")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        a, b = load_digests(args.a), load_digests(args.b)
        verdict = compare(a, b)
    except DigestError as e:
        print(f"mxfp8-digest-diff: error: {e}", file=sys.stderr)
        return 2
    print(report(a, b, verdict))
    return 0 if verdict.identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
