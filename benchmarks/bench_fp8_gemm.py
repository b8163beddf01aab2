"""The ``fp8_blocked`` GEMMs (DESIGN.md 11, issue 33) against bf16 and today's MXFP8 GEMM.

Per GEMM shape (M, K, N: out (M, N) = a (M, K) @ b (N, K)^T), TFLOP/s and the ratio to the bf16
dot in the same run:

- ``bf16``: ``lax.dot_general`` of bf16 operands, fp32 accumulation (cuBLAS on a GPU);
- ``dequant_bf16_dot``: today's GPU default on MXFP8 operands (dequantize to bf16 + bf16 dot);
- ``cublaslt``: cuBLASLt's block-scaled FP8 GEMM alone (``jax_side.mxfp8.cublaslt``) on operands
  already re-blocked;
- ``kernel[bm,bn,w,s]``: the Pallas FP8 kernel alone on operands already re-blocked, for each
  tile configuration of ``--tiles``;
- ``fp8_blocked`` / ``fp8_blocked_pallas``: ``matmul(..., impl=...)`` on MXFP8 operands,
  re-blocking included (what a training step pays when nothing is re-blocked ahead);
- ``*_from_bf16``: the same from the bf16 operands, their MXFP8 quantization (the rowwise plane,
  the one the forward GEMM reads) counted too: ``dequant_bf16_dot_from_bf16`` and
  ``fp8_blocked_from_bf16``;
- ``torch_scaled_mm``: PyTorch's block-scaled FP8 GEMM (``torch.nn.functional.scaled_mm``,
  ``BlockWise1x128`` x ``BlockWise128x128``, bf16 out) on the same re-blocked bytes, shared with
  Torch through DLPack (a comparison, not a product path: issue 33); beside its time, its largest
  difference to the ``cublaslt`` GEMM's bf16 result relative to that result's largest magnitude
  (``torch_scaled_mm_rel_diff``), or the error Torch raised (``torch_scaled_mm_error``);
  ``torch_bf16``: ``torch.mm`` of the bf16 operands, timed the same way (Torch's eager dispatch
  costs less per call than a jitted JAX call, which the small shapes' JAX columns include);
- ``*_kernel_ms``: GPU kernel time per call from torch.profiler (which sees XLA's kernels too)
  for ``bf16``, ``cublaslt``, ``torch_bf16`` and ``torch_scaled_mm``: the GEMMs themselves,
  without any host dispatch; ``cublaslt_gemm_kernel_ms``: of the jitted cuBLASLt call, only the
  GEMM kernel (``bench_train_step.kernel_category`` "gemm"), without the small XLA kernels that
  arrange its fp32 scales (``cublaslt._scales``; ``cublaslt_scales_kernel_ms`` is their time):
  the issue's "GEMM alone", as ``torch_scaled_mm`` is timed on scales made beforehand.

And for each linear layer of the 350M and 1.3B GPTs (qkv, proj, fc1, fc2 at 8 x 1024 tokens), the
three training roles (forward, dgrad, wgrad) through ``matmul`` on MXFP8 operands: fp8_blocked
(both kernels; re-block and transposes included) and dequant_bf16_dot, each beside the bf16 dot
of the same role from the bf16 sources (``*_vs_bf16``). Each time is the mean of
``--iters`` calls after warm-up, dispatched back to back (the host does not wait between calls).

    python3 benchmarks/bench_fp8_gemm.py --out fp8_gemm.json          # GPU
    python3 benchmarks/bench_fp8_gemm.py --role-gemms --tiles "" --no-torch  # GEMMs by role
    python3 benchmarks/bench_fp8_gemm.py --smoke                      # CPU: tiny, interpreted
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from jax_side import mxfp8  # noqa: E402
from jax_side.mxfp8 import cublaslt  # noqa: E402
from jax_side.mxfp8.fp8_blocked_kernel import Tile, blocked_matmul  # noqa: E402
from jax_side.mxfp8.reblock import (  # noqa: E402
    Reblocked,
    reblock_rows,
    reblock_tiles,
    scale_fp32,
)

SHAPES = [  # (M, K, N): issue 33's table and the 1.3B GPT's linears at 8 x 1024 tokens
    (16384, 768, 3072), (16384, 3072, 768), (3072, 16384, 768), (16384, 1024, 4096),
    (16384, 4096, 1024), (8192, 8192, 8192), (8192, 2048, 6144), (8192, 2048, 8192),
    (8192, 8192, 2048),
]
TILES = ["128,128,8,3"]  # the best of 128x128/128x256/256x128, 4/8 warps, 3/4 stages on an H200
# The 350M and 1.3B GPT linears at 8 x 1024 tokens: (tokens, in features, out features)
ROLE_SHAPES = {f"{name}.{layer}": (8192, i, o)
               for name, d, ff in (("350m", 1024, 4096), ("1.3b", 2048, 8192))
               for layer, (i, o) in {"qkv": (d, 3 * d), "proj": (d, d), "fc1": (d, ff),
                                     "fc2": (ff, d)}.items()}
# The GEMM (M, K, N) of each role of a linear of T tokens, I in and O out features
ROLE_GEMM = {"forward": lambda t, i, o: (t, i, o), "dgrad": lambda t, i, o: (t, o, i),
             "wgrad": lambda t, i, o: (o, t, i)}


def role_gemm_shapes() -> list[tuple[int, int, int]]:
    """Every distinct GEMM shape of ``ROLE_SHAPES`` in the three roles, in order."""
    shapes = [f(*dims) for dims in ROLE_SHAPES.values() for f in ROLE_GEMM.values()]
    return list(dict.fromkeys(shapes))


# Each role as a bf16 dot (fp32 accumulation, cuBLAS through XLA) of x (T, I), w (O, I), dy (T, O)
BF16_ROLES = {"forward": (lambda x, w, dy: (x, w), (((1,), (1,)), ((), ()))),
              "dgrad": (lambda x, w, dy: (dy, w), (((1,), (0,)), ((), ()))),
              "wgrad": (lambda x, w, dy: (dy, x), (((0,), (0,)), ((), ())))}


def timed(fn: Any, *args: Any, iters: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    for _ in range(2):
        out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def _operands(m: int, k: int, n: int) -> tuple[jax.Array, jax.Array]:
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
    return a, b


def _rowwise(t: mxfp8.MXFP8Tensor) -> tuple[jax.Array, jax.Array]:
    d, s = t.plane("rowwise")
    return d, lax.bitcast_convert_type(s, jnp.uint8)


def torch_blockwise(ra: Reblocked, rb: Reblocked) -> tuple[Any, Any, Any, Any]:
    """The operands of ``torch.nn.functional.scaled_mm`` for ``ra @ rb^T`` (a in 1x128 blocks, b
    in 128x128 tiles): a (M, K) and b^T (K, N) as float8_e4m3fn views of the same device bytes
    (DLPack), and fp32 scales laid out as Torch's blockwise recipes ask -- a's (M, K/128)
    outer-dim-major (stride 1 along M), b's tile scales (N/128, K/128) with K/128 padded to a
    multiple of 4, transposed to (K/128 padded, N/128)."""
    import torch

    def shared(x: jax.Array) -> Any:
        return torch.from_dlpack(x)

    a = shared(lax.bitcast_convert_type(ra.data, jnp.uint8)).view(torch.float8_e4m3fn)
    b = shared(lax.bitcast_convert_type(rb.data, jnp.uint8)).view(torch.float8_e4m3fn)
    sa = shared(scale_fp32(ra.scale)).t().contiguous().t()
    sb = scale_fp32(rb.scale)
    sb = shared(jnp.pad(sb, ((0, 0), (0, -sb.shape[1] % 4)), constant_values=1.0)).t()
    return a, b.t(), sa, sb


def kernel_ms(run: Any, iters: int, category: str | None = None) -> float:
    """GPU kernel time per call of ``run()`` (ms; torch.profiler, which sees XLA's kernels too):
    what the GEMM costs inside a program, without the host's dispatch of each call; with
    ``category``, only the kernels ``bench_train_step.kernel_category`` puts there."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def call_and_wait() -> None:
        out = run()
        if isinstance(out, jax.Array):
            out.block_until_ready()
        torch.cuda.synchronize()

    call_and_wait()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            out = run()
        if isinstance(out, jax.Array):
            out.block_until_ready()
        torch.cuda.synchronize()
    from benchmarks.bench_train_step import kernel_category

    spans = [e.time_range.end - e.time_range.start for e in prof.events()
             if str(getattr(e, "device_type", "")).endswith("CUDA")
             and not getattr(e, "is_user_annotation", False)
             and (category is None or kernel_category(e.name) == category)]
    return sum(spans) / iters / 1e3


def _torch_scaled_mm(a16: jax.Array, b16: jax.Array, ra: Reblocked, rb: Reblocked,
                     iters: int) -> dict[str, Any]:
    """``torch_scaled_mm_ms`` and its difference to the cuBLASLt GEMM, ``torch_bf16_ms``
    (``torch.mm`` of the bf16 operands), and the kernel times of those two, of cuBLASLt and of the
    JAX bf16 dot (``*_kernel_ms``); or the error Torch raised."""
    import torch
    import torch.nn.functional as F

    try:
        a, bt, sa, sb = torch_blockwise(ra, rb)
        ta, tb = torch.from_dlpack(a16), torch.from_dlpack(b16)

        def run() -> Any:
            return F.scaled_mm(a, bt, sa, F.ScalingType.BlockWise1x128, sb,
                               F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)

        def bf16() -> Any:
            return torch.mm(ta, tb.t())

        out = run()
        ref = torch.from_dlpack(cublaslt.blocked_gemm(ra, rb, out_dtype=jnp.bfloat16)).float()
        rel = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        row: dict[str, Any] = {"torch_scaled_mm_rel_diff": rel}
        for name, fn in (("torch_scaled_mm", run), ("torch_bf16", bf16)):
            torch.cuda.synchronize()
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            row[f"{name}_ms"] = (time.perf_counter() - t0) / iters * 1e3
        lt = jax.jit(lambda x, y: cublaslt.blocked_gemm(x, y, out_dtype=jnp.bfloat16))
        dot = jax.jit(lambda x, y: lax.dot_general(x, y, (((1,), (1,)), ((), ())),
                                                   preferred_element_type=jnp.float32))
        for name, fn in (("torch_scaled_mm", run), ("torch_bf16", bf16),
                         ("cublaslt", lambda: lt(ra, rb)), ("bf16", lambda: dot(a16, b16))):
            row[f"{name}_kernel_ms"] = kernel_ms(fn, iters)
        row["cublaslt_gemm_kernel_ms"] = kernel_ms(lambda: lt(ra, rb), iters, category="gemm")
        row["cublaslt_scales_kernel_ms"] = (row["cublaslt_kernel_ms"]
                                            - row["cublaslt_gemm_kernel_ms"])
        return row
    except Exception as e:  # this Torch or device has no blockwise FP8 GEMM: recorded, not fatal
        return {"torch_scaled_mm_error": f"{type(e).__name__}: {str(e)[:300]}"}


def gemm_rows(shapes: list[tuple[int, int, int]], tiles: list[Tile], iters: int,
              interpret: bool, torch_too: bool = True) -> list[dict[str, Any]]:
    rows = []
    for m, k, n in shapes:
        a, b = _operands(m, k, n)
        qa, qb = mxfp8.quantize(a), mxfp8.quantize(b)
        ra, rb = reblock_rows(*_rowwise(qa)), reblock_tiles(*_rowwise(qb))
        flops = 2.0 * m * k * n
        row: dict[str, Any] = {"shape": [m, k, n]}
        bf16 = jax.jit(lambda x, y: lax.dot_general(x, y, (((1,), (1,)), ((), ())),
                                                    preferred_element_type=jnp.float32))
        row["bf16_ms"] = timed(bf16, a, b, iters=iters) * 1e3
        fns = {}
        if not interpret:
            fns["dequant_bf16_dot"] = (jax.jit(
                lambda x, y: mxfp8.matmul(x, y, "forward", impl="dequant_bf16_dot")), (qa, qb))
            for impl in ("fp8_blocked", "fp8_blocked_pallas")[: 2 if tiles else 1]:
                fns[impl] = (jax.jit(
                    lambda x, y, i=impl: mxfp8.matmul(x, y, "forward", impl=i)), (qa, qb))
            fns["cublaslt"] = (jax.jit(lambda x, y: cublaslt.blocked_gemm(x, y)), (ra, rb))
            for impl in ("dequant_bf16_dot", "fp8_blocked"):
                fns[f"{impl}_from_bf16"] = (jax.jit(
                    lambda x, y, i=impl: mxfp8.matmul(mxfp8.quantize(x, planes="rowwise"),
                                                      mxfp8.quantize(y, planes="rowwise"),
                                                      "forward", impl=i)), (a, b))
        if not interpret and torch_too:
            row.update(_torch_scaled_mm(a, b, ra, rb, iters))
        for tile in tiles:
            name = "kernel[{},{},{},{}]".format(*tile.key())
            fns[name] = (jax.jit(lambda x, y, t=tile: blocked_matmul(
                x, y, tile=t, interpret=interpret)), (ra, rb))
        for name, (fn, args) in fns.items():
            try:
                row[f"{name}_ms"] = timed(fn, *args, iters=iters) * 1e3
            except Exception as e:  # a tile that does not compile is recorded, not fatal
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for key in [k_ for k_ in row if k_.endswith("_ms")]:
            row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
            row[key.replace("_ms", "_vs_bf16")] = row["bf16_ms"] / row[key]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def role_rows(iters: int, pallas: bool = True) -> list[dict[str, Any]]:
    """Each ``ROLE_SHAPES`` linear in its three roles through ``mxfp8.matmul`` (MXFP8 operands in;
    the fp8_blocked columns count their re-block passes), beside the bf16 dot of the sources."""
    rows = []
    impls = ("dequant_bf16_dot", "fp8_blocked", "fp8_blocked_pallas")[: 3 if pallas else 2]
    for name, (t, i, o) in ROLE_SHAPES.items():
        x, w = _operands(t, i, o)
        dy = _operands(t, o, 1)[0]
        qx, qw, qdy = mxfp8.quantize(x), mxfp8.quantize(w), mxfp8.quantize(dy)
        for role, (a, b) in {"forward": (qx, qw), "dgrad": (qdy, qw),
                             "wgrad": (qdy, qx)}.items():
            row: dict[str, Any] = {"layer": name, "role": role}
            pick, dims = BF16_ROLES[role]
            bf16 = jax.jit(lambda p, q, d=dims: lax.dot_general(
                p, q, d, preferred_element_type=jnp.float32))
            row["bf16_ms"] = timed(bf16, *pick(x, w, dy), iters=iters) * 1e3
            for impl in impls:
                fn = jax.jit(lambda p, q, r=role, m=impl: mxfp8.matmul(p, q, r, impl=m))
                row[f"{impl}_ms"] = timed(fn, a, b, iters=iters) * 1e3
                row[f"{impl}_vs_bf16"] = row["bf16_ms"] / row[f"{impl}_ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tiles", default=";".join(TILES),
                   help="';'-separated bm,bn,warps,stages of the kernel configurations to time "
                        "('' leaves the Pallas kernel out, fp8_blocked_pallas too)")
    p.add_argument("--no-torch", action="store_true",
                   help="leave out the torch_scaled_mm column (PyTorch's blockwise FP8 GEMM)")
    p.add_argument("--role-gemms", action="store_true",
                   help="the GEMM table over every 350M / 1.3B linear's forward, dgrad and "
                        "wgrad shape (role_gemm_shapes) instead of SHAPES; no matmul role table")
    p.add_argument("--smoke", action="store_true",
                   help="one 128x128x128 shape, the kernel interpreted (runs on a CPU)")
    args = p.parse_args(argv)
    tiles = [Tile(*map(int, t.split(","))) for t in args.tiles.split(";") if t]
    gpu = jax.devices()[0].platform == "gpu"
    if args.smoke:
        result = {"gemm": gemm_rows([(128, 128, 128)], tiles[:1], 1, interpret=not gpu)}
    elif not gpu:
        p.error("no GPU: the timings mean nothing on a CPU; run with --smoke to check the script")
    else:
        shapes = role_gemm_shapes() if args.role_gemms else SHAPES
        result = {"cublaslt": cublaslt.status().reason,
                  "gemm": gemm_rows(shapes, tiles, args.iters, interpret=False,
                                    torch_too=not args.no_torch)}
        if not args.role_gemms:
            result["roles"] = role_rows(args.iters, pallas=bool(tiles))
    result["device"] = str(jax.devices()[0])
    result["jax"] = jax.__version__
    result["numpy"] = np.__version__
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
