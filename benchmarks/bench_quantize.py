"""MXFP8 quantize bandwidth, both planes, bf16 input: the Pallas kernel beside its references.

Per shape, in one process (shared clocks and conditions):

- ``pallas[<tiles>,<cast>]``: ``pallas_impl.quantize_2d`` for each ``--tiles`` variant and each
  ``--casts`` e4m3 path, after a byte check against ``xla`` (any difference stops the run);
- ``xla``: ``mxfp8.quantize(x, backend="xla")``, the project's reference backend;
- ``te_jax``: Transformer Engine JAX's own pure-JAX MXFP8 quantizer (both layouts), and
  ``te_backend``: ``mxfp8.quantize(x, backend="te")`` (TE plus the contract fix), if importable;
- ``naive_jnp``: float-math MXFP8 in plain jnp (abs-max, exp2(ceil(log2(amax/448))), divide,
  clip, cast), not contract-exact: what "just write it in jnp" costs;
- ``copy``: read 2 B and write 2 B per element (uint16 + 1), the device's streaming ceiling;
- ``pallas_copy[<tiles>]``: a Pallas kernel with the same grid and tiles that reads x and writes
  two uint8 planes, no math: the ceiling of this tiling, so the gap to it is the kernel's math.

GB/s = (bytes read + bytes written) / median seconds per call; quantize moves 2 (bf16 in) + 2
(two e4m3 planes) + 2/32 (two scale planes) bytes per element. Timing: ``--reps`` repetitions of
``--calls`` back-to-back calls, wall clock around ``jax.block_until_ready`` of the last, after
warm-up; the median over repetitions is reported. Async dispatch overlaps the calls, so large
shapes measure the device; a ``dispatch_floor`` row (a 1-element op) per shape shows the
per-call floor, and times within 1.5x of it are marked dispatch-bound.

GPU: ``python -m benchmarks.bench_quantize --out bench_quantize.json``
Tile sweep (same launch, a few large shapes to keep it short):
``--shapes 8192x8192,8192x768,50304x768 --tiles sweep --casts float,int``; tiles are
``default`` (the module's DEFAULT_TILES) or BMxBKxWARPS, then ``p`` for preload and ``cCK`` for
the chunk width (``32x64x1pc64``).
CPU smoke (interpret mode): ``python -m benchmarks.bench_quantize --interpret --shapes 64x64``.

``--refresh``: the refresh's kernel instead (``slices.quantize_slice_into`` on the ``pallas``
backend: both planes and both amax of a weight read where it lies in an fp32 main buffer, rounded
to bf16 as loaded, written into a uint8 images buffer), at the 1.3B GPT's weight shapes by
default, for each ``--tiles`` variant of its ``DEFAULT_TILES`` entry (fp32 input on the native
path; ``default``: the entry as the module sets it), bytes checked against the default's; GB/s
counts 4 B read and 2 B written per element, and ``copy_f32`` (read 4 B, write 2 B) beside.
``python -m benchmarks.bench_quantize --refresh --tiles default,32x128x2pc128,...``
"""

from __future__ import annotations

import argparse
import json
import re
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jax_side import mxfp8
from jax_side.mxfp8 import pallas_impl as pk
from jax_side.mxfp8.pallas_tiles import Grid, KernelKind, triton_params

GPT_SHAPES = [
    (8192, 768), (8192, 1024), (8192, 3072), (8192, 4096),  # activations: 8192 tokens x width
    (2304, 768), (3072, 768), (768, 3072), (50304, 768),  # GPT-2 124M weights
    (3072, 1024), (4096, 1024), (1024, 4096), (50304, 1024),  # GPT-2 350M weights
    (4096, 8192), (8192, 8192),
]
DEFAULT_TILES = "default,32x64x1pc64,32x128x2pc128"
SWEEP_TILES = ("32x128x1p,32x128x1,32x64x1p,32x64x1pc64,32x128x1c64,32x128x2pc128,"
               "32x256x2c128,32x256x4,64x256x4p,32x512x8")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(d) for d in s.split("x")) for s in text.split(",") if s]


_TILE_RE = re.compile(r"(\d+)x(\d+)(?:x(\d+))?(p?)(?:c(\d+))?")


