"""``bridge.mxfp8_slices``: the refresh's images, written in place into one zero array, hold the
bytes of the concatenating program (``_scales_and_cast``) at the caller's offsets, zeros between
pieces; and the zero array is filled, not padded (XLA's pad of the whole array is several times
slower)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge import mxfp8_slices as S

SHAPES = [(64, 96), (32, 64), (128, 32)]


def _case(world_rank: int):
    """Pieces of SHAPES in one buffer with gaps; on rank 1 of 2 each piece is its second half."""
    pieces, offset = [], 0
    for m, k in SHAPES:
        n = m * k // 2 if world_rank else m * k
        start = m * k - n
        pieces.append(S.Piece((m, k), start, offset, n))
        offset += n + 40
    scale_at, total = [], 0
    for m, k in SHAPES:
        scale_at.append(total)
        total += m * k // 32 + 8
    buf = jax.random.normal(jax.random.key(world_rank), (offset,), jnp.float32)
    amax = jnp.abs(jax.random.normal(jax.random.key(9), (S.amax_numel(pieces),))) + 0.25
    return buf, amax, tuple(pieces), S.ScaleLayout(tuple(scale_at), total)


def _placed(buf, amax, pieces, layout) -> np.ndarray:
    """The reference: ``_scales_and_cast``'s concatenated bytes put at the images' offsets."""
    packed = np.asarray(S._scales_and_cast(buf, amax, pieces, None, jnp.bfloat16))
    n = buf.shape[0]
    want = np.zeros(2 * n + 2 * layout.total, np.uint8)
    at = 0
    for p in pieces:  # the data: row then col bytes of each piece
        want[p.offset:p.offset + p.numel] = packed[at:at + p.numel]
        want[n + p.offset:n + p.offset + p.numel] = packed[at + p.numel:at + 2 * p.numel]
        at += 2 * p.numel
    for p, s in zip(pieces, layout.offsets, strict=True):  # then each piece's two scales
        k = p.shape[0] * p.shape[1] // 32
        want[2 * n + s:2 * n + s + k] = packed[at:at + k]
        want[2 * n + layout.total + s:2 * n + layout.total + s + k] = packed[at + k:at + 2 * k]
        at += 2 * k
    assert at == packed.shape[0]
    return want


def test_batched_images_are_the_concatenated_bytes_in_place_with_a_fill_not_a_pad():
    cases = [_case(0), _case(1)]
    args = (tuple(c[0] for c in cases), jnp.concatenate([c[1] for c in cases]),
            tuple(c[2] for c in cases), None, jnp.bfloat16, tuple(c[3] for c in cases))
    (got,), _ = S._batched_scales_and_cast_images(*args)  # one run: below 2**31 bytes
    got = np.asarray(got)
    want = np.concatenate([_placed(*c) for c in cases])
    assert got.tobytes() == want.tobytes()
    single = np.asarray(S._scales_and_cast_images(cases[1][0], cases[1][1], cases[1][2], None,
                                                  jnp.bfloat16, cases[1][3]))
    assert single.tobytes() == _placed(*cases[1]).tobytes()
    hlo = S._batched_scales_and_cast_images.lower(*args).compile().as_text()
    assert f"u8[{want.shape[0]}]{{0}} pad(" not in hlo, "the images array is padded, not filled"
    assert f"u8[{want.shape[0]}]{{0}} broadcast(" in hlo and "dynamic-update-slice(" in hlo


def test_the_pallas_refresh_reads_fp32_buffers_as_bf16_with_the_reference_bytes():
    """The refresh's programs on the ``pallas`` backend (interpreted): the fp32 buffer goes to
    the kernels whole, each value rounded to bf16 as it is loaded (``read_as``), and the packed
    amax and the images are the bytes of the reference backend's cut-and-convert."""
    from common.kernels import Backend

    for rank in (0, 1):
        buf, amax, pieces, layout = _case(rank)
        for b in (buf, buf * 3e-38, buf.at[::7].set(jnp.nan)):  # plain, subnormal, NaN
            want = np.asarray(S._packed_partial_amax(b, pieces, None, jnp.bfloat16))
            got = np.asarray(S._packed_partial_amax(b, pieces, Backend.PALLAS, jnp.bfloat16))
            assert got.tobytes() == want.tobytes()
            want = np.asarray(S._scales_and_cast_images(b, amax, pieces, None, jnp.bfloat16,
                                                        layout))
            got = np.asarray(S._scales_and_cast_images(b, amax, pieces, Backend.PALLAS,
                                                       jnp.bfloat16, layout))
            assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_one_pass_images_and_amax_are_the_two_programs_of_the_unreduced_amax(backend):
    """``batched_quantize_images``' program (no packed amax given): the packed partial amax and
    the images of the two programs fed that amax unreduced, for whole parameters, halves (one
    of whole 32-row bands, one inside a band: read twice) and a piece the rank owns none of."""
    from common.kernels import Backend

    b = Backend(backend)
    (buf0, _, whole, lay0), (buf1, _, halves, lay1) = _case(0), _case(1)
    halves = (*halves[:2], halves[2]._replace(numel=0))  # owns none of the last parameter
    args = ((buf0, buf1), (whole, halves), b, jnp.bfloat16, (lay0, lay1))
    packed = S._batched_partial_amax(args[0], args[1], b, jnp.bfloat16)
    (want,), none = S._batched_scales_and_cast_images(args[0], packed, *args[1:])
    (got,), amax = S._batched_scales_and_cast_images(args[0], None, *args[1:])
    assert none is None
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert np.asarray(amax).tobytes() == np.asarray(packed).tobytes()


