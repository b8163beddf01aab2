"""Slices read where they lie in a longer buffer (``partial_block_amax`` / ``cast_slice`` with
``offset`` and ``numel``; issue 33): the bytes of the same slice cut out, on the reference
(``xla``, the backends' default: the slice cut out, which XLA fuses) and on ``pallas`` (its
kernels read the buffer in place: ``pallas_tiles.FlatView``), for whole tensors and slices that
start and end inside rows and 32-row bands (masked reads), neighbours full of NaN and huge values
that must not leak in; the ``pallas_call``'s operand is the whole buffer (no slice copied out for
it); the FSDP refresh (``bridge.mxfp8_slices``) hands its bf16 buffers over that way; bad
positions are refused by name. Interpreted here; the compiled kernels run in the GPU pass
(``-m gpu``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_side import mxfp8
from tests.jax_side.mxfp8.pallas_calls import pallas_operand_shapes, pallas_operands

M, K, AT = 96, 160, 37  # the tensor, and where it starts in the buffer
SLICES = [(0, M * K), (5, 1000), (K * 33 + 7, 3000), (M * K - 50, 50), (K * 32, K * 32), (9, 0)]


def _buffer(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)) * np.exp2(rng.integers(-12, 12, (M, 1)))
    x[3, 5], x[40, 7] = np.nan, -np.inf
    x = x.astype(np.float32)
    around = (np.full(AT, np.nan, np.float32), np.full(11, 3e38, np.float32))
    return jnp.asarray(np.concatenate([around[0], x.reshape(-1), around[1]])).astype(dtype)


def _same(got, want, what):
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None), what
        if g is not None:
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8),
                                          np.asarray(w).view(np.uint8), err_msg=what)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(("start", "n"), SLICES, ids=str)
def test_a_slice_read_in_place_gives_the_bytes_of_the_slice_cut_out(start, n, dtype, backend):
    buf = _buffer(dtype)
    cut = buf[AT + start:AT + start + n]
    amax = mxfp8.partial_block_amax(buf, (M, K), start, backend=backend, offset=AT + start,
                                    numel=n)
    want = mxfp8.partial_block_amax(cut, (M, K), start, backend="xla")
    _same(amax, want, f"amax {backend}")
    scales = {"rowwise": mxfp8.scales_from_amax(want.rowwise),
              "colwise": mxfp8.scales_from_amax(want.colwise)}
    got = mxfp8.cast_slice(buf, (M, K), start, scales=scales, backend=backend,
                           offset=AT + start, numel=n)
    _same(got, mxfp8.cast_slice(cut, (M, K), start, scales=scales, backend="xla"),
          f"cast {backend}")


def test_the_pallas_kernels_take_the_whole_buffer():
    """No slice of the buffer is cut out for the kernels (a custom call's operand would be a
    copy): both kernels' first operand is the buffer; cut out, it is the slice."""
    buf = _buffer(jnp.bfloat16)
    scales = {"rowwise": jnp.zeros((M, K // 32), jnp.uint8),
              "colwise": jnp.zeros((M // 32, K), jnp.uint8)}

    def both(b, offset, n):
        a = mxfp8.partial_block_amax(b, (M, K), 5, backend="pallas", offset=offset, numel=n)
        c = mxfp8.cast_slice(b, (M, K), 5, scales=scales, backend="pallas", offset=offset,
                             numel=n)
        return a, c

    in_place = pallas_operand_shapes(lambda b: both(b, AT + 5, 1000), buf)
    assert [ops[0] for ops in in_place] == [buf.shape, buf.shape]
    cut = pallas_operand_shapes(lambda b: both(b[AT + 5:AT + 1005], 0, None), buf)
    assert [ops[0] for ops in cut] == [(32, K), (32, K)]  # the slice's band, padded


def _rounding_buffer():
    """fp32 values where bf16 rounding matters: ties to even both ways, one ulp off a tie,
    values that round up into the next binade or to Inf, fp32 subnormals, NaNs of both signs
    with payloads bf16 cannot hold, +-Inf and -0.0, spread over the tensor and its neighbours."""
    rng = np.random.default_rng(1)
    hi = rng.integers(0x0080, 0x7F00, M * K + AT + 11).astype(np.uint32)  # bf16 bit patterns
    low = rng.choice(np.array([0x8000, 0x7FFF, 0x8001, 0xFFFF, 0x0000, 0x1234], np.uint32),
                     hi.size)
    bits = (hi << 16) | low  # ties, near-ties and plain values
    bits |= rng.integers(0, 2, hi.size).astype(np.uint32) << 31
    special = [0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x807FFFFF, 0x00008000, 0x7FC00001,
               0xFF800001, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 0x3F808000,
               0x3F818000]
    at = rng.choice(hi.size, len(special) * 20, replace=False)
    bits[at] = np.tile(np.array(special, np.uint32), 20)
    return jnp.asarray(bits.view(np.float32))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("pair", ["f32 as bf16", "bf16 as f32"])
@pytest.mark.parametrize(("start", "n"), SLICES, ids=str)
def test_a_slice_read_as_another_dtype_gives_the_bytes_of_it_converted(start, n, pair,
                                                                       backend):
    """``read_as``: the slice's values converted as loaded (fp32 master weights read as bf16,
    as the refresh reads them): the bytes of the slice cut out and converted by XLA."""
    buf, read_as = _rounding_buffer(), jnp.bfloat16
    if pair == "bf16 as f32":
        buf, read_as = buf.astype(jnp.bfloat16), jnp.float32
    cut = buf[AT + start:AT + start + n].astype(read_as)
    amax = mxfp8.partial_block_amax(buf, (M, K), start, backend=backend, offset=AT + start,
                                    numel=n, read_as=read_as)
    want = mxfp8.partial_block_amax(cut, (M, K), start, backend="xla")
    _same(amax, want, f"amax {backend}")
    scales = {"rowwise": mxfp8.scales_from_amax(want.rowwise),
              "colwise": mxfp8.scales_from_amax(want.colwise)}
    got = mxfp8.cast_slice(buf, (M, K), start, scales=scales, backend=backend,
                           offset=AT + start, numel=n, read_as=read_as)
    _same(got, mxfp8.cast_slice(cut, (M, K), start, scales=scales, backend="xla"),
          f"cast {backend}")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_whole_buffer_read_as_bf16_is_converted_too(backend):
    """No offset, the whole buffer: ``read_as`` still converts (not skipped as 'nothing to
    cut'), and ``read_as`` equal to the buffer's dtype changes nothing."""
    x = _rounding_buffer()[:M * K]
    want = mxfp8.partial_block_amax(x.astype(jnp.bfloat16), (M, K), 0, backend="xla")
    _same(mxfp8.partial_block_amax(x, (M, K), 0, backend=backend, read_as=jnp.bfloat16), want,
          "whole, converted")
    _same(mxfp8.partial_block_amax(x, (M, K), 0, backend=backend, read_as="float32"),
          mxfp8.partial_block_amax(x, (M, K), 0, backend="xla"), "whole, its own dtype")
    assert not np.array_equal(np.asarray(want.rowwise),
                              np.asarray(mxfp8.partial_block_amax(x, (M, K), 0).rowwise))


def test_the_pallas_kernels_read_an_fp32_buffer_as_bf16_in_place():
    """The conversion happens in the kernels: their operand is the fp32 buffer itself, and no
    XLA convert to bf16 runs before them."""
    buf = _rounding_buffer()
    scales = {"rowwise": jnp.zeros((M, K // 32), jnp.uint8),
              "colwise": jnp.zeros((M // 32, K), jnp.uint8)}

    def both(b):
        a = mxfp8.partial_block_amax(b, (M, K), 5, backend="pallas", offset=AT + 5, numel=1000,
                                     read_as=jnp.bfloat16)
        c = mxfp8.cast_slice(b, (M, K), 5, scales=scales, backend="pallas", offset=AT + 5,
                             numel=1000, read_as=jnp.bfloat16)
        return a, c

    x = [(ops[0].shape, ops[0].dtype) for ops in pallas_operands(both, buf)]
    assert x == [(buf.shape, jnp.float32)] * 2


def test_the_refresh_hands_its_buffers_over_in_place(monkeypatch):
    """``bridge.mxfp8_slices``: every buffer goes to the kernels whole with the piece's offset,
    read as the source dtype (an fp32 master shard is rounded to bf16 as it is loaded)."""
    from bridge import mxfp8_slices as ms

    calls = []
    real = ms.partial_block_amax
    monkeypatch.setattr(ms, "partial_block_amax", lambda flat, *a, **k: calls.append(
        (flat.shape, flat.dtype, k["offset"], k["numel"], k["read_as"])) or real(flat, *a, **k))
    pieces = (ms.Piece((64, 64), 0, 100, 64 * 64), ms.Piece((32, 64), 96, 100 + 4096, 1952))
    for dtype in (jnp.bfloat16, jnp.float32):
        buf = jnp.ones((100 + 4096 + 1952,), dtype)
        ms._packed_partial_amax(buf, pieces, None, jnp.bfloat16)
    assert calls == [((6148,), dtype, offset, n, jnp.bfloat16)
                     for dtype in (jnp.bfloat16, jnp.float32)
                     for offset, n in ((100, 4096), (4196, 1952))]


@pytest.mark.parametrize(("offset", "numel", "msg"), [
    (-1, 10, "outside flat's"), (0, 10**6, "outside flat's"), (5, -2, "outside flat's"),
    (2.5, 10, "offset must be an integer"), (0, 1.5, "numel must be an integer"),
])
def test_bad_positions_are_refused_by_name(offset, numel, msg):
    buf = _buffer(jnp.bfloat16)
    with pytest.raises((ValueError, TypeError), match=msg):
        mxfp8.partial_block_amax(buf, (M, K), 0, offset=offset, numel=numel)


@pytest.mark.parametrize("read_as", [jnp.float16, jnp.int8, "float64", "nonsense"], ids=str)
def test_a_bad_read_as_is_refused_by_name(read_as):
    buf = _buffer(jnp.float32)
    with pytest.raises(TypeError, match="read_as must be bfloat16 or float32"):
        mxfp8.partial_block_amax(buf, (M, K), 0, offset=AT, numel=M * K, read_as=read_as)
    with pytest.raises(TypeError, match="read_as must be bfloat16 or float32"):
        mxfp8.cast_slice(buf, (M, K), 0, scales={"rowwise": jnp.zeros((M, K // 32), jnp.uint8)},
                         offset=AT, numel=M * K, read_as=read_as)


@pytest.mark.gpu
def test_the_compiled_kernels_round_fp32_to_bf16_as_xla_does():
    """On the GPU: Triton's fp32 -> bf16 conversion inside the kernels gives the bytes of XLA's
    (the refresh's old path: cut, convert, then the kernels), on every rounding case above."""
    buf = _rounding_buffer()
    for start, n in SLICES:
        cut = buf[AT + start:AT + start + n].astype(jnp.bfloat16)
        want = mxfp8.partial_block_amax(cut, (M, K), start, backend="pallas")
        _same(mxfp8.partial_block_amax(buf, (M, K), start, backend="pallas", offset=AT + start,
                                       numel=n, read_as=jnp.bfloat16), want,
              f"amax {start} {n}")
        scales = {"rowwise": mxfp8.scales_from_amax(want.rowwise),
                  "colwise": mxfp8.scales_from_amax(want.colwise)}
        _same(mxfp8.cast_slice(buf, (M, K), start, scales=scales, backend="pallas",
                               offset=AT + start, numel=n, read_as=jnp.bfloat16),
              mxfp8.cast_slice(cut, (M, K), start, scales=scales, backend="pallas"),
              f"cast {start} {n}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_the_compiled_kernels_read_slices_in_place(dtype):
    """On the GPU: the compiled kernels, every slice above, against the reference cut out."""
    buf = _buffer(dtype)
    for start, n in SLICES:
        cut = buf[AT + start:AT + start + n]
        want = mxfp8.partial_block_amax(cut, (M, K), start, backend="xla")
        _same(mxfp8.partial_block_amax(buf, (M, K), start, backend="pallas", offset=AT + start,
                                       numel=n), want, f"amax {start} {n}")
        scales = {"rowwise": mxfp8.scales_from_amax(want.rowwise),
                  "colwise": mxfp8.scales_from_amax(want.colwise)}
        _same(mxfp8.cast_slice(buf, (M, K), start, scales=scales, backend="pallas",
                               offset=AT + start, numel=n),
              mxfp8.cast_slice(cut, (M, K), start, scales=scales, backend="xla"),
              f"cast {start} {n}")
