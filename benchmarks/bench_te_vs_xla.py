"""TE-JAX (``te``) vs the project's pure-JAX (``xla``) MXFP8 backend, on one GPU.

Measures, in one process (so the numbers share clocks and conditions):

- device copy bandwidth (``a + 1`` over 1 GiB of uint32: bytes read + written) and the bf16
  matmul rate (8192^3, fp32 accumulation) as the ceilings to compare against;
- quantize bandwidth, both planes, bf16 (4096, 8192) and (8192, 8192): bytes moved = input
  (2 B/elt) + two e4m3 planes (2 B/elt) + two scale planes (2/32 B/elt), per backend
  (``xla``; ``te``; ``te`` with ``ContractFix.NONE``, TE's raw bytes);
- GEMM throughput, (M, N, K) = (8192, 8192, 8192), all three roles: ``xla`` dequant_dot,
  ``xla`` scaled_matmul, ``te``;
- ``jax.nn.scaled_matmul`` vs ``matmul(..., impl="dequant_dot")``, relative error per role;
- a divergence census: TE's raw pure-JAX bytes vs ``xla`` per block category, and what TE's
  MXFP8 quantize custom call returns on this GPU (run directly, bypassing our dispatch).

Usage (GPU machine with TE-JAX): ``python -m benchmarks.bench_te_vs_xla --out results.json``.
Medians of ``--iters`` timed calls after two warm-ups, wall clock around ``block_until_ready``.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jax_side import mxfp8
from jax_side.mxfp8 import GemmImpl, GemmRole, te_backend
from jax_side.mxfp8.te_backend import ContractFix

QUANT_SHAPES = [(4096, 8192), (8192, 8192)]
GEMM_MNK = (8192, 8192, 8192)


def _median_time(fn, *args, iters: int) -> float:
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _bf16(shape, seed: int) -> jax.Array:
    key = jax.random.PRNGKey(seed)
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def ceilings(iters: int) -> dict:
    a = jnp.zeros((1 << 28,), jnp.uint32)  # 1 GiB
    t = _median_time(jax.jit(lambda v: v + jnp.uint32(1)), a, iters=iters)
    copy_gbs = 2 * a.nbytes / t / 1e9
    n = 8192
    x, y = _bf16((n, n), 1), _bf16((n, n), 2)
    mm = jax.jit(lambda p, q: jnp.matmul(p, q, preferred_element_type=jnp.float32))
    t = _median_time(mm, x, y, iters=iters)
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": 2 * n**3 / t / 1e12}


def quantize_bandwidth(iters: int) -> list[dict]:
    variants = {
        "xla": lambda v: mxfp8.quantize(v, backend="xla"),
        "te": lambda v: mxfp8.quantize(v, backend="te"),
        "te_raw": lambda v: te_backend.quantize(v, rowwise=True, colwise=True,
                                                fix=ContractFix.NONE),
    }
    rows = []
    for m, k in QUANT_SHAPES:
        x = _bf16((m, k), 3)
        moved = m * k * (2 + 2 + 2 / 32)
        for name, fn in variants.items():
            t = _median_time(jax.jit(fn), x, iters=iters)
            rows.append({"shape": [m, k], "backend": name, "ms": t * 1e3,
                         "GBps": moved / t / 1e9})
    return rows


ROLE_SHAPES = {  # (a, b) logical shapes for (M, N, K)
    GemmRole.FORWARD: lambda m, n, k: ((m, k), (n, k)),
    GemmRole.DGRAD: lambda m, n, k: ((m, n), (n, k)),
    GemmRole.WGRAD: lambda m, n, k: ((m, n), (m, k)),
}


def _operands(role, mnk, seed):
    a_shape, b_shape = ROLE_SHAPES[role](*mnk)
    return (mxfp8.quantize(_bf16(a_shape, seed), backend="xla"),
            mxfp8.quantize(_bf16(b_shape, seed + 1), backend="xla"))


def gemm_throughput(iters: int) -> list[dict]:
    m, n, k = GEMM_MNK
    variants = {
        "xla_dequant_dot": dict(backend="xla", impl=GemmImpl.DEQUANT_DOT),
        "xla_scaled_matmul": dict(backend="xla", impl=GemmImpl.SCALED_MATMUL),
        "te": dict(backend="te"),
    }
    rows = []
    for role in GemmRole:
        a, b = _operands(role, GEMM_MNK, 10)
        for name, kw in variants.items():
            fn = jax.jit(lambda p, q, kw=kw, role=role: mxfp8.matmul(p, q, role, **kw))
            t = _median_time(fn, a, b, iters=iters)
            rows.append({"role": role.value, "impl": name, "ms": t * 1e3,
                         "TFLOPs": 2 * m * n * k / t / 1e12})
    return rows


def scaled_matmul_error() -> list[dict]:
    rows = []
    for role in GemmRole:
        a, b = _operands(role, (1024, 2048, 4096), 20)
        exact = mxfp8.matmul(a, b, role, impl=GemmImpl.DEQUANT_DOT, backend="xla")
        fast = mxfp8.matmul(a, b, role, impl=GemmImpl.SCALED_MATMUL, backend="xla")
        te = mxfp8.matmul(a, b, role, backend="te")
        norm = float(jnp.linalg.norm(exact))
        rows.append({
            "role": role.value,
            "scaled_matmul_rel_err": float(jnp.linalg.norm(fast - exact)) / norm,
            "te_rel_err": float(jnp.linalg.norm(te - exact)) / norm,
            "te_vs_scaled_matmul_bitwise": bool(jnp.all(
                jax.lax.bitcast_convert_type(te, jnp.uint32)
                == jax.lax.bitcast_convert_type(fast, jnp.uint32))),
        })
    return rows


CENSUS_BLOCKS = {
    "nan": [np.nan, 2.0, 1.0],
    "inf": [np.inf, 1.0],
    "all_zero": [0.0],
    "bf16_subnormal": [2.0**-130, 2.0**-133],
    "tiny_normal": [2.0**-110],
    "s_subnormal_edge": [1.75 * 2.0**-119],
    "s_subnormal_next": [float(np.nextafter(np.float32(1.75 * 2.0**-119), np.float32(1)))],
    "normal": [3.0, -1.5, 0.25],
}


def _census_input() -> tuple[jax.Array, list[str]]:
    """bf16 (32, 32 * 8 * 4): four rowwise blocks per category, values in row 0."""
    names = [name for name in CENSUS_BLOCKS for _ in range(4)]
    x = np.zeros((32, 32 * len(names)), np.float32)
    for i, name in enumerate(names):
        vals = CENSUS_BLOCKS[name]
        x[0, 32 * i : 32 * i + len(vals)] = vals
    return jnp.asarray(x).astype(jnp.bfloat16), names


def _block_diffs(t, ref, names) -> dict:
    out = {}
    data = np.asarray(t.rowwise_data).view(np.uint8).reshape(32, -1, 32)
    rdata = np.asarray(ref.rowwise_data).view(np.uint8).reshape(32, -1, 32)
    scale = np.asarray(t.rowwise_scale).view(np.uint8)[0]
    rscale = np.asarray(ref.rowwise_scale).view(np.uint8)[0]
    for i, name in enumerate(names):
        if name in out:
            continue
        out[name] = {
            "scale": int(scale[i]), "xla_scale": int(rscale[i]),
            "data_row0_first4": data[0, i, :4].tolist(),
            "xla_row0_first4": rdata[0, i, :4].tolist(),
            "bytes_differ": int(np.sum(data[:, i, :] != rdata[:, i, :])
                                + (scale[i] != rscale[i])),
        }
    return out


def divergence_census() -> dict:
    x, names = _census_input()
    ref = mxfp8.quantize(x, backend="xla")
    raw = te_backend.quantize(x, rowwise=True, colwise=True, fix=ContractFix.NONE)
    fixed = mxfp8.quantize(x, backend="te")
    result = {"te_pure_jax_raw": _block_diffs(raw, ref, names),
              "te_default": _block_diffs(fixed, ref, names)}
    try:  # TE's quantize custom call on this GPU, as a user calling TE directly would get it
        te = te_backend.import_te()
        quantizer = te.q.QuantizerFactory.create(
            scaling_mode=te.q.ScalingMode.MXFP8_1D_SCALING, q_dtype=jnp.float8_e4m3fn,
            q_layout=te.q.QuantizeLayout.ROWWISE_COLWISE)
        y = _bf16((256, 512), 30)
        with jax.numpy_dtype_promotion("standard"):
            out = te.tex.quantize(y, quantizer)
        got = np.asarray(out.rowwise_tensor.data).view(np.uint8)
        want = np.asarray(mxfp8.quantize(y, backend="xla").rowwise_data).view(np.uint8)
        result["te_custom_call_quantize"] = {
            "raised": False, "bytes_differ": int(np.sum(got != want)), "of": int(got.size),
            "nan_bytes": int(np.sum((got & 0x7F) == 0x7F))}
    except Exception as e:  # noqa: BLE001 -- the point is to record what happens
        result["te_custom_call_quantize"] = {"raised": True, "error": f"{type(e).__name__}: {e}"}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__,
               "report_auto": mxfp8.kernel_report()}
    try:
        results["report_te"] = mxfp8.kernel_report(mxfp8.KernelConfig("te"))
        results["te_version"] = te_backend.import_te().version
        results["te_import_warnings"] = list(te_backend.import_te().import_warnings)
    except RuntimeError as e:
        results["report_te"] = str(e)
    print(json.dumps(results, indent=1), flush=True)
    sections = [("ceilings", lambda: ceilings(args.iters)),
                ("divergence_census", divergence_census),
                ("scaled_matmul_error", scaled_matmul_error),
                ("quantize_bandwidth", lambda: quantize_bandwidth(args.iters)),
                ("gemm_throughput", lambda: gemm_throughput(args.iters))]
    for name, fn in sections:
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 -- keep the other sections' numbers
            results[name] = {"error": traceback.format_exc()}
        print(name, json.dumps(results[name], indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
