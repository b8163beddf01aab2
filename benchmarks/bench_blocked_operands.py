"""The blocked-operand quantize (``jax_side.mxfp8.pallas_blocked``, issue 33) against what it
replaces: the ``pallas`` MXFP8 quantize of both planes followed by XLA's re-block (and transpose)
of each plane (``blocked_operands.from_planes``).

Per bf16 (tokens, features) shape, the GPU kernel time per call (us; torch.profiler, which sees
XLA's and Pallas' kernels, without the host's dispatch) and the bandwidth counted as x read once
plus the outputs written once (GB/s), for

- ``quantize``: the MXFP8 quantize alone (both planes; the old path's first pass);
- ``planes_fwd`` / ``planes_bwd``: quantize then re-block into the forward's operands (rows and
  x^T tiles) / the backward's (rows and dy^T rows): the composition;
- ``rows[RxC,wW]`` / ``rows_t[...]`` / ``tiles_t[...]``: one output of the kernel, each program
  quantizing an R x C block of x with W warps (``quantize_blocked_2d(block=, num_warps=)``);
  ``blocked_operands.KERNEL_CONFIG`` holds the fastest of each output.

    python3 benchmarks/bench_blocked_operands.py --out blocked.json      # GPU
    python3 benchmarks/bench_blocked_operands.py --smoke                 # CPU: tiny, interpreted
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

from benchmarks.bench_fp8_gemm import kernel_ms, timed  # noqa: E402
from jax_side import mxfp8  # noqa: E402
from jax_side.mxfp8.blocked_operands import from_planes  # noqa: E402
from jax_side.mxfp8.pallas_blocked import quantize_blocked_2d  # noqa: E402

SHAPES = [(8192, 2048), (8192, 6144), (8192, 8192)]  # the 1.3B GPT's x and dy at 8 x 1024
WARPS = "1,2,4,8"
BLOCKS = {"rows": [(32, 128), (64, 128), (128, 128)],
          "rows_t": [(128, 32), (128, 64), (128, 128)],
          "tiles_t": [(128, 128)]}


def _variants(warps: list[int], interpret: bool) -> dict[str, tuple[Any, int]]:
    """name -> (function of x, output bytes per element of x)."""
    backend = "pallas"

    def planes(rows_t: bool, tiles_t: bool) -> Any:
        return jax.jit(lambda x: from_planes(mxfp8.quantize(x, backend=backend), rows=True,
                                             rows_t=rows_t, tiles_t=tiles_t))

    out: dict[str, tuple[Any, int]] = {
        "quantize": (jax.jit(lambda x: mxfp8.quantize(x, backend=backend)), 2),
        "planes_fwd": (planes(False, True), 2),
        "planes_bwd": (planes(True, False), 2),
    }
    for output, blocks in BLOCKS.items():
        for block in blocks:
            for w in warps:
                def one(output: str = output, block: tuple[int, int] = block,
                        w: int = w) -> Any:
                    return jax.jit(lambda x: getattr(quantize_blocked_2d(
                        x, rows=output == "rows", rows_t=output == "rows_t",
                        tiles_t=output == "tiles_t", interpret=interpret, num_warps=w,
                        block=block), output))

                out[f"{output}[{block[0]}x{block[1]},w{w}]"] = (one(), 1)
    return out


def rows_for(shapes: list[tuple[int, int]], warps: list[int], iters: int,
             interpret: bool) -> list[dict[str, Any]]:
    rows = []
    for t, c in shapes:
        x = jax.random.normal(jax.random.key(0), (t, c), jnp.float32).astype(jnp.bfloat16)
        row: dict[str, Any] = {"shape": [t, c]}
        for name, (fn, out_bytes) in _variants(warps, interpret).items():
            try:
                s = (timed(fn, x, iters=iters) if interpret
                     else kernel_ms(lambda fn=fn, x=x: fn(x), iters) / 1e3)
            except Exception as e:  # a configuration that does not compile is recorded
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            row[f"{name}_us"] = round(s * 1e6, 2)
            row[f"{name}_gbs"] = round(t * c * (2 + out_bytes) / s / 1e9, 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warps", default=WARPS, help="comma-separated warps per program to time")
    p.add_argument("--smoke", action="store_true", help="one 128x256 shape, interpreted (CPU)")
    args = p.parse_args(argv)
    warps = [int(w) for w in args.warps.split(",") if w]
    gpu = jax.devices()[0].platform == "gpu"
    if args.smoke:
        rows = rows_for([(128, 256)], warps[:1], 1, interpret=not gpu)
    elif not gpu:
        p.error("no GPU: the timings mean nothing on a CPU; run with --smoke to check the script")
    else:
        rows = rows_for(SHAPES, warps, args.iters, interpret=False)
    result = {"rows": rows, "device": str(jax.devices()[0]), "jax": jax.__version__}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
