"""Probe of host-side costs on a GPU: JAX dispatch, DLPack crossings, GEMM paths, compile time.

Answers, in one launch, the questions the training-step work (issue 11) depends on:

1. what one jitted call costs on the host (native arrays, DLPack-imported arrays, pytrees);
2. where ``jax.dlpack.from_dlpack`` of a CUDA tensor spends its ~100 us, and what the lower-level
   pieces cost (``__dlpack__``, ``dlpack_managed_tensor_to_buffer``, ``jnp.asarray``);
3. ``torch.from_dlpack`` of a JAX array and its pieces;
4. MXFP8 GEMM implementations at GPT-2 shapes (fp32 HIGHEST dequant-dot, bf16 dequant-dot,
   scaled_matmul, plain bf16 dot);
5. whether Pallas's Triton lowering takes the operations an MXFP8 kernel needs (bytes checked).

Compile time under XLA flags: ``benchmarks/bench_compile.py``. Results of an H200 run:
BENCHMARKS.md "Training step at GPT-2 scale".

    python3 -m benchmarks.probe_host_costs [--quick] [--section pallas dispatch dlpack gemm]

Prints one line per measurement ("name: value unit") and a JSON blob at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

RESULTS: dict[str, float | str] = {}


def record(name: str, value, unit: str = "us") -> None:
    RESULTS[name] = value
    if isinstance(value, float):
        print(f"{name}: {value:.2f} {unit}", flush=True)
    else:
        print(f"{name}: {value}", flush=True)


def host_us(fn, n: int = 200, warm: int = 20) -> float:
    """Median host time of fn() in us over n calls (no device sync inside)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def section(name):
    def wrap(fn):
        def run(args):
            print(f"\n=== {name}", flush=True)
            try:
                fn(args)
            except Exception:  # noqa: BLE001 -- a probe reports and goes on
                record(f"{name}.error", traceback.format_exc().splitlines()[-1])
                traceback.print_exc()
        return run
    return wrap


@section("dispatch")
def probe_dispatch(args):
    import jax
    import jax.numpy as jnp
    import torch

    dev = jax.devices()[0]
    a = jnp.ones((1024,), jnp.float32)
    f1 = jax.jit(lambda x: x + 1)
    record("dispatch.jit_1arg_native", host_us(lambda: f1(a)))
    t = torch.ones(1024, device="cuda")
    a_dl = jax.dlpack.from_dlpack(t)
    record("dispatch.jit_1arg_dlpack_array", host_us(lambda: f1(a_dl)))
    arrs = [jnp.ones((1024,), jnp.float32) for _ in range(6)]
    f6 = jax.jit(lambda *xs: sum(xs))
    record("dispatch.jit_6args_native", host_us(lambda: f6(*arrs)))

    def g(x, w, *, out_dtype):
        return (x @ w.T).astype(out_dtype)

    gj = jax.jit(g, static_argnames=("out_dtype",))
    x = jnp.ones((64, 64), jnp.bfloat16)
    record("dispatch.jit_static_dtype_kw", host_us(lambda: gj(x, x, out_dtype=jnp.bfloat16)))
    record("dispatch.device", str(dev))