def test_runs_keep_each_array_below_the_limit_in_order():
    assert S.runs([10, 20, 30], limit=100) == [[0, 1, 2]]
    assert S.runs([60, 30, 20, 50], limit=100) == [[0, 1], [2, 3]]
    assert S.runs([150, 10, 10], limit=100) == [[0], [1, 2]]  # too large alone: its own run
    assert S.runs([10, 150, 10], limit=100) == [[0], [1], [2]]
    assert S.runs([], limit=100) == []


def test_a_batch_past_the_limit_comes_back_in_runs_with_the_same_bytes():
    """Images past the limit (2**31 bytes in use: the kernels' int32 offsets) come back as one
    array per run, each run's buffers one after another as in one array."""
    cases = [_case(0), _case(1), _case(0)]
    args = (tuple(c[0] for c in cases), jnp.concatenate([c[1] for c in cases]),
            tuple(c[2] for c in cases), None, jnp.bfloat16, tuple(c[3] for c in cases))
    want = [_placed(*c) for c in cases]
    limit = want[0].shape[0] + want[1].shape[0] + 1  # the first two fit, the third does not
    got, _ = S._batched_scales_and_cast_images(*args, limit=limit)
    assert [np.asarray(g).tobytes() for g in got] == [np.concatenate(want[:2]).tobytes(),
                                                      want[2].tobytes()]


def _poisoned(numel, dtype, spans):
    """``unit_grads.written_buffer`` as the GPU's ``cublaslt.zeroed_gaps`` leaves memory: the
    gaps between the spans zero, every other byte left as it was (0xA5 here)."""
    from jax_side.unit_grads import gaps

    a = jnp.full((numel,), 0xA5, dtype)
    for start, length in gaps(numel, spans):
        a = a.at[start:start + length].set(0)
    return a


def test_gapped_images_write_every_byte_the_gaps_do_not_zero(monkeypatch):
    """With ``gapped`` (a GPU with the ``fp8_blocked`` GEMMs) the images array is not filled
    first: only the gaps between the bytes ``_images_into`` writes are zeroed. On memory whose
    every other byte is poison, the images still hold the reference's bytes (every span is
    written), for each backend, batched and alone; the spans and the gaps tile the array."""
    from common.kernels import Backend
    from jax_side.unit_grads import gaps

    monkeypatch.setattr(S, "written_buffer", _poisoned)
    cases = [_case(0), _case(1)]
    for backend in (None, Backend.PALLAS):
        args = (tuple(c[0] for c in cases), jnp.concatenate([c[1] for c in cases]),
                tuple(c[2] for c in cases), backend, jnp.bfloat16, tuple(c[3] for c in cases))
        (got,), _ = S._batched_scales_and_cast_images(*args, gapped=True)
        want = np.concatenate([_placed(*c) for c in cases])
        assert np.asarray(got).tobytes() == want.tobytes(), backend
        buf, amax, pieces, layout = cases[1]
        single = S._scales_and_cast_images(buf, amax, pieces, backend, jnp.bfloat16, layout,
                                           gapped=True)
        assert np.asarray(single).tobytes() == _placed(*cases[1]).tobytes(), backend
    buf, _, pieces, layout = cases[1]
    numel = S._images_numel(buf.shape[0], layout)
    spans = S._images_spans(0, buf.shape[0], pieces, layout)
    covered = np.zeros(numel, np.int64)
    for start, length in [*spans, *gaps(numel, spans)]:
        covered[start:start + length] += 1
    assert (covered == 1).all()


def test_images_are_gapped_only_with_the_blocked_gemms_on_a_gpu(monkeypatch):
    import torch

    from common.kernels import GemmImpl

    assert not S._images_kernels(None, torch.device("cpu"))[1]
    for gemm, want in ((GemmImpl.FP8_BLOCKED, True), (GemmImpl.FP8_BLOCKED_PALLAS, True),
                       (GemmImpl.DEQUANT_DOT, False)):
        monkeypatch.setattr(S, "resolve_for", lambda kernels, device, gemm=gemm:
                            type("R", (), {"gemm": gemm, "slices": "b"})())
        assert S._images_kernels(None, torch.device("cuda")) == ("b", want), gemm


@pytest.mark.gpu
def test_on_the_gpu_gapped_images_on_dirty_memory_hold_the_reference_bytes():
    """Compiled, with ``cublaslt.zeroed_gaps`` on memory that held 0xFF bytes: the images hold
    the reference's bytes (the xla backend's concatenating program), zeros in the gaps."""
    from common.kernels import Backend
    from jax_side.mxfp8 import cublaslt

    assert cublaslt.status().ok, cublaslt.status().reason
    cases = [_case(0), _case(1)]
    args = (tuple(c[0] for c in cases), jnp.concatenate([c[1] for c in cases]),
            tuple(c[2] for c in cases), Backend.PALLAS, jnp.bfloat16, tuple(c[3] for c in cases))
    want = np.concatenate([_placed(*c) for c in cases])
    jax.block_until_ready(S._batched_scales_and_cast_images(*args, gapped=True))  # compiled
    dirty = jnp.full(want.shape, 0xFF, jnp.uint8).block_until_ready()
    del dirty
    (got,), _ = S._batched_scales_and_cast_images(*args, gapped=True)
    assert np.asarray(got).tobytes() == want.tobytes()
