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
  ``blocked_operands.KERNEL_CONFIG`` holds the fastest of each output; ``...,whole]``: the
  transposed outputs with each program's block loaded at once (``whole=True``); ``...,packed]``:
  four rows' codes per int32 word through the transpose (``packed=True``); ``...,shift_codes]``
  (``KERNEL_CONFIG``'s block and warps): each code cast at its 1x32 block's scale, then shifted
  to the merged block's (``one_cast=False``), where the default makes it by one e4m3 cast;
  ``rows>rows_t[...]`` / ``rows>tiles_t[...]``: the rows' call and the transposed output's
  call, the colwise scale bytes made by the first (``col_scales``) and read by the second
  (``given_scales``: its bands of x read once), against ``rows,rows_t[...]`` /
  ``rows,tiles_t[...]``, the same two calls each on its own, and ``rows+cs[...]``, the rows'
  call with the scale bytes;
  ``rows+rows_t[...]`` / ``rows+tiles_t[...]``: two outputs in one call (x read once from
  memory, the sum of the two layer calls' work; ``,whole]``: both from one loaded block;
  ``,packed]``: both from row-strided quarters, the transposed codes packed),
  which ``KERNEL_CONFIG["rows+rows_t"]`` / ``["rows+tiles_t"]`` would select;
- ``gelu_pass``: XLA's GELU (``models.gpt_math.gelu_tanh``) alone, and ``gelu+rows[...]`` /
  ``gelu+tiles_t[...]``: the forward's two calls with the GELU applied inside the kernel
  (``pre=``), which replace ``gelu_pass`` and the two calls on its output, and
  ``gelu+rows+tiles_t[...,whole]`` / ``[...,packed]``: both in one call (the GELU once per
  element; from one loaded block / from row-strided quarters);
