"""Activations and gradients quantized straight into the ``fp8_blocked`` GEMM's operands
(``blocked_operands``, ``pallas_blocked``; issue 33):

- the Pallas kernel (interpreted here, compiled on the GPU) writes the bytes of
  quantize-then-re-block (``from_planes``) for 1x128 rows, transposed 1x128 rows and transposed
  128x128 tiles, bf16 and fp32 inputs, NaN, Inf, zeros, subnormals and rows many binades apart;
- the padding to multiples of 128 gives the operands ``reblock.pad_to`` gives;
- the linear layer on this path returns the bytes of the MXFP8-plane path with the same GEMM
  (forward, dgrad, wgrad; both backends; a token count that is not a multiple of 32), and a
  training step through FSDP's unit programs gives the same losses on the kernel as on the
  composition;
- shapes and requests that cannot be served are refused by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from common.formats import Plane
from common.kernels import KernelConfig
from jax_side import linear as L
from jax_side import mxfp8
from jax_side.mxfp8 import blocked_operands as blocked
from jax_side.mxfp8 import pallas_blocked, reblock
from jax_side.mxfp8.kernels import resolve_kernels
from jax_side.mxfp8.pallas_blocked import quantize_blocked_2d
from jax_side.mxfp8.pallas_elements import ElementPath, cast_shift_native
from jax_side.mxfp8.reblock import shift_codes
from tests.jax_side.mxfp8.pallas_calls import pallas_operand_shapes
from tests.jax_side.mxfp8.tiny_training import two_step_losses


def _hostile(shape, seed):
    """Rows and columns many binades apart, NaN, +-Inf, a zero block, subnormal and tiny rows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp2(rng.integers(-20, 10, (shape[0], 1))).astype(np.float32)
    x *= np.exp2(rng.integers(-8, 8, (1, shape[1]))).astype(np.float32)
    x[3, 5], x[7, 9], x[8, 10] = np.nan, -np.inf, np.inf
    x[40:72, 100] = 0.0
    x[100, :] = 1e-42  # fp32 subnormal (bf16: flushed to its own subnormal or zero)
    x[101, :] = -3e-39
    x[130, 0:32] = 448.0 * 2.0**-126  # a block whose scale is tiny
    return x


def _u8(a):
    return np.asarray(lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.uint8 else a)


def _assert_same(got, want, what):
    for name in ("rows", "rows_t", "tiles_t"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), (what, name)
        if g is None:
            continue
        assert g.data.shape == w.data.shape and g.scale.shape == w.scale.shape, (what, name)
        assert g.data.dtype == jnp.float8_e4m3fn and g.scale.dtype == jnp.uint8
        np.testing.assert_array_equal(_u8(g.data), _u8(w.data), err_msg=f"{what} {name} data")
        np.testing.assert_array_equal(_u8(g.scale), _u8(w.scale), err_msg=f"{what} {name} scale")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_the_kernel_writes_the_bytes_of_quantize_then_reblock(dtype):
    x = jnp.asarray(_hostile((256, 384), 0)).astype(dtype)
    want = blocked.from_planes(mxfp8.quantize(x, backend="xla"), rows=True, rows_t=True,
                               tiles_t=True)
    first = quantize_blocked_2d(x, rows=True, rows_t=True, tiles_t=False, interpret=True)
    second = quantize_blocked_2d(x, rows=False, rows_t=False, tiles_t=True, interpret=True)
    assert second.rows is None and second.rows_t is None
    _assert_same(blocked.BlockedPlanes(first.rows, first.rows_t, second.tiles_t), want,
                 jnp.dtype(dtype).name)
    assert first.rows_t.scale.shape == (384, 2) and second.tiles_t.scale.shape == (3, 2)


BLOCKS = [("rows", (32, 128)), ("rows", (64, 128)), ("rows_t", (128, 32)),
          ("rows_t", (128, 64))]


@pytest.mark.parametrize(("output", "block"), BLOCKS, ids=str)
def test_every_program_block_writes_the_same_bytes(output, block):
    """Smaller programs (fewer rows for ``rows``, fewer columns for ``rows_t``) write the bytes
    of quantize-then-re-block, as the 128x128 program does."""
    x = jnp.asarray(_hostile((256, 384), 3)).astype(jnp.bfloat16)
    want = blocked.from_planes(mxfp8.quantize(x, backend="xla"), rows=output == "rows",
                               rows_t=output == "rows_t", tiles_t=False)
    got = quantize_blocked_2d(x, rows=output == "rows", rows_t=output == "rows_t",
                              tiles_t=False, interpret=True, block=block)
    _assert_same(got, want, f"{output} {block}")