def parse_tiles(text: str) -> list[pk.Tiles | None]:
    """"default" -> None (the module's DEFAULT_TILES); "BMxBKxWARPS[p][cCK]" -> Tiles, e.g.
    "32x64x1pc64" = Tiles(32, 64, num_warps=1, preload=True, chunk_k=64)."""
    out: list[pk.Tiles | None] = []
    for s in text.split(","):
        if s == "default":
            out.append(None)
            continue
        match = _TILE_RE.fullmatch(s)
        if match is None:
            raise SystemExit(f"--tiles: cannot parse {s!r}; expected e.g. 32x128x1p or 32x64x1pc64")
        bm, bk, warps, p, ck = match.groups()
        out.append(pk.Tiles(int(bm), int(bk), int(warps or 4), p == "p", int(ck or 32)))
    return out


def tiles_name(t: pk.Tiles | None) -> str:
    if t is None:
        return "default"
    chunk = "" if t.chunk_k == 32 else f"c{t.chunk_k}"
    return f"{t.block_m}x{t.block_k}x{t.num_warps}{'p' if t.preload else ''}{chunk}"


def time_per_call(fn, x, *, calls: int, reps: int) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(x))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(x)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))


# ---------------------------------------------------------------------------------------------
# Variants. Each maker returns (fn, bytes moved per call) or raises to be reported as skipped.


