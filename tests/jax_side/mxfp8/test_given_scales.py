"""The transposed blocked operands with their colwise scale bytes given (issue 33;
``pallas_blocked.quantize_blocked_2d``'s ``col_scales`` / ``given_scales``,
``blocked_operands.KernelChoice.given``):

- the rows' call writes the colwise plane's scale bytes, those of the MXFP8 quantize, for every
  rows block;
- the transposed outputs made from them (each band of x read once) are the bytes of
  quantize-then-re-block, for every program block, bf16 and fp32 hostile data, column parts
  and a prologue (the GELU), interpreted here and compiled on the GPU;
- the layer's calls with ``given`` set in ``KERNEL_CONFIG`` give the bytes of the calls
  without it, with as many kernel calls, the transposed one reading the (M/32, K) bytes;
- requests that cannot be served are refused by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from common.kernels import KernelConfig
from jax_side import mxfp8
from jax_side.mxfp8 import blocked_operands as blocked
from jax_side.mxfp8.kernels import resolve_kernels
from jax_side.mxfp8.pallas_blocked import quantize_blocked_2d
from models.gpt_math import gelu_tanh
from tests.jax_side.mxfp8.pallas_calls import pallas_operands
from tests.jax_side.mxfp8.test_blocked_operands import _assert_same, _hostile, _u8

TRANSPOSED = [("rows_t", (128, 32)), ("rows_t", (128, 64)), ("rows_t", (128, 128)),
              ("tiles_t", (128, 128))]


def _colwise_scale_bytes(x):
    return _u8(mxfp8.quantize(x, backend="xla").plane("colwise")[1])


def _given_calls(x, output, block, rows_block=(32, 128), interpret=True, pre=None):
    """The rows' call with the scale bytes, then the transposed output's call given them."""
    r = quantize_blocked_2d(x, rows=True, rows_t=False, tiles_t=False, interpret=interpret,
                            block=rows_block, col_scales=True, pre=pre)
    t = quantize_blocked_2d(x, rows=False, rows_t=output == "rows_t",
                            tiles_t=output == "tiles_t", interpret=interpret, block=block,
                            given_scales=r.col_scales, pre=pre)
    return r, t


@pytest.mark.parametrize("block", [(32, 128), (64, 128), (128, 128)], ids=str)
def test_the_rows_call_writes_the_colwise_planes_scale_bytes(block):
    x = jnp.asarray(_hostile((256, 384), 21)).astype(jnp.bfloat16)
    r = quantize_blocked_2d(x, rows=True, rows_t=False, tiles_t=False, interpret=True,
                            block=block, col_scales=True)
    assert r.col_scales.shape == (8, 384) and r.col_scales.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(r.col_scales), _colwise_scale_bytes(x))
    plain = quantize_blocked_2d(x, rows=True, rows_t=False, tiles_t=False, interpret=True,
                                block=block)
    assert plain.col_scales is None
    _assert_same(r, plain, f"rows {block} with and without the scale bytes")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(("output", "block"), TRANSPOSED, ids=str)
def test_transposed_outputs_from_given_scales_are_the_bytes_of_quantize_then_reblock(
        output, block, dtype):
    x = jnp.asarray(_hostile((256, 384), 23)).astype(dtype)
    want = blocked.from_planes(mxfp8.quantize(x, backend="xla"), rows=True,
                               rows_t=output == "rows_t", tiles_t=output == "tiles_t")
    r, t = _given_calls(x, output, block)
    _assert_same(blocked.BlockedPlanes(r.rows, t.rows_t, t.tiles_t), want,
                 f"{output} {block} given")


@pytest.mark.parametrize("output", ["rows_t", "tiles_t"])
def test_given_scales_serve_column_parts_and_a_prologue(output):
    """x as column parts (each part's call reads its columns of the whole's bytes) and with the
    GELU applied as x is loaded: the bytes of the calls that compute the scales themselves."""
    x = jnp.asarray(_hostile((256, 512), 25)).astype(jnp.bfloat16)
    parts = (x[:, :128], x[:, 128:384], x[:, 384:])
    block = (128, 64) if output == "rows_t" else (128, 128)
    kw = dict(rows_t=output == "rows_t", tiles_t=output == "tiles_t", interpret=True,
              block=block)
    for xs, pre in ((parts, None), (x, gelu_tanh), (parts, gelu_tanh)):
        r, t = _given_calls(xs, output, block, pre=pre)
        want = quantize_blocked_2d(x, rows=False, pre=pre, **kw)
        _assert_same(blocked.BlockedPlanes(None, t.rows_t, t.tiles_t), want,
                     f"{output} parts={xs is parts} pre={pre is not None}")
        np.testing.assert_array_equal(
            np.asarray(r.col_scales),
            _colwise_scale_bytes(x if pre is None else gelu_tanh(x)))


def test_the_layer_takes_given_scales_where_the_kernel_config_says_so(monkeypatch):
    """``KernelChoice.given`` on the transposed entries (the default): ``quantize_operands``
    makes the bytes it makes without it, with as many kernel calls; the rows' call then writes
    the (M/32, K) bytes and every transposed call reads them (none without ``given``, nor
    where the rows are not asked)."""
    x = jnp.asarray(_hostile((256, 384), 27)).astype(jnp.bfloat16)
    k = resolve_kernels(KernelConfig(backend="pallas", gemm="fp8_blocked"))
    asks = [dict(rows=True, tiles_t=True), dict(rows=True, rows_t=True),
            dict(rows=True, rows_t=True, tiles_t=True), dict(rows=False, rows_t=True)]
    assert all(blocked.KERNEL_CONFIG[e].given for e in ("rows_t", "tiles_t"))

    def given(on):
        for e in ("rows_t", "tiles_t"):
            monkeypatch.setitem(blocked.KERNEL_CONFIG, e,
                                blocked.KERNEL_CONFIG[e]._replace(given=on))

    def run(kw):
        calls = pallas_operands(lambda v: blocked.quantize_operands(v, kernels=k, **kw), x)
        reading = sum([(tuple(a.shape), a.dtype) for a in ops[1:]] == [((8, 384), jnp.uint8)]
                      for ops in calls)
        return blocked.quantize_operands(x, kernels=k, **kw), len(calls), reading

    given(False)
    apart = [run(kw) for kw in asks]
    given(True)
    for kw, (want, n, none) in zip(asks, apart, strict=True):
        got, calls, reading = run(kw)
        _assert_same(got, want, str(kw))
        assert calls == n and none == 0, (kw, calls, n, none)
        assert reading == (n - 1 if kw["rows"] else 0), (kw, reading)


def test_requests_for_scale_bytes_that_cannot_be_served_are_refused():
    x = jnp.zeros((256, 256), jnp.bfloat16)
    good = jnp.zeros((8, 256), jnp.uint8)
    with pytest.raises(ValueError, match="col_scales=True writes the colwise scale bytes"):
        quantize_blocked_2d(x, rows=True, rows_t=True, tiles_t=False, interpret=True,
                            col_scales=True)
    with pytest.raises(ValueError, match="col_scales=True writes the colwise scale bytes"):
        quantize_blocked_2d(x, rows=False, rows_t=True, tiles_t=False, interpret=True,
                            col_scales=True)
    for bad in (dict(rows=True, rows_t=True), dict(rows_t=True, whole=True),
                dict(tiles_t=True, packed=True), dict(rows=True)):
        kw = {**dict(rows=False, rows_t=False, tiles_t=False, interpret=True), **bad}
        with pytest.raises(ValueError, match="given_scales serve a call that makes one "
                                             "transposed output"):
            quantize_blocked_2d(x, given_scales=good, **kw)
    for wrong in (jnp.zeros((8, 128), jnp.uint8), jnp.zeros((2, 256), jnp.uint8),
                  jnp.zeros((8, 256), jnp.int32)):
        with pytest.raises(ValueError, match=r"given_scales must be the \(M/32, K\) = "
                                             r"\(8, 256\) uint8"):
            quantize_blocked_2d(x, rows=False, rows_t=True, tiles_t=False, interpret=True,
                                given_scales=wrong)


def test_the_given_scale_kernels_lower_to_triton_for_cuda():
    """On the CPU: the compiled (native path) rows call with the scale bytes and the transposed
    calls given them have a Triton lowering."""
    if jax.default_backend() == "gpu":
        pytest.skip("the gpu-marked test compiles the kernels for real")

    def both(v):
        r = quantize_blocked_2d(v, rows=True, rows_t=False, tiles_t=False, block=(32, 128),
                                num_warps=2, col_scales=True)
        t = quantize_blocked_2d(v, rows=False, rows_t=True, tiles_t=False, block=(128, 64),
                                num_warps=2, given_scales=r.col_scales)
        u = quantize_blocked_2d(v, rows=False, rows_t=False, tiles_t=True, num_warps=4,
                                given_scales=r.col_scales)
        return r, t, u

    traced = jax.jit(both).trace(jax.ShapeDtypeStruct((256, 256), jnp.bfloat16))
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("triton") >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_the_compiled_given_scale_kernels_write_the_bytes_of_quantize_then_reblock(dtype):
    """On the GPU: the native element path, compiled, against XLA's quantize then re-block, on
    hostile data and a larger tensor, every transposed block; column parts."""
    for shape, seed in (((256, 384), 0), ((1024, 2048), 5)):
        x = jnp.asarray(_hostile(shape, seed)).astype(dtype)
        q = mxfp8.quantize(x, backend="xla")
        want = blocked.from_planes(q, rows=True, rows_t=True, tiles_t=True)
        for output, block in TRANSPOSED:
            r, t = _given_calls(x, output, block, interpret=False)
            np.testing.assert_array_equal(np.asarray(r.col_scales),
                                          _u8(q.plane("colwise")[1]))
            _assert_same(blocked.BlockedPlanes(
                r.rows, t.rows_t, t.tiles_t), blocked.BlockedPlanes(
                want.rows, want.rows_t if output == "rows_t" else None,
                want.tiles_t if output == "tiles_t" else None), f"{output} {block} {shape}")
        c = x.shape[1] // 3 // 128 * 128
        parts = (x[:, :c], x[:, c:2 * c], x[:, 2 * c:])
        r, t = _given_calls(parts, "tiles_t", (128, 128), interpret=False)
        _assert_same(blocked.BlockedPlanes(r.rows, None, t.tiles_t), blocked.BlockedPlanes(
            want.rows, None, want.tiles_t), f"tiles_t parts {shape}")
        assert lax.bitcast_convert_type(t.tiles_t.data, jnp.uint8).shape == (shape[1], shape[0])
