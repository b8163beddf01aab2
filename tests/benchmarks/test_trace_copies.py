"""``benchmarks/trace_copies.py``: a trace's copies grouped by the Torch op and runtime call that
launched them (matched by correlation id, the innermost op on the launching thread)."""

from __future__ import annotations

from benchmarks.trace_copies import copy_sources


def _trace():
    cpu = dict(pid=1, tid=7)
    return [
        dict(cat="cpu_op", name="aten::copy_", ts=100, dur=50, **cpu),
        dict(cat="cpu_op", name="FSDP::refresh", ts=90, dur=200, **cpu),
        dict(cat="cuda_runtime", name="cudaMemcpyAsync", ts=110, dur=5, args=dict(correlation=1),
             **cpu),
        dict(cat="cuda_runtime", name="cudaMemcpyAsync", ts=200, dur=5, args=dict(correlation=2),
             **cpu),
        dict(cat="cuda_driver", name="cuMemcpyDtoDAsync_v2", ts=400, dur=5,
             args=dict(correlation=3), pid=1, tid=9),
        dict(cat="gpu_memcpy", name="Memcpy DtoD (Device -> Device)", ts=500, dur=2000,
             args=dict(correlation=1, bytes=4096)),
        dict(cat="gpu_memcpy", name="Memcpy DtoD (Device -> Device)", ts=600, dur=1000,
             args=dict(correlation=2, bytes=64)),
        dict(cat="gpu_memcpy", name="Memcpy DtoD (Device -> Device)", ts=700, dur=500,
             args=dict(correlation=3, bytes=64)),
        dict(cat="kernel", name="memcpy128", ts=800, dur=250, args=dict(correlation=3)),
        dict(cat="kernel", name="nvjet_gemm", ts=900, dur=9000, args=dict(correlation=3)),
    ]


def test_copies_are_grouped_by_what_launched_them():
    text = copy_sources(_trace())
    lines = text.splitlines()
    assert lines[0].startswith("copies: 3.75 ms in 4 calls")
    assert "aten::copy_" in lines[1] and "cudaMemcpyAsync" in lines[1] and lines[1].endswith(
        "4096") and "2.000 ms" in lines[1]
    assert "FSDP::refresh" in lines[2] and "1.000 ms" in lines[2]  # the innermost op around it
    assert lines[3].split()[3] == "-" and "cuMemcpyDtoDAsync_v2" in lines[3]  # no Torch op
    assert "memcpy128" in lines[4] and "nvjet" not in text
    assert lines[-1] == "by Torch op: aten::copy_ 2.00, FSDP::refresh 1.00, - 0.75"