def quantize_bytes(m: int, k: int) -> int:
    return m * k * 2 + 2 * m * k + 2 * (m * k // 32)


def naive_jnp(x):
    """Float-math MXFP8 (both planes): the obvious jnp, NaN/Inf/subnormal edges not handled."""
    m, k = x.shape
    x32 = x.astype(jnp.float32)

    def plane(blocks, axis):  # blocks: x32 reshaped so that `axis` runs over one block
        amax = jnp.max(jnp.abs(blocks), axis=axis, keepdims=True)
        scale = jnp.exp2(jnp.ceil(jnp.log2(amax / 448.0)))
        y = jnp.clip(blocks / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
        e8 = jnp.squeeze(scale, axis).astype(jnp.float8_e8m0fnu)
        return y.reshape(m, k), e8

    row = plane(x32.reshape(m, k // 32, 32), 2)  # (M, K/32, 32): blocks along K
    col = plane(x32.reshape(m // 32, 32, k), 1)  # (M/32, 32, K): blocks along M
    return row, col


def make_te_jax():
    import transformer_engine.jax  # noqa: F401  (raises where TE-JAX is not installed)
    from transformer_engine.jax.quantize import QuantizeLayout, QuantizerFactory, ScalingMode

    quantizer = QuantizerFactory.create(
        scaling_mode=ScalingMode.MXFP8_1D_SCALING, q_dtype=jnp.float8_e4m3fn,
        q_layout=QuantizeLayout.ROWWISE_COLWISE)

    def fn(v):  # TE's pure-JAX quantizer (its custom call is wrong on 9.0: docs/te_backend.md)
        with jax.numpy_dtype_promotion("standard"):
            return quantizer.quantize(v, is_rowwise=True, is_colwise=True)

    return jax.jit(fn)


def make_te_backend():
    mxfp8.kernel_report(mxfp8.KernelConfig("te"))  # raises where the te backend cannot run here
    return jax.jit(lambda v: mxfp8.quantize(v, backend="te"))


def _copy_kernel(x_ref, a_ref, b_ref):
    v = lax.bitcast_convert_type(x_ref[...], jnp.int16).astype(jnp.int32)
    a_ref[...] = v.astype(jnp.uint8)
    b_ref[...] = lax.shift_right_logical(v, jnp.int32(8)).astype(jnp.uint8)


def make_pallas_copy(shape, tiles: pk.Tiles | None, interpret: bool):
    g = Grid.make(KernelKind.QUANTIZE, shape, tiles, jnp.bfloat16, pk.COMPILED_DEFAULT)
    spec = g.full()
    out = jax.ShapeDtypeStruct(shape, jnp.uint8)
    call = pl.pallas_call(
        _copy_kernel, out_shape=[out, out], grid=g.grid(shape), in_specs=[spec],
        out_specs=[spec, spec], interpret=interpret,
        compiler_params=triton_params(g.tiles.num_warps))
    return jax.jit(call)


def byte_check(got: pk.Planes, want, what: str) -> None:
    for f in pk.Planes._fields:
        g = np.asarray(getattr(got, f)).view(np.uint8)
        w = np.asarray(getattr(want, f)).view(np.uint8)
        if g.shape != w.shape or not np.array_equal(g, w):
            n = int(np.sum(g != w)) if g.shape == w.shape else -1
            raise SystemExit(f"BYTE MISMATCH {what} {f}: {n} bytes differ from xla; not timing")


def make_input(shape, seed: int) -> jax.Array:
    """bf16 normal values with per-row magnitudes, a few NaN/Inf/subnormals (edge paths run)."""
    rng = np.random.default_rng(seed)
    m, k = shape
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(
        rng.integers(-20, 20, size=(m, 1))).astype(np.float32)
    idx = rng.integers(0, m * k, size=8)
    x.reshape(-1)[idx] = [np.nan, np.inf, -np.inf, 2.0**-130, -(2.0**-133), 0.0, -0.0, 1e30]
    return jnp.asarray(x).astype(jnp.bfloat16)


def bench_shape(shape, args, tiles_list, casts) -> list[dict]:
    m, k = shape
    x = make_input(shape, seed=m + k)
    want = mxfp8.quantize(x, backend="xla")
    qbytes = quantize_bytes(m, k)
    variants: list[tuple[str, object, int]] = []
    for t in tiles_list:
        for c in casts:
            fn = jax.jit(lambda v, t=t, c=c: pk.quantize_2d(
                v, rowwise=True, colwise=True, interpret=args.interpret, tiles=t, e4m3_cast=c))
            byte_check(fn(x), want, f"pallas tiles={t} cast={c} shape={shape}")
            variants.append((f"pallas[{tiles_name(t)},{c}]", fn, qbytes))
    variants.append(("xla", jax.jit(lambda v: mxfp8.quantize(v, backend="xla")), qbytes))
    variants.append(("naive_jnp", jax.jit(naive_jnp), qbytes))
    variants.append(("copy", jax.jit(
        lambda v: lax.bitcast_convert_type(v, jnp.uint16) + jnp.uint16(1)), 4 * m * k))
    for t in tiles_list:
        variants.append((f"pallas_copy[{tiles_name(t)}]",
                         make_pallas_copy(shape, t, args.interpret), 4 * m * k))
    rows = []
    for name, make in (("te_jax", make_te_jax), ("te_backend", make_te_backend)):
        try:
            variants.append((name, make(), qbytes))
        except Exception as e:  # noqa: BLE001 -- TE-JAX absent or changed: report, keep going
            first = str(e).splitlines()[0] if str(e) else ""
            rows.append({"shape": f"{m}x{k}", "variant": name,
                         "skipped": f"{type(e).__name__}: {first}"[:160]})
    for name, fn, nbytes in variants:
        try:
            t = time_per_call(fn, x, calls=args.calls, reps=args.reps)
        except Exception:  # noqa: BLE001 -- keep the other variants' numbers
            rows.append({"shape": f"{m}x{k}", "variant": name,
                         "skipped": traceback.format_exc().strip().splitlines()[-1][:160]})
            continue
        rows.append({"shape": f"{m}x{k}", "variant": name, "us": t * 1e6,
                     "GBps": nbytes / t / 1e9, "bytes": nbytes})
    copy = next((r["GBps"] for r in rows if r["variant"] == "copy" and "GBps" in r), None)
    floor = time_per_call(jax.jit(lambda v: v[:1, :1] + 1), x, calls=args.calls, reps=args.reps)
    for r in rows:
        if copy and "GBps" in r:
            r["pct_of_copy"] = 100.0 * r["GBps"] / copy
        if "us" in r:  # within 1.5x of a 1-element op: the time is dispatch, not the kernel
            r["dispatch_bound"] = r["us"] < 1.5 * floor * 1e6
    rows.append({"shape": f"{m}x{k}", "variant": "dispatch_floor", "us": floor * 1e6,
                 "GBps": 0.0, "bytes": 0})
    return rows


REFRESH_SHAPES = "6144x2048,2048x2048,8192x2048,2048x8192"  # the 1.3B GPT's block weights


def _refresh_fn(shape, interpret: bool):
    from jax_side.mxfp8.slices import quantize_slice_into

    m, k = shape
    n = m * k

    def fn(flat, out):
        return quantize_slice_into(out, (0, n), flat, (m, k), 0, backend="pallas", offset=0,
                                   numel=n, read_as=jnp.bfloat16)
    return jax.jit(fn, donate_argnums=(1,)) if not interpret else jax.jit(fn)


def bench_refresh(shape, args, tiles_list) -> list[dict]:
    """The refresh's kernel at each tiles variant (module note, ``--refresh``)."""
    from jax_side.mxfp8.pallas_tiles import DEFAULT_TILES, TileKey

    m, k = shape
    n = m * k
    # fp32 values off the bf16 grid, so that the kernel's rounding to bf16 as loaded is at work
    flat = make_input(shape, seed=m + k).astype(jnp.float32).reshape(-1) * 1.0001
    key = TileKey(KernelKind.QUANTIZE, "float32", pk.COMPILED_DEFAULT)
    had = DEFAULT_TILES.get(key)

    def use(t: pk.Tiles | None) -> None:  # None: no entry (the fp32 entry without the path)
        DEFAULT_TILES.pop(key, None)
        if t is not None:
            DEFAULT_TILES[key] = t

    rows, want = [], None
    try:
        for t in tiles_list:
            use(had if t is None else t)
            fn = _refresh_fn(shape, args.interpret)
            got = np.asarray(fn(flat, jnp.zeros((2 * n,), jnp.uint8))[0])
            if want is None:
                want = got
            elif not np.array_equal(got, want):
                raise SystemExit(f"BYTE MISMATCH refresh tiles={tiles_name(t)} shape={shape}")
            buf = [jnp.zeros((2 * n,), jnp.uint8)]

            def call(v, fn=fn, buf=buf):
                buf[0] = fn(v, buf[0])[0]
                return buf[0]
            sec = time_per_call(call, flat, calls=args.calls, reps=args.reps)
            rows.append({"shape": f"{m}x{k}", "variant": f"refresh[{tiles_name(t)}]",
                         "us": sec * 1e6, "GBps": 6 * n / sec / 1e9, "bytes": 6 * n})
    finally:
        use(had)
    copy = jax.jit(lambda v: v.astype(jnp.bfloat16))
    sec = time_per_call(copy, flat, calls=args.calls, reps=args.reps)
    rows.append({"shape": f"{m}x{k}", "variant": "copy_f32", "us": sec * 1e6,
                 "GBps": 6 * n / sec / 1e9, "bytes": 6 * n})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | variant | us | GB/s | % of copy |", "|---|---|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['variant']} | skipped: {r['skipped']} | | |")
        else:
            mark = " (dispatch-bound)" if r.get("dispatch_bound") else ""
            lines.append(f"| {r['shape']} | {r['variant']} | {r['us']:.1f}{mark} | "
                         f"{r['GBps']:.1f} | {r.get('pct_of_copy', float('nan')):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in GPT_SHAPES),
                        help="comma-separated MxK (default: GPT-2 step shapes + 4096x8192, "
                             "8192x8192)")
    parser.add_argument("--tiles", default=DEFAULT_TILES,
                        help="comma-separated Pallas tile variants: 'default' (the module's "
                             "DEFAULT_TILES) or BMxBKxWARPS[p][cCK] (p: preload, CK: chunk "
                             "width); 'sweep' = " + SWEEP_TILES)
    parser.add_argument("--casts", default="default",
                        help="element paths (pallas_impl.ElementPath): native, float, int, or "
                             "'default' (native compiled, float with --interpret)")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per timing")
    parser.add_argument("--reps", type=int, default=10, help="timings; the median is reported")
    parser.add_argument("--interpret", action="store_true",
                        help="Pallas interpret mode (CPU smoke run; the numbers mean nothing)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--refresh", action="store_true",
                        help="time the refresh's kernel (fp32 main read as bf16, written in "
                             "place) at --shapes (default: the 1.3B weights) per --tiles")
    args = parser.parse_args()
    if args.refresh and args.shapes == parser.get_default("shapes"):
        args.shapes = REFRESH_SHAPES
    shapes = parse_shapes(args.shapes)
    tiles_list = parse_tiles(SWEEP_TILES if args.tiles == "sweep" else args.tiles)
    casts = [c for c in args.casts.split(",") if c]
    default = pk.INTERPRET_DEFAULT if args.interpret else pk.COMPILED_DEFAULT
    casts = [(default if c == "default" else pk.ElementPath.parse(c)).value for c in casts]
    meta = {"device": str(jax.devices()[0]), "jax": jax.__version__,
            "interpret": args.interpret, "tiles": [tiles_name(t) for t in tiles_list],
            "casts": casts, "calls": args.calls, "reps": args.reps}
    print(json.dumps(meta), flush=True)
    rows: list[dict] = []
    for shape in shapes:
        shape_rows = (bench_refresh(shape, args, tiles_list) if args.refresh
                      else bench_shape(shape, args, tiles_list, casts))
        rows += shape_rows
        print(markdown(shape_rows), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n## All shapes\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
