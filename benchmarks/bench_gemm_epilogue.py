"""The MLP's GELU in the ``fp8_blocked`` GEMM's epilogue (``jax_side.mxfp8.epilogue``, issue 33)
against the GEMM and XLA's GELU pass, at the 350M and 1.3B GPTs' MLP shapes (8 x 1024 tokens).

Per shape (M, K, N: out (M, N) = a (M, K) @ b (N, K)^T: the first linear's forward), GPU kernel
ms per call (torch.profiler, which sees XLA's kernels; no host dispatch):

- ``gemm``: the plain GEMM, bf16 out (cuBLASLt);
- ``gemm+gelu``: the GEMM, then the GELU as the model runs it unfused (``gelu_tanh`` of the bf16
  output, its input kept): the forward today;
- ``gelu_aux``: the GEMM with the ``GELU_AUX`` epilogue (GELU output and input in one pass).

And the numbers against the reference (``gelu_aux_reference`` of the same fp32 accumulator;
``gelu_max_ulps``: the largest difference in bf16 units in the last place of the reference's
magnitude, ``gelu_differ``: the fraction of elements not bit-equal) and, for information,
against the unfused values (``gelu_vs_unfused_*``). ``aux_equal``: whether the epilogue's GELU
input is byte-equal to the plain GEMM's bf16 output.

    python3 benchmarks/bench_gemm_epilogue.py --out epilogue.json   # GPU
    python3 benchmarks/bench_gemm_epilogue.py --smoke               # CPU: tiny, reference path
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
import numpy as np  # noqa: E402

from benchmarks.bench_fp8_gemm import _operands, _rowwise, kernel_ms  # noqa: E402
from jax_side import mxfp8  # noqa: E402
from jax_side.mxfp8 import epilogue  # noqa: E402
from jax_side.mxfp8.gemm_impls import blocked_product  # noqa: E402
from jax_side.mxfp8.reblock import reblock_rows, reblock_tiles  # noqa: E402
from models.gpt_math import gelu_tanh  # noqa: E402

SHAPES = [(8192, 1024, 4096), (8192, 2048, 8192)]  # the 350M and 1.3B first MLP linears


def _numbers(row: dict[str, Any], acc: jax.Array, h16: jax.Array, got: Any) -> None:
    ref_g, ref_h = epilogue.gelu_aux_reference(acc)
    g, h = got
    row["aux_equal"] = bool(jnp.array_equal(h, h16))
    row["aux_vs_reference_max_ulps"] = float(epilogue.bf16_ulps(h, ref_h).max())
    for name, ref in (("gelu", ref_g), ("gelu_vs_unfused", gelu_tanh(h16))):
        u = epilogue.bf16_ulps(g, ref)
        row[f"{name}_max_ulps"] = float(u.max())
        row[f"{name}_differ"] = float(np.mean(u > 0))


def _fns(m: int, n: int) -> dict[str, Any]:
    """The timed variants (module note) of an (m, n) output, jitted."""
    def gemm(x: Any, y: Any) -> jax.Array:
        return blocked_product(x, y, m, n, jnp.bfloat16)

    return {
        "gemm": jax.jit(gemm),
        "gemm+gelu": jax.jit(lambda x, y: (lambda h: (gelu_tanh(h), h))(gemm(x, y))),
        "gelu_aux": jax.jit(lambda x, y: epilogue.blocked_product_gelu(x, y, m, n)),
    }


def rows(shapes: list[tuple[int, int, int]], iters: int, timed: bool) -> list[dict[str, Any]]:
    out = []
    for m, k, n in shapes:
        a, b = _operands(m, k, n)
        ra = reblock_rows(*_rowwise(mxfp8.quantize(a)))
        rb = reblock_tiles(*_rowwise(mxfp8.quantize(b)))
        fns = _fns(m, n)
        acc = jax.jit(lambda x, y, m=m, n=n: blocked_product(x, y, m, n, jnp.float32))(ra, rb)
        h16 = fns["gemm"](ra, rb)
        row: dict[str, Any] = {"shape": [m, k, n]}
        _numbers(row, acc, h16, fns["gelu_aux"](ra, rb))
        if timed:
            for name, fn in fns.items():
                row[f"{name}_ms"] = kernel_ms(lambda f=fn, a=ra, b=rb: f(a, b), iters)
            row["saved_ms"] = row["gemm+gelu_ms"] - row["gelu_aux_ms"]
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true",
                   help="one 128x256x256 shape, numbers only (runs on a CPU: the references)")
    args = p.parse_args(argv)
    gpu = jax.devices()[0].platform == "gpu"
    if args.smoke:
        result: dict[str, Any] = {"rows": rows([(128, 256, 256)], 1, timed=False)}
    elif not gpu:
        p.error("no GPU: the timings mean nothing on a CPU; run with --smoke to check the script")
    else:
        from jax_side.mxfp8 import cublaslt

        result = {"cublaslt": cublaslt.status().reason,
                  "rows": rows(SHAPES, args.iters, timed=True)}
    result["device"] = str(jax.devices()[0])
    result["jax"] = jax.__version__
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
