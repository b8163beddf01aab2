"""Where a profiled step's device copies come from (``bench_train_step --profile-copies``).

torch.profiler sees every ``Memcpy`` / ``memcpy*`` on the GPU, XLA's included, but its tables do
not say what launched them. This reads the profile's trace: each copy is matched through its
correlation id to the runtime call that launched it (``cudaMemcpyAsync``, ``cuMemcpyDtoDAsync``,
a kernel launch) and to the innermost Torch op around that call on the same thread (``-`` where
none: JAX's and XLA's own launches). Copies are grouped by (Torch op, runtime call, bytes) and
listed by their device time.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections import defaultdict
from typing import Any


def _is_copy(e: dict[str, Any]) -> bool:
    return e.get("cat") == "gpu_memcpy" or (
        e.get("cat") == "kernel" and str(e.get("name", "")).lower().startswith("memcpy"))


def _innermost(ops: list[dict[str, Any]], ts: float) -> str:
    """The name of the shortest op in ``ops`` (one thread's) that spans ``ts``, '-' if none."""
    best = None
    for op in ops:
        if op["ts"] <= ts <= op["ts"] + op.get("dur", 0) and (
                best is None or op.get("dur", 0) < best.get("dur", 0)):
            best = op
    return "-" if best is None else str(best["name"])


def copy_sources(events: list[dict[str, Any]], top: int = 25) -> str:
    """The copies of a Chrome trace's ``traceEvents`` grouped by what launched them."""
    launches = {}
    ops: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        cat = e.get("cat")
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
        elif cat == "cpu_op":
            ops[(e.get("pid"), e.get("tid"))].append(e)
    groups: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if not _is_copy(e):
            continue
        call = launches.get(e.get("args", {}).get("correlation"))
        api = "?" if call is None else str(call["name"])
        op = "-" if call is None else _innermost(ops[(call.get("pid"), call.get("tid"))],
                                                 call["ts"])
        key = (op, f"{api} / {e['name']}", int(e.get("args", {}).get("bytes", -1)))
        groups[key][0] += e.get("dur", 0) / 1e3
        groups[key][1] += 1
    rows = sorted(((ms, n, key) for key, (ms, n) in groups.items()), reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"copies: {total:.2f} ms in {sum(r[1] for r in rows)} calls "
             f"(Torch op around the launch, runtime call / copy, bytes)"]
    lines += [f"  {ms:8.3f} ms {n:5d}x  {op[:40]:40s} {what[:60]:60s} {b}"
              for ms, n, (op, what, b) in rows[:top]]
    by_op: dict[str, float] = defaultdict(float)
    for ms, _, (op, _, _) in rows:
        by_op[op] += ms
    lines.append("by Torch op: " + ", ".join(f"{op} {ms:.2f}" for op, ms in
                                              sorted(by_op.items(), key=lambda kv: -kv[1])[:8]))
    return "\n".join(lines)


def load_trace(prof: Any, saved: str = "") -> list[dict[str, Any]]:
    """The ``traceEvents`` of a finished ``torch.profiler.profile`` (its Chrome trace), read
    from ``saved`` where the trace was exported there already (a profile exports only once;
    ``.gz``: gzipped)."""
    if saved:
        with (gzip.open(saved, "rt") if saved.endswith(".gz") else open(saved)) as f:
            return json.load(f).get("traceEvents", [])
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return trace.get("traceEvents", [])


def profile_copies(prof: Any, top: int = 25) -> str:
    """``copy_sources`` of a finished ``torch.profiler.profile``."""
    return copy_sources(load_trace(prof), top)