WHOLE = [("rows_t", (128, 32)), ("rows_t", (128, 64)), ("rows_t", (128, 128)),
         ("tiles_t", (128, 128))]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(("output", "block"), WHOLE, ids=str)
def test_whole_block_programs_write_the_same_bytes(output, block, dtype):
    """``whole=True`` (each program loads its block at once and stores the transposed codes in
    one store): the bytes of quantize-then-re-block, as the banded programs write them."""
    x = jnp.asarray(_hostile((256, 384), 5)).astype(dtype)
    want = blocked.from_planes(mxfp8.quantize(x, backend="xla"), rows=False,
                               rows_t=output == "rows_t", tiles_t=output == "tiles_t")
    got = quantize_blocked_2d(x, rows=False, rows_t=output == "rows_t",
                              tiles_t=output == "tiles_t", interpret=True, block=block,
                              whole=True)
    _assert_same(got, want, f"{output} {block} whole")


PACKED = [(False, *c) for c in WHOLE] + [(True, "rows_t", (128, 128)),
                                         (True, "tiles_t", (128, 128))]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(("rows", "output", "block"), PACKED, ids=str)
def test_packed_programs_write_the_same_bytes(rows, output, block, dtype):
    """``packed=True`` (row-strided quarters, four rows' codes per int32 word through the
    transpose; with ``rows``, each quarter's rows stored row-strided): the bytes of
    quantize-then-re-block, also for column parts into shared outputs; with ``whole`` it is
    refused."""
    x = jnp.asarray(_hostile((256, 384), 9)).astype(dtype)
    kw = dict(rows=rows, rows_t=output == "rows_t", tiles_t=output == "tiles_t",
              interpret=True, block=block, packed=True)
    want = blocked.from_planes(mxfp8.quantize(x, backend="xla"), **{
        k: kw[k] for k in ("rows", "rows_t", "tiles_t")})
    _assert_same(quantize_blocked_2d(x, **kw), want, f"{output} {block} packed")
    _assert_same(quantize_blocked_2d((x[:, :128], x[:, 128:]), **kw), want,
                 f"{output} {block} packed, column parts")
    with pytest.raises(ValueError, match="packed=True packs a transposed output"):
        quantize_blocked_2d(x, **{**kw, "whole": True})


PART_CALLS = [("rows", (32, 128), False), ("rows", (128, 128), False),
              ("rows_t", (128, 64), False), ("rows_t", (128, 32), True),
              ("tiles_t", (128, 128), False), ("tiles_t", (128, 128), True)]


@pytest.mark.parametrize(("output", "block", "whole"), PART_CALLS, ids=str)
def test_column_parts_write_the_bytes_of_their_concatenation(output, block, whole):
    """x given as column parts (dq, dk, dv): each part's kernel writes its columns into the
    shared outputs, the bytes of the operands of the concatenated x; no concatenation runs."""
    x = jnp.asarray(_hostile((256, 512), 7)).astype(jnp.bfloat16)
    parts = (x[:, :128], x[:, 128:384], x[:, 384:])
    kw = dict(rows=output == "rows", rows_t=output == "rows_t", tiles_t=output == "tiles_t",
              interpret=True, block=block, whole=whole)
    _assert_same(quantize_blocked_2d(parts, **kw), quantize_blocked_2d(x, **kw),
                 f"{output} {block} parts")
    ops = pallas_operand_shapes(lambda *p: quantize_blocked_2d(p, **kw), *parts)
    assert [o[0] for o in ops] == [(256, 128), (256, 256), (256, 128)]
    prims = str(jax.make_jaxpr(lambda *p: quantize_blocked_2d(p, **kw))(*parts))
    assert "concatenate" not in prims


