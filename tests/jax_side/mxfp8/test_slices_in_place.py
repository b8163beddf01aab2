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
from tests.jax_side.mxfp8.pallas_calls import pallas_operand_shapes

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


def test_the_refresh_hands_its_buffers_over_in_place(monkeypatch):
    """``bridge.mxfp8_slices``: a buffer already in the source dtype goes to the kernels whole
    with the piece's offset; one in another dtype is cut and cast first (XLA fuses both)."""
    from bridge import mxfp8_slices as ms

    calls = []
    real = ms.partial_block_amax
    monkeypatch.setattr(ms, "partial_block_amax", lambda flat, *a, **k: calls.append(
        (flat.shape, flat.dtype, k["offset"], k["numel"])) or real(flat, *a, **k))
    pieces = (ms.Piece((64, 64), 0, 100, 64 * 64), ms.Piece((32, 64), 96, 100 + 4096, 1952))
    for dtype in (jnp.bfloat16, jnp.float32):
        buf = jnp.ones((100 + 4096 + 1952,), dtype)
        ms._packed_partial_amax(buf, pieces, None, jnp.bfloat16)
    assert calls == [((6148,), jnp.bfloat16, 100, 4096), ((6148,), jnp.bfloat16, 4196, 1952),
                     ((4096,), jnp.bfloat16, 0, None), ((1952,), jnp.bfloat16, 0, None)]


@pytest.mark.parametrize(("offset", "numel", "msg"), [
    (-1, 10, "outside flat's"), (0, 10**6, "outside flat's"), (5, -2, "outside flat's"),
    (2.5, 10, "offset must be an integer"), (0, 1.5, "numel must be an integer"),
])
def test_bad_positions_are_refused_by_name(offset, numel, msg):
    buf = _buffer(jnp.bfloat16)
    with pytest.raises((ValueError, TypeError), match=msg):
        mxfp8.partial_block_amax(buf, (M, K), 0, offset=offset, numel=numel)


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