@section("dlpack")
def probe_dlpack(args):
    import jax
    import jax.numpy as jnp
    import torch
    from jax._src import dlpack as jdl
    from jax._src.lib import _jax

    t = torch.ones(8192 * 768, device="cuda", dtype=torch.bfloat16)
    record("dlpack.from_dlpack_public", host_us(lambda: jax.dlpack.from_dlpack(t)))
    dev = jax.devices()[0]
    stream = dev.get_stream_for_external_ready_events()
    record("dlpack.get_stream", host_us(lambda: dev.get_stream_for_external_ready_events()))
    record("dlpack.torch___dlpack__stream", host_us(lambda: t.__dlpack__(stream=stream)))
    record("dlpack.torch___dlpack__none", host_us(lambda: t.__dlpack__()))
    dl_type = int(t.__dlpack_device__()[0])

    def low():
        cap = t.__dlpack__(stream=stream)
        try:
            return _jax.dlpack_managed_tensor_to_buffer(cap, dev, stream, False, dl_type)
        except TypeError:
            return _jax.dlpack_managed_tensor_to_buffer(cap, dev, stream, False)

    arr = low()
    record("dlpack.low_level_import", host_us(low))
    record("dlpack.low_level_type", type(arr).__name__)
    record("dlpack.jnp_asarray_same_dtype", host_us(lambda: jnp.asarray(arr, dtype=arr.dtype)))
    record("dlpack.same_ptr", str(arr.unsafe_buffer_pointer() == t.data_ptr()))
    f = jax.jit(lambda x: x * 2)
    record("dlpack.jit_on_low_level_array", host_us(lambda: f(arr)))
    try:
        from bridge import to_jax, to_torch

        record("dlpack.bridge_to_jax", host_us(lambda: to_jax(t)))
        ja = jnp.ones((8192, 768), jnp.bfloat16)
        record("dlpack.bridge_to_torch", host_us(lambda: to_torch(ja)))
    except Exception as e:  # noqa: BLE001
        record("dlpack.bridge_error", repr(e))
    ja = jnp.ones((8192, 768), jnp.bfloat16)
    record("dlpack.torch_from_dlpack_public", host_us(lambda: torch.from_dlpack(ja)))
    ts = torch.cuda.current_stream().cuda_stream
    record("dlpack.jax___dlpack__stream", host_us(lambda: ja.__dlpack__(stream=ts)))
    record("dlpack.torch_from_capsule",
           host_us(lambda: torch.utils.dlpack.from_dlpack(ja.__dlpack__(stream=ts))))
    record("dlpack.jdl_to_dlpack", host_us(lambda: jdl.to_dlpack(ja, stream=ts)))
    # a device copy in Torch (what "copy into a persistent arena" would cost on the host)
    src = torch.ones(8192 * 768, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    record("dlpack.torch_copy_host", host_us(lambda: dst.copy_(src)))
    torch.cuda.synchronize()


@section("gemm")
def probe_gemm(args):
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jax_side.mxfp8 import matmul, quantize

    def bench(fn, *a, n=20):
        out = fn(*a)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*a)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / n

    shapes = [(8192, 768, 2304), (8192, 768, 3072), (8192, 3072, 768), (8192, 768, 50304)]
    if args.quick:
        shapes = shapes[:1]
    for m, k, n in shapes:
        key = jax.random.key(0)
        x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(1), (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
        xq, wq = quantize(x), quantize(w)
        flops = 2 * m * n * k
        tag = f"{m}x{k}x{n}"
        exact = jax.jit(lambda a, b: matmul(a, b, "forward"))
        scaled = jax.jit(lambda a, b: matmul(a, b, "forward", impl="scaled_matmul"))

        def deq_bf16(a, b):
            from jax_side.mxfp8 import dequantize

            a16 = dequantize(a).astype(jnp.bfloat16)
            b16 = dequantize(b).astype(jnp.bfloat16)
            return lax.dot_general(a16, b16, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

        bf = jax.jit(lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                  preferred_element_type=jnp.float32))
        for name, fn, ops in (("exact_fp32", exact, (xq, wq)), ("scaled_matmul", scaled, (xq, wq)),
                              ("dequant_bf16_dot", jax.jit(deq_bf16), (xq, wq)),
                              ("plain_bf16", bf, (x, w))):
            try:
                s = bench(fn, *ops)
                record(f"gemm.{tag}.{name}", flops / s / 1e12, "TFLOP/s")
            except Exception as e:  # noqa: BLE001
                record(f"gemm.{tag}.{name}.error", repr(e)[:200])
        y1 = exact(xq, wq)
        y2 = jax.jit(deq_bf16)(xq, wq)
        rel = float(jnp.linalg.norm(y1 - y2) / jnp.linalg.norm(y1))
        record(f"gemm.{tag}.bf16_vs_exact_relnorm", rel, "")
        record(f"gemm.{tag}.bf16_vs_exact_maxabs", float(jnp.max(jnp.abs(y1 - y2))), "")


@section("pallas")
def probe_pallas(args):
    """Does the Triton lowering take the operations an MXFP8 kernel needs?"""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.experimental import pallas as pl

    def kernel(x_ref, row_ref, col_ref, q_ref):
        for j in range(4):
            blk = x_ref[:, pl.ds(j * 32, 32)]  # (32, 32) bf16
            bits = lax.bitcast_convert_type(blk, jnp.uint16).astype(jnp.uint32) << 16
            a = bits & jnp.uint32(0x7FFFFFFF)
            row_ref[:, pl.ds(j, 1)] = jnp.max(a, axis=1, keepdims=True)
            col_ref[:, pl.ds(j * 32, 32)] = jnp.max(a, axis=0, keepdims=True)
            f = lax.bitcast_convert_type(bits, jnp.float32)
            y = jnp.clip(f, -448.0, 448.0).astype(jnp.float8_e4m3fn)
            q_ref[:, pl.ds(j * 32, 32)] = lax.bitcast_convert_type(y, jnp.uint8)

    m, k = 256, 512
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16) * 100
    call = pl.pallas_call(
        kernel,
        grid=(m // 32, k // 128),
        in_specs=[pl.BlockSpec((32, 128), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((32, 4), lambda i, j: (i, j)),
                   pl.BlockSpec((1, 128), lambda i, j: (i, j)),
                   pl.BlockSpec((32, 128), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((m, k // 32), jnp.uint32),
                   jax.ShapeDtypeStruct((m // 32, k), jnp.uint32),
                   jax.ShapeDtypeStruct((m, k), jnp.uint8)],
        interpret=jax.devices()[0].platform == "cpu",
    )
    row, col, q = jax.block_until_ready(call(x))
    xf = np.asarray(x.astype(jnp.float32))
    want_q = np.asarray(jnp.clip(x.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn))
    record("pallas.cast_equal", str(bool((np.asarray(q) == want_q.view(np.uint8)).all())))
    want_row = np.abs(xf).reshape(m, k // 32, 32).max(axis=2).view(np.uint32)
    want_col = np.abs(xf).reshape(m // 32, 32, k).max(axis=1).view(np.uint32)
    record("pallas.row_amax_equal", str(bool((np.asarray(row) == want_row).all())))
    record("pallas.col_amax_equal", str(bool((np.asarray(col) == want_col).all())))


SECTIONS = {"pallas": probe_pallas, "dispatch": probe_dispatch, "dlpack": probe_dlpack,
            "gemm": probe_gemm}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--section", nargs="*", default=list(SECTIONS))
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    import jax
    import torch

    record("versions", f"jax {jax.__version__} torch {torch.__version__}")
    for name in args.section:
        SECTIONS[name](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
