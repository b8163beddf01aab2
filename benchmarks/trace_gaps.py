"""Where a profiled step's GPU stands idle (``bench_train_step --profile-gaps``).

A step's wall time exceeds its GPU time wherever no kernel, copy or memset runs: before the
first launch, and in gaps where the GPU waited for the host (the next launch came late) or for
a dependency (an event, a synchronization). This reads the profile's trace: the device
activity's union over the step, its span (first start to last end), the idle time inside the
span, and the longest gaps, each with the device activity on either side, the runtime call that
launched the one after (matched by correlation id) and the innermost Torch op around that call
on its thread (``-`` where none: JAX's and XLA's own launches), **when it was launched
relative to the gap** (a launch after the gap opened means the GPU waited for the host; one
before means it waited for something else, a dependency the launch had to wait for), and **what
the host was doing when the gap opened**: the innermost op on the step's thread (the one with
the most ops) at that moment -- a Python function where the trace has stacks
(``bench_train_step --profile-trace``), e.g. a synchronization the host sat in.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from benchmarks.bench_train_step import _union
from benchmarks.trace_copies import _innermost, load_trace

_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def idle_gaps(events: list[dict[str, Any]], top: int = 12, min_us: float = 20.0) -> str:
    """The GPU's idle time in a Chrome trace's ``traceEvents`` (module note), and its ``top``
    longest gaps of at least ``min_us`` microseconds."""
    device = sorted((e for e in events if e.get("cat") in _DEVICE and "dur" in e),
                    key=lambda e: e["ts"])
    if not device:
        return "no device activity in the trace"
    launches, ops = {}, defaultdict(list)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
        elif e.get("cat") in ("cpu_op", "python_function"):
            ops[(e.get("pid"), e.get("tid"))].append(e)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in device])
    span = busy[-1][1] - busy[0][0]
    host = [op["ts"] for thread in ops.values() for op in thread]
    lead = f"; first device activity {(busy[0][0] - min(host)) / 1e3:.2f} ms after the first " \
        f"host op" if host else ""
    idle = span - sum(b - a for a, b in busy)
    gaps = sorted(((start - end, end, start) for (_, end), (start, _) in zip(
        busy[:-1], busy[1:], strict=True) if start - end >= min_us), key=lambda g: -g[0])
    lines = [f"GPU span {span / 1e3:.2f} ms, busy {(span - idle) / 1e3:.2f} ms, idle "
             f"{idle / 1e3:.2f} ms; {len(gaps)} gaps of {min_us:g} us or more, "
             f"{sum(g[0] for g in gaps) / 1e3:.2f} ms (the longest: us, launched vs the gap's "
             f"start, Torch op around the launch, runtime call, device activity before -> "
             f"after; host at the gap's start){lead}"]
    main = max(ops.values(), key=len) if ops else []
    for us, at, until in gaps[:top]:  # only the listed gaps' neighbours are looked up
        before = max((e for e in device if e["ts"] + e["dur"] <= at + 1e-6),
                     key=lambda e: e["ts"] + e["dur"])
        after = next(e for e in device if e["ts"] >= until - 1e-6)
        call = launches.get(after.get("args", {}).get("correlation"))
        if call is None:
            when, op, api = "?", "-", "?"
        else:
            lag = call["ts"] - at
            when = f"{'+' if lag >= 0 else ''}{lag:.0f} us"
            op = _innermost(ops[(call.get("pid"), call.get("tid"))], call["ts"])
            api = str(call["name"])
        lines.append(f"  {us:8.0f} us  {when:>10s}  {op[:36]:36s} {api[:22]:22s} "
                     f"{str(before['name'])[:40]} -> {str(after['name'])[:40]}; host: "
                     f"{_innermost(main, at + 1)[:70]}")
    return "\n".join(lines)


def profile_gaps(prof: Any, top: int = 12) -> str:
    """``idle_gaps`` of a finished ``torch.profiler.profile``."""
    return idle_gaps(load_trace(prof), top)
