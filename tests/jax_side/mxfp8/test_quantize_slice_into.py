"""``quantize_slice_into`` (issue 33): a slice's block amax and both planes, the scales from that
amax alone, written into a 1-D uint8 array where they go -- the FSDP refresh's one pass where no
rank's amax changes another's scales. The bytes and the amax are those of ``partial_block_amax``
then ``cast_slice_into`` with the scales of that amax (the two-pass recipe), for whole tensors,
whole 32-row bands and slices inside rows, bf16 and fp32 read as bf16, hostile values (NaN, Inf,
subnormals, neighbours of NaN and 3e38); the ``pallas`` backend makes a slice of whole bands in
ONE kernel that reads the buffer and writes the array in place (the amax kernel does not run),
other slices in the two passes. Interpreted here; compiled in the GPU pass (``-m gpu``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_side import mxfp8
from tests.jax_side.mxfp8.pallas_calls import pallas_operand_shapes
from tests.jax_side.mxfp8.test_slices_into import AT, SENTINEL, SLICES, K, M, _case, _expected


def _reference(out, ats, cut, start):
    """The two passes: the slice's amax (cut out, on the reference), its scales, the cast."""
    amax = mxfp8.partial_block_amax(cut, (M, K), start, backend="xla")
    scales = {"rowwise": mxfp8.scales_from_amax(amax.rowwise),
              "colwise": mxfp8.scales_from_amax(amax.colwise)}
    return _expected(out, ats, cut, start, scales), amax


def _check(backend, read_as, buf, start, n):
    out = jnp.full((2 * M * K + 300,), SENTINEL, jnp.uint8)
    ats = (7, M * K + 150)
    got, amax = mxfp8.quantize_slice_into(out, ats, buf, (M, K), start, backend=backend,
                                          offset=AT + start, numel=n, read_as=read_as)
    cut = buf[AT + start:AT + start + n].astype(read_as or buf.dtype)
    want, want_amax = _reference(out, ats, cut, start)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"bytes {start} {n}")
    for plane in ("rowwise", "colwise"):
        np.testing.assert_array_equal(np.asarray(getattr(amax, plane)).view(np.uint32),
                                      np.asarray(getattr(want_amax, plane)).view(np.uint32),
                                      err_msg=f"{plane} amax {start} {n}")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("read", ["bf16", "f32 as bf16"])
@pytest.mark.parametrize(("start", "n"), SLICES, ids=str)
def test_one_pass_gives_the_amax_and_bytes_of_the_two_passes(start, n, read, backend):
    read_as = jnp.bfloat16 if read == "f32 as bf16" else None
    buf, _ = _case(jnp.bfloat16)
    _check(backend, read_as, buf if read_as is not None else buf.astype(jnp.bfloat16), start, n)


def test_the_pallas_backend_reads_whole_bands_once_and_other_slices_twice():
    """A slice of whole 32-row bands: one kernel, whose operands are the whole buffer and the
    whole array (written in place); a slice inside rows: the amax kernel, then the cast."""
    buf, _ = _case(jnp.bfloat16)
    out = jnp.zeros((2 * M * K,), jnp.uint8)

    def calls(start, n):
        return pallas_operand_shapes(lambda o, b: mxfp8.quantize_slice_into(
            o, (0, M * K), b, (M, K), start, backend="pallas", offset=AT + start, numel=n,
            read_as=jnp.bfloat16), out, buf)

    assert calls(K * 32, K * 64) == [[buf.shape, out.shape]]
    amax, *scales, cast = calls(5, 1000)  # the amax, each plane's scales, the cast
    assert amax == [buf.shape] and len(scales) == 2 and cast[0] == buf.shape


@pytest.mark.parametrize(("kw", "msg"), [
    (dict(out=jnp.zeros((100,), jnp.uint8)), "room for the slice's 1000 bytes"),
    (dict(out=jnp.zeros((4000,), jnp.int8)), "1-D uint8 array"),
    (dict(at=(0, 2.5)), "at must be an integer"),
    (dict(numel=10**6), "lies outside"),
])
def test_bad_arrays_and_positions_are_refused_by_name(kw, msg):
    buf = _case(jnp.bfloat16)[0].astype(jnp.bfloat16)
    with pytest.raises((ValueError, TypeError), match=msg):
        mxfp8.quantize_slice_into(kw.get("out", jnp.zeros((4000,), jnp.uint8)),
                                  kw.get("at", (0, 2000)), buf, (M, K), 5, offset=AT + 5,
                                  numel=kw.get("numel", 1000))


@pytest.mark.gpu
@pytest.mark.parametrize("read", ["bf16", "f32 as bf16"])
def test_the_compiled_kernel_gives_the_two_passes_bytes(read):
    """On the GPU: the compiled one-pass kernel (whole bands) and the two passes (other slices)
    against the reference's amax and bytes, the array's other bytes untouched."""
    read_as = jnp.bfloat16 if read == "f32 as bf16" else None
    buf, _ = _case(jnp.bfloat16)
    buf = buf if read_as is not None else buf.astype(jnp.bfloat16)
    for start, n in SLICES:
        _check("pallas", read_as, buf, start, n)
