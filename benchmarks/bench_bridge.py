"""Benchmark the bridge: per-call overhead of to_jax / to_torch, and mxfp8_linear fwd+bwd vs JAX.

Not a test: it prints a markdown table (and one JSON line per row with ``--json``) for
BENCHMARKS.md. Timings are medians over ``--repeat`` calls after ``--warmup`` calls; GPU timings
synchronize both Torch and JAX after every call, so they are latency, not throughput.

Rows:
- ``to_jax`` / ``to_torch``: the bridge call (checks + DLPack) next to the raw DLPack call it wraps
  (``jax.dlpack.from_dlpack`` / ``torch.from_dlpack``), per dtype and transport.
- ``linear``: Torch ``mxfp8_linear`` forward + backward (quantize x, W and dy, three MXFP8 GEMMs,
  all DLPack hops) against one ``jax.jit`` of the pure-JAX reference's ``jax.vjp`` (same
  quantization points, no Torch, no DLPack).

Usage: ``python benchmarks/bench_bridge.py --device cpu`` (or ``--device cuda``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import jax
import torch

import bridge
from bridge import Fp8Transport, mxfp8_linear, to_jax, to_torch
from jax_side.linear_reference import mxfp8_linear_reference


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_us(fn, *, repeat: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        if isinstance(out, jax.Array):
            jax.block_until_ready(out)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


_CONVERSION_CASES = [
    (torch.float32, None),
    (torch.bfloat16, None),
    (torch.uint8, None),
    (torch.float8_e4m3fn, Fp8Transport.NATIVE),
    (torch.float8_e4m3fn, Fp8Transport.UINT8),
    (torch.float8_e8m0fnu, Fp8Transport.NATIVE),
    (torch.float8_e8m0fnu, Fp8Transport.UINT8),
]


def _conversion_case(device, numel, dtype, transport, kw) -> list[dict]:
    t = torch.zeros(numel, dtype=dtype, device=device)
    a = to_jax(t, transport=transport)
    raw_src = t.view(torch.uint8) if transport is Fp8Transport.UINT8 else t
    name = str(dtype).removeprefix("torch.") + (f" ({transport.value})" if transport else "")
    case = f"{name}, {numel} elems"
    return [
        {
            "what": "to_jax",
            "case": case,
            "bridge_us": _median_us(lambda: to_jax(t, transport=transport), **kw),
            "raw_us": _median_us(lambda: jax.dlpack.from_dlpack(raw_src), **kw),
        },
        {
            "what": "to_torch",
            "case": case,
            "bridge_us": _median_us(lambda: to_torch(a, transport=transport), **kw),
            "raw_us": _median_us(lambda: torch.from_dlpack(a), **kw),
        },
    ]


def _conversion_rows(device: str, args) -> list[dict]:
    kw = dict(repeat=args.repeat, warmup=args.warmup, device=device)
    rows = []
    for numel in args.numels:
        for dtype, transport in _CONVERSION_CASES:
            rows += _conversion_case(device, numel, dtype, transport, kw)
    return rows


@jax.jit
def _jax_fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(mxfp8_linear_reference, x, w)
    return (y, *vjp(dy))


def _linear_case(device, tokens, k, n, kw) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16).to(device).requires_grad_()
    w = (torch.randn(n, k, generator=g) / 16).to(device).requires_grad_()
    dy = torch.randn(tokens, n, generator=g).to(torch.bfloat16).to(device)
    xj, wj, dyj = (to_jax(v.detach(), copy=True) for v in (x, w, dy))

    def torch_step():
        x.grad = w.grad = None
        mxfp8_linear(x, w).backward(dy)

    return {
        "what": "linear fwd+bwd",
        "case": f"x ({tokens}, {k}) bf16, W ({n}, {k}) fp32",
        "bridge_us": _median_us(torch_step, **kw),
        "raw_us": _median_us(lambda: _jax_fwd_bwd(xj, wj, dyj)[0], **kw),
    }


def _linear_rows(device: str, args) -> list[dict]:
    kw = dict(repeat=args.repeat_linear, warmup=args.warmup, device=device)
    return [_linear_case(device, t, k, n, kw) for t, k, n in args.linear_shapes]


_CUDA_LINEAR = [(2048, 1024, 1024), (8192, 4096, 4096)]


def _shape(s: str) -> tuple[int, int, int]:
    t, k, n = (int(v) for v in s.split("x"))
    return t, k, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--numels", type=int, nargs="+", default=[4096, 1 << 24])
    p.add_argument("--linear-shapes", type=_shape, nargs="+", default=None,
                   help="TxKxN (default: 256x512x512 on cpu, _CUDA_LINEAR on cuda)")  # fmt: skip
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--repeat-linear", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true", help="also print one JSON line per row")
    args = p.parse_args()
    if args.linear_shapes is None:
        args.linear_shapes = [(256, 512, 512)] if args.device == "cpu" else _CUDA_LINEAR
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")

    rows = _conversion_rows(args.device, args) + _linear_rows(args.device, args)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(
        f"# bench_bridge on {args.device} ({dev}), {datetime.datetime.now(datetime.UTC):%Y-%m-%d}"
    )
    print(f"# torch {torch.__version__}, jax {jax.__version__}, jax devices {jax.devices()}")
    print(f"# fp8 DLPack transport detected: {bridge.dlpack_support().torch_to_jax}")
    print("| op | case | bridge (us) | pure DLPack / pure JAX (us) | ratio |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        ratio = r["bridge_us"] / r["raw_us"]
        us = f"{r['bridge_us']:.1f} | {r['raw_us']:.1f}"
        print(f"| {r['what']} | {r['case']} | {us} | {ratio:.2f} |")
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