- ``copy_t[128xC,wW]`` (``,packed]``), ``copy[32x128,w2]`` and ``xla_transpose_u8`` /
  ``xla_transpose_bf16``: the transposed (and the rows') write without the arithmetic, by a
  Pallas program per block and by XLA: what the memory traffic of an output costs alone;
- with ``--weights``, per weight shape (N, K) of the 1.3B GPT, the re-block of its MXFP8 planes
  into the GEMM's 128x128 tiles, the planes in flat buffers as in a unit program (``FlatPlane``):
  ``xla_fwd`` / ``xla_dgrad`` (``gemm_impls.b_tiles`` on the sliced planes: XLA's fusions, the
  dgrad one through a transpose) against ``pallas_fwd[wW]`` / ``pallas_dgrad[wW]``
  (``pallas_reblock.reblock_tiles_flat``: read in place) and ``pallas_sliced_*`` (the kernel on
  the sliced plane: XLA copies the slice out first); GB/s counted as codes read and written
  once.

    python3 benchmarks/bench_blocked_operands.py --out blocked.json      # GPU
    python3 benchmarks/bench_blocked_operands.py --weights --only 'pallas|xla'
    python3 benchmarks/bench_blocked_operands.py --smoke                 # CPU: tiny, interpreted
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from benchmarks.bench_fp8_gemm import kernel_ms, timed  # noqa: E402
from common.formats import Plane  # noqa: E402
from common.gemm_roles import ROLES, GemmRole  # noqa: E402
from jax_side import mxfp8  # noqa: E402
from jax_side.linear import FlatPlane  # noqa: E402
from jax_side.mxfp8.blocked_operands import KERNEL_CONFIG, from_planes  # noqa: E402
from jax_side.mxfp8.gemm_impls import b_tiles  # noqa: E402
from jax_side.mxfp8.pallas_blocked import quantize_blocked_2d  # noqa: E402
from jax_side.mxfp8.pallas_reblock import reblock_tiles_2d, reblock_tiles_flat  # noqa: E402
from models.gpt_math import gelu_tanh  # noqa: E402

SHAPES = [(8192, 2048), (8192, 6144), (8192, 8192)]  # the 1.3B GPT's x and dy at 8 x 1024
WEIGHTS = [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]  # its qkv, proj, fc1, fc2
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
                if output != "rows":  # four rows' codes per int32 word through the transpose
                    out[f"{output}[{block[0]}x{block[1]},w{w},packed]"] = (jax.jit(
                        lambda x, output=output, block=block, w=w: getattr(quantize_blocked_2d(
                            x, rows=False, rows_t=output == "rows_t",
                            tiles_t=output == "tiles_t", interpret=interpret, num_warps=w,
                            block=block, packed=True), output)), 1)
                if output != "rows":  # the same output, each program's block loaded at once
                    out[f"{output}[{block[0]}x{block[1]},w{w},whole]"] = (jax.jit(
                        lambda x, output=output, block=block, w=w: getattr(quantize_blocked_2d(
                            x, rows=False, rows_t=output == "rows_t",
                            tiles_t=output == "tiles_t", interpret=interpret, num_warps=w,
                            block=block, whole=True), output)), 1)
    for output in ("rows", "rows_t", "tiles_t"):  # the codes cast, then shifted (one_cast off)
        c = KERNEL_CONFIG[output]
        out[f"{output}[{c.block[0]}x{c.block[1]},w{c.warps},shift_codes]"] = (jax.jit(
            lambda x, output=output, c=c: getattr(quantize_blocked_2d(
                x, rows=output == "rows", rows_t=output == "rows_t",
                tiles_t=output == "tiles_t", interpret=interpret, num_warps=c.warps,
                block=c.block, one_cast=False), output)), 1)
    for second in ("rows_t", "tiles_t"):  # two outputs in one call: x read once from DRAM
        for w in warps:
            for how in ("", "whole", "packed"):
                out[f"rows+{second}[128x128,w{w}{',' if how else ''}{how}]"] = (jax.jit(
                    lambda x, second=second, w=w, how=how: quantize_blocked_2d(
                        x, rows=True, rows_t=second == "rows_t", tiles_t=second == "tiles_t",
                        interpret=interpret, num_warps=w, whole=how == "whole",
                        packed=how == "packed")), 2)
    out.update(_given_variants(warps, interpret))
    out.update(_gelu_variants(warps, interpret))
    out.update(_copy_variants(warps, interpret))
    return out


def _given_variants(warps: list[int], interpret: bool) -> dict[str, tuple[Any, int]]:
    """The layer's two calls on one x with the transposed output's colwise scale bytes made by
    the rows' call (``rows>rows_t[...]`` / ``rows>tiles_t[...]``: ``col_scales=True``, then
    ``given_scales``, the transposed call's block and warps named) against the same two calls
    apart (``rows,rows_t[...]`` / ``rows,tiles_t[...]``: each transposed program reads its
    bands twice), and the rows' call alone with the scale bytes at every rows block and warps
    (``rows+cs[...]``, against ``rows[...]``); the pairs' rows call takes
    ``KERNEL_CONFIG["rows"]``'s block and warps."""
    c = KERNEL_CONFIG["rows"]

    def rows(x: jax.Array, col_scales: bool, block: tuple[int, int] = c.block,
             w: int = c.warps) -> Any:
        return quantize_blocked_2d(x, rows=True, rows_t=False, tiles_t=False,
                                   interpret=interpret, num_warps=w, block=block,
                                   col_scales=col_scales)

    def pair(x: jax.Array, second: str, block: tuple[int, int], w: int, given: bool) -> Any:
        r = rows(x, given)
        t = quantize_blocked_2d(x, rows=False, rows_t=second == "rows_t",
                                tiles_t=second == "tiles_t", interpret=interpret, num_warps=w,
                                block=block, given_scales=r.col_scales if given else None)
        return r.rows, getattr(t, second)

    out: dict[str, tuple[Any, int]] = {
        f"rows+cs[{b[0]}x{b[1]},w{w}]": (jax.jit(functools.partial(
            rows, col_scales=True, block=b, w=w)), 1)
        for b in BLOCKS["rows"] for w in warps}
    for second in ("rows_t", "tiles_t"):
        for block in BLOCKS[second]:
            for w in warps:
                for given in (True, False):
                    name = f"rows{'>' if given else ','}{second}[{block[0]}x{block[1]},w{w}]"
                    out[name] = (jax.jit(functools.partial(
                        pair, second=second, block=block, w=w, given=given)), 2)
    return out


def _high(v: Any) -> Any:
    """int32 high byte of each bf16 element (what the copy probes write instead of a code)."""
    return lax.shift_right_logical(lax.bitcast_convert_type(v, jnp.int16).astype(jnp.int32),
                                   jnp.int32(8)) & jnp.int32(0xFF)


def _copy_t_kernel(x_ref: Any, o_ref: Any, *, packed: bool) -> None:
    """No quantization: each element's high byte (bf16 x), transposed and stored, as bytes or
    as int32 words of four rows (row-strided quarters, as ``packed`` loads them)."""
    if not packed:
        o_ref[...] = _high(x_ref[...]).T.astype(jnp.uint8)
        return
    rows = x_ref.shape[0] // 4
    words = functools.reduce(jnp.bitwise_or, [
        lax.shift_left(_high(x_ref[pl.ds(r, rows, stride=4), :]), jnp.int32(8 * r))
        for r in range(4)])
    o_ref[...] = words.T


def _copy_kernel(x_ref: Any, o_ref: Any) -> None:
    """No quantization: each element's high byte (bf16 x), stored where it lies."""
    o_ref[...] = _high(x_ref[...]).astype(jnp.uint8)


def _copy_variants(warps: list[int], interpret: bool) -> dict[str, tuple[Any, int]]:
    """What the outputs' memory traffic costs without their arithmetic: bf16 x read, one byte
    an element written transposed by a Pallas program per (128, C) block of x (``copy_t[...]``,
    ``,packed]``: as int32 words), or not transposed per (32, 128) block as the rows' kernel
    writes (``copy[32x128,w2]``), and XLA's own transpose of x
    (``xla_transpose_u8``: the high bytes; ``xla_transpose_bf16``: x itself, 2 bytes written)."""
    from jax_side.mxfp8.pallas_tiles import triton_params

    def copy_t(bc: int, w: int, packed: bool) -> Any:
        def run(x: jax.Array) -> jax.Array:
            m, k = x.shape
            q = 4 if packed else 1
            o = pl.pallas_call(
                functools.partial(_copy_t_kernel, packed=packed),
                out_shape=jax.ShapeDtypeStruct((k, m // q), jnp.int32 if packed else jnp.uint8),
                grid=(m // 128, k // bc), in_specs=[pl.BlockSpec((128, bc), lambda i, j: (i, j))],
                out_specs=pl.BlockSpec((bc, 128 // q), lambda i, j: (j, i)),
                compiler_params=None if interpret else triton_params(w), interpret=interpret,
                name="copy_t")(x)
            return lax.bitcast_convert_type(o, jnp.uint8).reshape(k, m) if packed else o
        return jax.jit(run)

    out: dict[str, tuple[Any, int]] = {}
    for bc in (64, 128):
        for w in warps:
            for packed in (False, True):
                out[f"copy_t[128x{bc},w{w}{',packed' if packed else ''}]"] = (
                    copy_t(bc, w, packed), 1)
    out["copy[32x128,w2]"] = (jax.jit(lambda x: pl.pallas_call(  # the rows' pattern
        _copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.uint8), grid=(x.shape[0] // 32,
                                                                  x.shape[1] // 128),
        in_specs=[pl.BlockSpec((32, 128), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((32, 128), lambda i, j: (i, j)),
        compiler_params=None if interpret else triton_params(2), interpret=interpret,
        name="copy")(x)), 1)
    out["xla_transpose_u8"] = (jax.jit(lambda x: (lax.bitcast_convert_type(x, jnp.uint16).T
                                                  >> 8).astype(jnp.uint8)), 1)
    out["xla_transpose_bf16"] = (jax.jit(lambda x: x.T), 2)
    return out


def _gelu_variants(warps: list[int], interpret: bool) -> dict[str, tuple[Any, int]]:
    """The forward of the MLP's second linear at its input: XLA's GELU pass alone
    (``gelu_pass``: bf16 in, bf16 out, counted as 2 bytes written), and each of the layer's
    two calls with the GELU inside the kernel (``gelu+rows`` / ``gelu+tiles_t``,
    ``KERNEL_CONFIG``'s blocks and warps; ``pre=gelu_tanh``): against ``rows[...]`` +
    ``tiles_t[...]`` + ``gelu_pass``, what the GELU apart costs."""
    out: dict[str, tuple[Any, int]] = {"gelu_pass": (jax.jit(gelu_tanh), 2)}
    for output in ("rows", "tiles_t"):
        c = KERNEL_CONFIG[output]
        out[f"gelu+{output}[{c.block[0]}x{c.block[1]},w{c.warps}]"] = (jax.jit(
            lambda x, output=output, c=c: getattr(quantize_blocked_2d(
                x, rows=output == "rows", rows_t=False, tiles_t=output == "tiles_t",
                interpret=interpret, num_warps=c.warps, block=c.block, whole=c.whole,
                pre=gelu_tanh), output)), 1)
    for w in warps:  # both in one call: the GELU computed once per element
        for how in ("whole", "packed"):  # from one loaded block / from row-strided quarters
            out[f"gelu+rows+tiles_t[128x128,w{w},{how}]"] = (jax.jit(
                lambda x, w=w, how=how: quantize_blocked_2d(
                    x, rows=True, rows_t=False, tiles_t=True, interpret=interpret, num_warps=w,
                    whole=how == "whole", packed=how == "packed", pre=gelu_tanh)), 2)
    return out


def _in_buffers(t: mxfp8.MXFP8Tensor) -> tuple[jax.Array, jax.Array]:
    """Both planes' codes and scale bytes in two flat buffers, as FSDP gathers them: (rowwise
    codes, colwise codes) and (rowwise scales, colwise scales), 4096 bytes of other data first."""
    (rd, rs), (cd, cs) = t.plane("rowwise"), t.plane("colwise")
    pad = jnp.zeros((4096,), jnp.uint8)
    return (jnp.concatenate([pad, *(lax.bitcast_convert_type(d, jnp.uint8).reshape(-1)
                                    for d in (rd, cd))]),
            jnp.concatenate([pad, *(lax.bitcast_convert_type(s, jnp.uint8).reshape(-1)
                                    for s in (rs, cs))]))


def _weight_variants(warps: list[int], interpret: bool) -> dict[str, tuple[Any, int]]:
    """name -> (function of the weight's flat buffers (``_in_buffers``), 0 output bytes beyond
    the 2 per element counted: a code read and a code written): the re-block of one plane into
    tiles, the plane given as a ``FlatPlane`` as in a unit program."""
    out: dict[str, tuple[Any, int]] = {}
    for role, plane in ((GemmRole.FORWARD, Plane.ROWWISE), (GemmRole.DGRAD, Plane.COLWISE)):
        tag = "fwd" if role is GemmRole.FORWARD else "dgrad"

        def flat(bufs: tuple[jax.Array, jax.Array], shape: tuple[int, int],
                 plane: Plane = plane) -> FlatPlane:
            n, k = shape
            first = plane is Plane.ROWWISE
            return FlatPlane(bufs[0], bufs[1], 4096 + (0 if first else n * k),
                             4096 + (0 if first else n * k // 32), shape, plane)

        out[f"xla_{tag}"] = (lambda b, sh, role=role, flat=flat: b_tiles(
            flat(b, sh).tensor(), ROLES[role])[0], 0)
        out[f"pallas_sliced_{tag}"] = (lambda b, sh, colwise=role is GemmRole.DGRAD, flat=flat:
                                       reblock_tiles_2d(*_sliced(flat(b, sh)), colwise=colwise,
                                                        interpret=interpret), 0)
        for w in warps:
            out[f"pallas_{tag}[w{w}]"] = (lambda b, sh, w=w, flat=flat: _in_place(
                flat(b, sh), w, interpret), 0)
    return out


def _in_place(f: FlatPlane, warps: int, interpret: bool) -> Any:
    return reblock_tiles_flat(f.data, f.scale, f.data_offset, f.scale_offset, f.shape,
                              colwise=f.plane is Plane.COLWISE, interpret=interpret,
                              num_warps=warps)


def _sliced(f: FlatPlane) -> tuple[jax.Array, jax.Array]:
    d, s = f.tensor().plane(f.plane)
    return d, lax.bitcast_convert_type(s, jnp.uint8)


def rows_for(shapes: list[tuple[int, int]], warps: list[int], iters: int,
             interpret: bool, only: str = "", weights: bool = False) -> list[dict[str, Any]]:
    rows = []
    for t, c in shapes:
        x = jax.random.normal(jax.random.key(0), (t, c), jnp.float32).astype(jnp.bfloat16)
        row: dict[str, Any] = {"shape": [t, c]}
        variants = (_weight_variants if weights else _variants)(warps, interpret)
        arg: Any = x
        if weights:  # the functions take the planes in flat buffers; counted: codes in and out
            arg = _in_buffers(mxfp8.quantize(x * 0.02, backend="xla"))
            variants = {name: (jax.jit(functools.partial(fn, sh=(t, c))), n)
                        for name, (fn, n) in variants.items()}
        for name, (fn, out_bytes) in variants.items():
            if only and not re.search(only, name):
                continue
            try:
                s = (timed(fn, arg, iters=iters) if interpret
                     else kernel_ms(lambda fn=fn, arg=arg: fn(arg), iters) / 1e3)
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
    p.add_argument("--only", default="", help="a regular expression: the variants to time")
    p.add_argument("--weights", action="store_true",
                   help="the weights' re-block into tiles (WEIGHTS) instead of x's quantize")
    args = p.parse_args(argv)
    warps = [int(w) for w in args.warps.split(",") if w]
    gpu = jax.devices()[0].platform == "gpu"
    if args.smoke:
        rows = rows_for([(128, 256)], warps[:1], 1, interpret=not gpu, only=args.only,
                        weights=args.weights)
    elif not gpu:
        p.error("no GPU: the timings mean nothing on a CPU; run with --smoke to check the script")
    else:
        rows = rows_for(WEIGHTS if args.weights else SHAPES, warps, args.iters, interpret=False,
                        only=args.only, weights=args.weights)
    result = {"rows": rows, "device": str(jax.devices()[0]), "jax": jax.__version__}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
