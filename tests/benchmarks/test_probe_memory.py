"""``benchmarks/probe_memory.py`` on the CPU (tiny GPT): every phase is reported, the live JAX
arrays after the forward include the residuals, and each unit program has an analysis."""

from __future__ import annotations

import re

from benchmarks import probe_memory


def test_the_probe_reports_each_phase_the_residuals_and_the_programs(capfd):
    probe_memory.main(["--device", "cpu", "--config", "tiny", "--run", "mxfp8:u2",
                       "--batch-size", "2", "--seq-len", "64", "--top", "40"])
    out = capfd.readouterr().out
    for phase in ("start", "forward", "backward", "optimizer"):
        assert re.search(rf"^\s*{phase}: torch .* jax .* GiB$", out, re.M), (phase, out)
    live = out.split("JAX live arrays after the forward:")[1].split("Torch CUDA storages")[0]
    assert re.search(r"float8_e4m3fn", live), live  # the linears' x colwise planes
    programs = out.split("unit programs (XLA memory_analysis")[1]
    assert "unit_forward" in programs and "unit_backward" in programs, programs