def test_column_parts_are_checked_by_name():
    x = jnp.zeros((128, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="x part 1's .* must be multiples of 128"):
        quantize_blocked_2d((x, x[:, :96]), rows=True, rows_t=False, tiles_t=False,
                            interpret=True, block=(32, 128))
    with pytest.raises(ValueError, match="column parts must share M and dtype"):
        quantize_blocked_2d((x, x.astype(jnp.float32)), rows=True, rows_t=False,
                            tiles_t=False, interpret=True, block=(32, 128))
    with pytest.raises(ValueError, match="no column parts given"):
        quantize_blocked_2d((), rows=True, rows_t=False, tiles_t=False, interpret=True)


def test_whole_blocks_need_a_transposed_output():
    x = jnp.zeros((128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="whole=True loads .* rows alone take whole=False"):
        quantize_blocked_2d(x, rows=True, rows_t=False, tiles_t=False, interpret=True,
                            whole=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("second", ["rows_t", "tiles_t"])
def test_whole_blocks_make_rows_and_a_transposed_output_in_one_call(second, dtype):
    """Two outputs from one loaded block (x read once): the bytes of quantize-then-re-block."""
    x = jnp.asarray(_hostile((256, 384), 11)).astype(dtype)
    kw = dict(rows_t=second == "rows_t", tiles_t=second == "tiles_t")
    want = blocked.from_planes(mxfp8.quantize(x, backend="xla"), rows=True, **kw)
    got = quantize_blocked_2d(x, rows=True, interpret=True, whole=True, **kw)
    _assert_same(got, want, f"rows+{second} whole")
    parts = (x[:, :128], x[:, 128:])
    _assert_same(quantize_blocked_2d(parts, rows=True, interpret=True, whole=True, **kw), want,
                 f"rows+{second} whole, column parts")


def test_the_shift_keeps_signs_nan_and_rounds_to_nearest_even():
    """Every e4m3 byte times 2**diff against float64 ``ldexp`` then ml_dtypes' e4m3 cast (RNE,
    NaN keeps its sign) -- on the GPU too, where a float multiply of a NaN code drops its sign
    (the reference re-block used one until it ran there)."""
    codes = np.arange(256, dtype=np.uint8)
    e4m3 = jnp.dtype(jnp.float8_e4m3fn).type
    for diff in (0, -1, -3, -9, -30, -40):
        want = np.ldexp(codes.view(e4m3).astype(np.float64), diff).astype(e4m3).view(np.uint8)
        got = shift_codes(jnp.asarray(codes), jnp.int32(diff))
        np.testing.assert_array_equal(_u8(got), want, err_msg=f"diff {diff}")
        via_reblock = reblock._shift(lax.bitcast_convert_type(jnp.asarray(codes),
                                                              jnp.float8_e4m3fn), jnp.int32(diff))
        np.testing.assert_array_equal(_u8(via_reblock), want, err_msg=f"reblock, diff {diff}")
    assert _u8(shift_codes(jnp.asarray([0x7F, 0xFF], jnp.uint8), jnp.int32(-5))).tolist() == \
        [0x7F, 0xFF]


@pytest.mark.parametrize("shape", [(70, 96), (200, 256), (1, 32)], ids=str)
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_padding_gives_the_operands_pad_to_gives(shape, backend):
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.bfloat16)
    k = resolve_kernels(KernelConfig(backend=backend, gemm="fp8_blocked"))
    got = blocked.quantize_operands(x, rows=True, rows_t=True, tiles_t=True, kernels=k)
    t = blocked.blocked_tokens(shape[0])
    c = -(-shape[1] // 128) * 128
    q = mxfp8.quantize(L.pad_tokens(x), backend="xla")
    rd, rs = q.plane(Plane.ROWWISE)
    cd, cs = q.plane(Plane.COLWISE)
    rows = reblock.reblock_rows(*reblock.pad_to(rd, _u8(rs), t, c))
    cdt, cst = reblock.pad_to(cd.T, _u8(cs).T, c, t)
    want = blocked.BlockedPlanes(rows, reblock.reblock_rows(cdt, cst),
                                 reblock.reblock_tiles(cdt, cst))
    _assert_same(got, want, f"{backend} {shape}")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_the_linear_layer_gives_the_bytes_of_the_plane_path(backend):
    rng = np.random.default_rng(2)
    t, k_, n = 200, 256, 384
    x = jnp.asarray(rng.standard_normal((t, k_)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16)
    k = resolve_kernels(KernelConfig(backend=backend, gemm="fp8_blocked"))
    wq = L.quantize_weight(jnp.asarray(rng.standard_normal((n, k_)) * 0.05, jnp.float32),
                           kernels=k)
    out = L.forward(x, wq.only(Plane.ROWWISE), out_dtype=jnp.bfloat16, keep_x_colwise=True,
                    kernels=k)
    assert isinstance(out.x_colwise, blocked.KeptTiles) and out.x_colwise.cols == k_
    assert out.x_colwise.tiles.data.shape == (256, 256)  # x^T: K by 200 tokens padded to 256
    got = L.backward(dy, wq.only(Plane.COLWISE), out.x_colwise, dx_dtype=jnp.bfloat16,
                     dw_dtype=jnp.float32, kernels=k)
    xq, dyq = mxfp8.quantize(L.pad_tokens(x), kernels=k), mxfp8.quantize(L.pad_tokens(dy),
                                                                         kernels=k)
    want = {
        "y": mxfp8.matmul(xq, wq, "forward", out_dtype=jnp.bfloat16, kernels=k)[:t],
        "dx": mxfp8.matmul(dyq, wq, "dgrad", out_dtype=jnp.bfloat16, kernels=k)[:t],
        "dw": mxfp8.matmul(dyq, xq, "wgrad", out_dtype=jnp.float32, kernels=k),
    }
    for name, value in (("y", out.y), ("dx", got.dx), ("dw", got.dw)):
        assert value.shape == want[name].shape and value.dtype == want[name].dtype, name
        np.testing.assert_array_equal(np.asarray(value, np.float32),
                                      np.asarray(want[name], np.float32), err_msg=name)
    only_dw = L.backward(dy, None, out.x_colwise, dx_dtype=jnp.bfloat16, dw_dtype=jnp.float32,
                         kernels=k)
    assert only_dw.dx is None
    np.testing.assert_array_equal(np.asarray(only_dw.dw), np.asarray(got.dw))


def test_the_flax_twin_differentiates_through_the_blocked_path():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 128)) * 0.05, jnp.float32)

    def loss(x, w, gemm):
        return jnp.sum(L.mxfp8_linear(x, w, kernels=KernelConfig(gemm=gemm)) ** 2)

    fast = jax.grad(loss, argnums=(0, 1))(x, w, "fp8_blocked")
    exact = jax.grad(loss, argnums=(0, 1))(x, w, "dequant_dot")
    for f, e in zip(fast, exact, strict=True):
        rel = float(jnp.linalg.norm(f - e) / jnp.linalg.norm(e))
        assert rel < 1e-3, rel  # the re-block changes only small elements


def test_requests_that_cannot_be_served_are_refused():
    x = jnp.zeros((128, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_blocked_2d(x, rows=True, rows_t=False, tiles_t=False, interpret=True)
    x = jnp.zeros((128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="rows_t and tiles_t in one call"):
        quantize_blocked_2d(x, rows=False, rows_t=True, tiles_t=True, interpret=True)
    with pytest.raises(ValueError, match="asks for nothing"):
        quantize_blocked_2d(x, rows=False, rows_t=False, tiles_t=False, interpret=True)
    with pytest.raises(ValueError, match="asks for nothing"):
        blocked.quantize_operands(x, rows=False, kernels=resolve_kernels(KernelConfig()))
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        quantize_blocked_2d(x.astype(jnp.float16), rows=True, rows_t=False, tiles_t=False)
    for block, asked in (((32, 128), "rows_t"), ((128, 32), "rows"), ((64, 128), "tiles_t"),
                         ((16, 128), "rows"), ((128, 256), "rows_t")):
        with pytest.raises(ValueError, match=rf"block=\({block[0]}, {block[1]}\) cannot"):
            quantize_blocked_2d(x, rows=asked == "rows", rows_t=asked == "rows_t",
                                tiles_t=asked == "tiles_t", interpret=True, block=block)
    k = resolve_kernels(KernelConfig(gemm="dequant_dot"))
    ops = blocked.quantize_operands(x, rows=True, kernels=k)
    w = mxfp8.quantize(jnp.zeros((128, 256), jnp.float32))
    with pytest.raises(ValueError, match="not one of"):
        blocked.blocked_gemm(ops.rows, w, mxfp8.GemmRole.FORWARD, k, 128, 128)
    kb = resolve_kernels(KernelConfig(gemm="fp8_blocked"))
    with pytest.raises(ValueError, match="a has K = 128, b 256"):
        blocked.blocked_gemm(ops.rows, w, mxfp8.GemmRole.FORWARD, kb, 128, 128)


@pytest.mark.parametrize("one_cast", [True, False], ids=["one-cast", "shift-codes"])
@pytest.mark.parametrize("call", [
    dict(rows=True, rows_t=False, tiles_t=False, block=(32, 128), num_warps=2),
    dict(rows=False, rows_t=True, tiles_t=False, block=(128, 64), num_warps=2),
    dict(rows=True, rows_t=False, tiles_t=True, packed=True),
    dict(rows=True, rows_t=True, tiles_t=False, whole=True),
], ids=["rows", "rows_t", "rows+tiles_t-packed", "rows+rows_t-whole"])
def test_the_compiled_kernels_lower_to_triton_for_cuda(call, one_cast):
    """On the CPU: the native path's kernels (never run here) have a Triton lowering for every
    primitive, with each code by one cast and cast then shifted, and ``one_cast`` picks the
    one-cast function on the native path only (the interpreter's FTZ-proof paths compose)."""
    if jax.default_backend() == "gpu":
        pytest.skip("the gpu-marked test compiles the kernels for real")
    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    traced = jax.jit(lambda v: quantize_blocked_2d(v, one_cast=one_cast, **call)).trace(x)
    assert "triton" in traced.lower(lowering_platforms=("cuda",)).as_text()
    # which codes function the kernels take: the one-cast one only on the native path
    native = pallas_blocked._cast_shift(ElementPath.NATIVE, one_cast)[1]
    assert (native is cast_shift_native) == one_cast
    assert pallas_blocked._cast_shift(ElementPath.FLOAT, one_cast)[1] is not cast_shift_native


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_the_compiled_kernel_writes_the_bytes_of_quantize_then_reblock(dtype):
    """On the GPU: the native element path, compiled, against the xla quantize then re-block
    (XLA keeps subnormals there), on hostile data and a larger tensor; each code by one e4m3
    cast (the default) and cast then shifted (``one_cast=False``)."""
    for shape, seed in (((256, 384), 0), ((1024, 2048), 5)):
        x = jnp.asarray(_hostile(shape, seed)).astype(dtype)
        want = blocked.from_planes(mxfp8.quantize(x, backend="xla"), rows=True, rows_t=True,
                                   tiles_t=True)
        first = quantize_blocked_2d(x, rows=True, rows_t=True, tiles_t=False)
        second = quantize_blocked_2d(x, rows=False, rows_t=False, tiles_t=True)
        _assert_same(blocked.BlockedPlanes(first.rows, first.rows_t, second.tiles_t), want,
                     f"{jnp.dtype(dtype).name} {shape}")
        first = quantize_blocked_2d(x, rows=True, rows_t=True, tiles_t=False, one_cast=False)
        second = quantize_blocked_2d(x, rows=False, rows_t=False, tiles_t=True, one_cast=False)
        _assert_same(blocked.BlockedPlanes(first.rows, first.rows_t, second.tiles_t), want,
                     f"{jnp.dtype(dtype).name} {shape}, cast then shift_codes")
        for output, block in BLOCKS:
            got = quantize_blocked_2d(x, rows=output == "rows", rows_t=output == "rows_t",
                                      tiles_t=False, block=block)
            np.testing.assert_array_equal(_u8(getattr(got, output).data),
                                          _u8(getattr(want, output).data), err_msg=str(block))
            np.testing.assert_array_equal(_u8(getattr(got, output).scale),
                                          _u8(getattr(want, output).scale), err_msg=str(block))
        for second in ("rows_t", "tiles_t"):  # two outputs from one loaded block
            got = quantize_blocked_2d(x, rows=True, rows_t=second == "rows_t",
                                      tiles_t=second == "tiles_t", whole=True)
            _assert_same(got, blocked.BlockedPlanes(
                want.rows, want.rows_t if second == "rows_t" else None,
                want.tiles_t if second == "tiles_t" else None), f"rows+{second} whole {shape}")
        for output, block in WHOLE:  # each program's block loaded at once
            got = quantize_blocked_2d(x, rows=False, rows_t=output == "rows_t",
                                      tiles_t=output == "tiles_t", block=block, whole=True)
            for part in ("data", "scale"):
                np.testing.assert_array_equal(_u8(getattr(getattr(got, output), part)),
                                              _u8(getattr(getattr(want, output), part)),
                                              err_msg=f"{output} {block} whole {part}")
        for rows, output, block in PACKED:  # four rows' codes per int32 word
            got = quantize_blocked_2d(x, rows=rows, rows_t=output == "rows_t",
                                      tiles_t=output == "tiles_t", block=block, packed=True)
            _assert_same(got, blocked.BlockedPlanes(
                want.rows if rows else None, want.rows_t if output == "rows_t" else None,
                want.tiles_t if output == "tiles_t" else None),
                f"{'rows+' if rows else ''}{output} {block} packed {shape}")
        c = x.shape[1] // 3 // 128 * 128  # column parts into shared outputs (aliased), compiled
        parts = (x[:, :c], x[:, c:2 * c], x[:, 2 * c:])
        for output, block, whole in PART_CALLS:
            kw = dict(rows=output == "rows", rows_t=output == "rows_t",
                      tiles_t=output == "tiles_t", block=block, whole=whole)
            _assert_same(quantize_blocked_2d(parts, **kw), quantize_blocked_2d(x, **kw),
                         f"{output} {block} {whole} parts {shape}")
        # and as the linear layer calls it: one call per output, its own warps per output
        k = resolve_kernels(KernelConfig(backend="pallas", gemm="fp8_blocked"))
        _assert_same(blocked.quantize_operands(x, rows=True, rows_t=True, tiles_t=True,
                                               kernels=k), want, f"layer's calls {shape}")


@pytest.mark.slow
def test_unit_programs_on_the_pallas_kernel_train_as_on_the_composition(single_rank_world,
                                                                        monkeypatch):
    """A training step through FSDP's unit programs with ``fp8_blocked``: the Pallas kernel
    (interpreted here) and the xla backend's quantize-then-re-block give the same losses, bit for
    bit (the same operand bytes reach the same GEMMs; the second loss depends on the first step's
    gradients, so dgrad and wgrad are compared too)."""
    if jax.devices()[0].platform == "gpu":
        pytest.skip("CPU-only: Torch's CPU tensors on a GPU machine take the xla backend only "
                    "(kernels._check_device); the GPU's step runs the kernel compiled")

    def losses(backend):
        return two_step_losses(KernelConfig(backend=backend, gemm="fp8_blocked"))

    calls = []
    monkeypatch.setattr(blocked, "quantize_blocked_2d",
                        lambda *a, **k: calls.append(k) or quantize_blocked_2d(*a, **k))
    on_kernel = losses("pallas")
    assert calls, "the unit programs did not run the blocked-operand kernel"
    assert on_kernel == losses("xla")


@pytest.mark.parametrize("how", ["banded", "whole", "packed"])
def test_a_pair_entry_in_the_kernel_config_makes_both_outputs_in_one_call(how, monkeypatch):
    """``KERNEL_CONFIG["rows+tiles_t"]`` / ``["rows+rows_t"]``: the forward's and the
    backward's two operands from one kernel call (x read once), with the bytes of one call per
    output; a third output asked beside the pair takes its own call (packed: its transposed
    outputs packed too)."""
    x = jnp.asarray(_hostile((256, 384), 13)).astype(jnp.bfloat16)
    k = resolve_kernels(KernelConfig(backend="pallas", gemm="fp8_blocked"))
    asks = [dict(rows=True, tiles_t=True), dict(rows=True, rows_t=True),
            dict(rows=True, rows_t=True, tiles_t=True)]
    apart = [blocked.quantize_operands(x, kernels=k, **kw) for kw in asks]
    calls_apart = [len(pallas_operand_shapes(
        lambda v, kw=kw: blocked.quantize_operands(v, kernels=k, **kw), x)) for kw in asks]
    pair = blocked.KernelChoice((128, 128), 8, how == "whole", how == "packed")
    monkeypatch.setitem(blocked.KERNEL_CONFIG, "rows+tiles_t", pair)
    monkeypatch.setitem(blocked.KERNEL_CONFIG, "rows+rows_t", pair)
    if how == "packed":
        for e in ("rows_t", "tiles_t"):
            monkeypatch.setitem(blocked.KERNEL_CONFIG, e,
                                blocked.KERNEL_CONFIG[e]._replace(packed=True))
    for kw, want, n in zip(asks, apart, calls_apart, strict=True):
        _assert_same(blocked.quantize_operands(x, kernels=k, **kw), want, str(kw))
        got_calls = len(pallas_operand_shapes(
            lambda v, kw=kw: blocked.quantize_operands(v, kernels=k, **kw), x))
        assert got_calls == n - 1, (kw, got_calls, n)
