"""Compile time against run time of the MXFP8 linear under XLA GPU flag settings.

XLA autotunes GEMM fusions while compiling (the dequantize + bf16 dot of ``dequant_bf16_dot``
becomes a Triton GEMM fusion whose tile configurations are timed one by one), which made the first
training step at GPT-2 124M take ~100 s. Each setting runs in a fresh process (XLA flags are read
once): first call (compile + run) and steady time of ``jax_side.linear.forward`` and ``backward``
at one GPT-2 shape, with the device's default kernels.

    python -m benchmarks.bench_compile --shape 8192x768x3072 \\
        --flags "" "--xla_gpu_autotune_level=0" "--xla_gpu_enable_triton_gemm=false"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp
from jax_side import linear as L
from jax_side.mxfp8 import resolve_kernels
t, k, n = (int(v) for v in sys.argv[1].split("x"))
kern = resolve_kernels(None)
x = (jax.random.normal(jax.random.key(0), (t, k)) ).astype(jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (n, k)) * 0.02
dy = (jax.random.normal(jax.random.key(2), (t, n)) * 0.01).astype(jnp.bfloat16)
wq = L.quantize_weight(w, kernels=kern); jax.block_until_ready(wq)
def fwd():
    return L.forward(x, wq.only("rowwise"), out_dtype=jnp.bfloat16, keep_x_colwise=True,
                     kernels=kern)
t0 = time.perf_counter(); out = fwd(); jax.block_until_ready(out)
first_f = time.perf_counter() - t0
def bwd():
    return L.backward(dy, wq.only("colwise"), out.x_colwise, dx_dtype=jnp.bfloat16,
                      dw_dtype=jnp.float32, kernels=kern)
t0 = time.perf_counter(); g = bwd(); jax.block_until_ready(g)
first_b = time.perf_counter() - t0
def steady(fn, n=20):
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        r = fn()
    jax.block_until_ready(r)
    return (time.perf_counter() - t0) / n
flops = 2 * t * k * n
sf, sb = steady(fwd), steady(bwd)
print(json.dumps({"kernels": kern.reason, "first_forward_s": first_f, "first_backward_s": first_b,
                  "forward_ms": 1e3 * sf, "backward_ms": 1e3 * sb,
                  "forward_tflops": flops / sf / 1e12, "backward_tflops": 2 * flops / sb / 1e12}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="8192x768x3072", help="tokens x in x out")
    p.add_argument("--flags", nargs="*", default=["", "--xla_gpu_autotune_level=0",
                                                  "--xla_gpu_enable_triton_gemm=false"])
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    rows = []
    for flags in args.flags:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        r = subprocess.run([sys.executable, "-c", _CHILD, args.shape], env=env,
                           capture_output=True, text=True, timeout=600)
        if r.returncode:
            rows.append({"flags": flags or "(default)", "error": r.stderr[-600:]})
        else:
            rows.append({"flags": flags or "(default)", **json.loads(r.stdout.splitlines()[-1])})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nshape {args.shape} (tokens x in x out)")
    print("| XLA flags | first fwd s | first bwd s | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['flags']} | error | | | | | |")
            continue
        print(f"| {r['flags']} | {r['first_forward_s']:.1f} | {r['first_backward_s']:.1f} | "
              f"{r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {r['forward_tflops']:.0f} | "
              f"{r['backward_tflops']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
