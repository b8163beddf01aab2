"""One linear layer's training work (forward: quantize x + GEMM; backward: quantize dy + dgrad +
wgrad) at the 1.3B GPT's shapes, per GEMM path, against the bf16 layer (issue 33).

Runs, each one jitted forward program and one jitted backward program, as the unit programs run
them (``jax_side.linear.forward`` / ``backward``; weights given as MXFP8 planes, x and dy bf16):

- ``bf16``: bf16 dots with fp32 accumulation (cuBLAS), no quantization: what FSDP2 bf16 runs;
- ``dequant_bf16_dot``: the exact MXFP8 GEMM, the GPU default;
- ``fp8_blocked_planes``: the ``fp8_blocked`` GEMM on MXFP8 planes re-blocked inside every GEMM
  (the linear layer's path before the blocked operands; composed here from ``quantize`` and
  ``matmul``);
- ``fp8_blocked``: the linear layer's path now: x and dy quantized straight into the GEMM's
  operands (``blocked_operands``), x^T tiles kept for wgrad.

Times are the mean of ``--iters`` back-to-back calls after warm-up (ms), with the ratio
``bf16 / run`` (above 1: faster than bf16).

    python3 benchmarks/bench_linear_layer.py --out linear.json     # GPU
    python3 benchmarks/bench_linear_layer.py --smoke               # CPU: one tiny layer
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.bench_fp8_gemm import timed  # noqa: E402
from common.formats import Plane  # noqa: E402
from common.kernels import KernelConfig  # noqa: E402
from jax_side import linear as L  # noqa: E402
from jax_side import mxfp8  # noqa: E402
from jax_side.mxfp8.kernels import resolve_kernels  # noqa: E402

# (tokens, in features K, out features N) of the 1.3B GPT at 8 x 1024 tokens
LAYERS = {"qkv": (8192, 2048, 6144), "proj": (8192, 2048, 2048), "fc1": (8192, 2048, 8192),
          "fc2": (8192, 8192, 2048)}
RUNS = ("bf16", "dequant_bf16_dot", "fp8_blocked_planes", "fp8_blocked")
_BF16 = jnp.bfloat16


def _timed(fn: Any, *args: Any, iters: int) -> float:
    return timed(fn, *args, iters=iters) * 1e3  # ms


def _bf16_programs() -> tuple[Any, Any]:
    def fwd(x: jax.Array, w: jax.Array) -> jax.Array:
        return lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(_BF16)

    def bwd(dy: jax.Array, x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        dx = lax.dot_general(dy, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        dw = lax.dot_general(dy, x, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dx.astype(_BF16), dw

    return jax.jit(fwd), jax.jit(bwd)


def _plane_programs(k: Any) -> tuple[Any, Any]:
    """The linear layer's fp8_blocked path before the blocked operands: MXFP8 planes, re-blocked
    (and, for wgrad, transposed) inside every GEMM."""

    def fwd(x: jax.Array, w: mxfp8.MXFP8Tensor) -> tuple[jax.Array, mxfp8.MXFP8Tensor]:
        xq = mxfp8.quantize(L.pad_tokens(x), kernels=k)
        y = mxfp8.matmul(xq, w, "forward", out_dtype=_BF16, kernels=k)[: x.shape[0]]
        return y, xq.only(Plane.COLWISE)

    def bwd(dy: jax.Array, w: mxfp8.MXFP8Tensor,
            xc: mxfp8.MXFP8Tensor) -> tuple[jax.Array, jax.Array]:
        dyq = mxfp8.quantize(L.pad_tokens(dy), kernels=k)
        dx = mxfp8.matmul(dyq, w, "dgrad", out_dtype=_BF16, kernels=k)[: dy.shape[0]]
        return dx, mxfp8.matmul(dyq, xc, "wgrad", kernels=k)

    return jax.jit(fwd), jax.jit(bwd)


def layer_row(name: str, t: int, kdim: int, n: int, iters: int) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (t, kdim), jnp.float32).astype(_BF16)
    w = jax.random.normal(keys[1], (n, kdim), jnp.float32) * 0.02
    dy = jax.random.normal(keys[2], (t, n), jnp.float32).astype(_BF16)
    row: dict[str, Any] = {"layer": name, "shape": [t, kdim, n]}
    fwd, bwd = _bf16_programs()
    wb = w.astype(_BF16)
    row["bf16_fwd_ms"] = _timed(fwd, x, wb, iters=iters)
    row["bf16_bwd_ms"] = _timed(bwd, dy, x, wb, iters=iters)
    for run in RUNS[1:]:
        gemm = "fp8_blocked" if run.startswith("fp8_blocked") else run
        k = resolve_kernels(KernelConfig(gemm=gemm))
        wq = L.quantize_weight(w, kernels=k)
        wr, wc = wq.only(Plane.ROWWISE), wq.only(Plane.COLWISE)
        if run == "fp8_blocked_planes":
            f, b = _plane_programs(k)
            kept = f(x, wr)[1]
            row[f"{run}_fwd_ms"] = _timed(f, x, wr, iters=iters)
            row[f"{run}_bwd_ms"] = _timed(b, dy, wc, kept, iters=iters)
            continue
        fl = jax.jit(lambda x, w, k=k: L.forward(x, w, out_dtype=_BF16, keep_x_colwise=True,
                                                 kernels=k))
        kept = fl(x, wr).x_colwise
        bl = jax.jit(lambda dy, w, kept, k=k: L.backward(dy, w, kept, dx_dtype=_BF16,
                                                         dw_dtype=jnp.float32, kernels=k))
        row[f"{run}_fwd_ms"] = _timed(fl, x, wr, iters=iters)
        row[f"{run}_bwd_ms"] = _timed(bl, dy, wc, kept, iters=iters)
    for run in RUNS:
        row[f"{run}_ms"] = row[f"{run}_fwd_ms"] + row[f"{run}_bwd_ms"]
        row[f"{run}_vs_bf16"] = row["bf16_ms"] / row[f"{run}_ms"]
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="one tiny layer (runs on a CPU)")
    args = p.parse_args(argv)
    gpu = jax.devices()[0].platform == "gpu"
    if args.smoke:
        rows = [layer_row("smoke", 128, 128, 256, 1)]
    elif not gpu:
        p.error("no GPU: the timings mean nothing on a CPU; run with --smoke to check the script")
    else:
        rows = [layer_row(name, *shape, args.iters) for name, shape in LAYERS.items()]
    result = {"layers": rows, "device": str(jax.devices()[0]), "jax": jax.__version__}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
