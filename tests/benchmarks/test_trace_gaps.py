"""``benchmarks/trace_gaps.py``: a trace's GPU idle time inside the step and its longest gaps,
each with what launched the device work after it (correlation id, the innermost Torch op on the
launching thread), when, relative to the gap's start, and what the step's thread was in when the
gap opened."""

from __future__ import annotations

import pytest

from benchmarks.trace_gaps import idle_gaps


def _trace():
    cpu = dict(pid=1, tid=7)
    return [
        dict(cat="cpu_op", name="step", ts=0, dur=2000, **cpu),
        dict(cat="cpu_op", name="FSDP::pre_forward", ts=900, dur=100, **cpu),
        # with --profile-trace's stacks: where the host sat when the first gap opened
        dict(cat="python_function", name="bucket_allocator.py(210): _retire", ts=340, dur=500,
             **cpu),
        dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=50, dur=5,
             args=dict(correlation=1), **cpu),
        dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=60, dur=5,
             args=dict(correlation=2), **cpu),
        dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=950, dur=5,
             args=dict(correlation=3), **cpu),
        dict(cat="cuda_driver", name="cuLaunchKernelEx", ts=150, dur=5,
             args=dict(correlation=4), pid=1, tid=9),
        dict(cat="kernel", name="gemm_a", ts=100, dur=200, args=dict(correlation=1)),
        dict(cat="kernel", name="gemm_overlap", ts=250, dur=100, args=dict(correlation=2)),
        # 350 -> 960: the launch (950) came 600 us after the gap opened: waited for the host
        dict(cat="kernel", name="quant_b", ts=960, dur=40, args=dict(correlation=3)),
        # 1000 -> 1300: launched at 150, long before: waited for something else
        dict(cat="gpu_memcpy", name="Memcpy DtoD", ts=1300, dur=100, args=dict(correlation=4)),
        dict(cat="gpu_memset", name="Memset", ts=1405, dur=10),  # a 5 us gap: below min_us
    ]


def test_idle_time_and_the_longest_gaps_with_what_launched_the_work_after_them():
    lines = idle_gaps(_trace()).splitlines()
    assert lines[0].startswith("GPU span 1.31 ms, busy 0.40 ms, idle 0.92 ms; 2 gaps of 20 us "
                               "or more, 0.91 ms")
    assert lines[0].endswith("first device activity 0.10 ms after the first host op")
    first, second = lines[1].split(), lines[2].split()
    assert first[:4] == ["610", "us", "+600", "us"] and "FSDP::pre_forward" in lines[1]
    assert lines[1].rstrip().endswith("gemm_overlap -> quant_b; host: "
                                      "bucket_allocator.py(210): _retire")
    assert second[:4] == ["300", "us", "-850", "us"] and second[4] == "-"
    assert "cuLaunchKernelEx" in lines[2]
    assert lines[2].rstrip().endswith("quant_b -> Memcpy DtoD; host: step")
    assert len(lines) == 3


def test_a_trace_without_device_activity_says_so():
    assert idle_gaps([dict(cat="cpu_op", name="x", ts=0, dur=1)]) == (
        "no device activity in the trace")


def test_bench_train_step_prints_the_gaps_and_the_copies_from_one_trace():
    """``--profile-gaps`` and ``--profile-copies``: both sections from one exported trace."""
    import argparse
    import json

    from benchmarks.bench_train_step import _trace_sections

    class Prof:
        exports = 0

        def export_chrome_trace(self, path):
            Prof.exports += 1
            with open(path, "w") as f:
                json.dump({"traceEvents": _trace()}, f)

    both = _trace_sections(Prof(), argparse.Namespace(profile_copies=True, profile_gaps=True))
    assert Prof.exports == 1
    assert "where its copies come from\ncopies: 0.10 ms in 1 calls" in both
    assert "where the GPU stands idle\nGPU span 1.31 ms" in both
    gaps = _trace_sections(Prof(), argparse.Namespace(profile_copies=False, profile_gaps=True))
    assert "copies" not in gaps.split("idle\n")[0] and "GPU span" in gaps
    assert _trace_sections(Prof(), argparse.Namespace(profile_copies=False,
                                                      profile_gaps=False)) == ""


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")
def test_profile_trace_saves_the_step_trace_with_python_stacks(tmp_path):
    """``--profile-trace DIR``: the profiled step's Chrome trace, gzipped, named by run and rank,
    with Python frames (what ``idle_gaps`` reports the host in); ``--profile-gaps`` beside it
    reads that file (a profile exports its trace only once: a second export raised)."""
    import argparse
    import gzip
    import json
    from types import SimpleNamespace

    from benchmarks.bench_train_step import _profile

    args = argparse.Namespace(device="cpu", batch_size=2, seq_len=4, profile_trace=str(tmp_path),
                              profile_copies=True, profile_gaps=True, profile_top=3)

    def step(tokens, targets):
        return (tokens.float() @ targets.float().T).sum()

    tables = _profile(step, SimpleNamespace(vocab_size=50), args, 1, "mxfp8:u4")[-1]
    assert "where the GPU stands idle\nno device activity in the trace" in tables
    (path,) = tmp_path.iterdir()
    assert path.name == "mxfp8_u4.rank1.trace.json.gz"
    events = json.load(gzip.open(path))["traceEvents"]
    cats = {e.get("cat") for e in events}
    assert {"cpu_op", "python_function"} <= cats
    assert any(e.get("name") == "aten::mm" for e in events)
