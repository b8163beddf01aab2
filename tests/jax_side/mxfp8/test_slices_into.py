"""``cast_slice_into`` (issue 33): a slice's two planes written into a 1-D uint8 array where they
go -- the refresh's images (``bridge.mxfp8_slices``) -- with the bytes of ``cast_slice`` of the
slice cut out, the rest of the array as it was; the ``pallas`` kernel writes a slice of whole
32-row bands straight into the array (the array is its aliased operand, no plane-sized result
and no ``dynamic_update_slice`` of one), other slices go through the backends' default (cast,
then XLA's in-place updates); bad arrays and positions are refused by name. Interpreted here;
compiled in the GPU pass (``-m gpu``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_side import mxfp8
from tests.jax_side.mxfp8.pallas_calls import pallas_operand_shapes

M, K, AT = 96, 160, 37  # the tensor, and where it starts in the buffer
# whole, inside rows (masked band), whole 32-row bands (in place), the last row, empty
SLICES = [(0, M * K), (5, 1000), (K * 32, K * 64), (M * K - K, K), (9, 0)]
SENTINEL = 0xAB


def _case(dtype, seed=0):
    """An fp32 buffer holding the tensor at AT, and the scales of the tensor as ``dtype``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)) * np.exp2(rng.integers(-12, 12, (M, 1)))
    x[3, 5], x[40, 7], x[70, 9] = np.nan, -np.inf, 1e-41
    around = (np.full(AT, np.nan), np.full(11, 3e38))
    buf = jnp.asarray(np.concatenate([around[0], x.reshape(-1), around[1]]).astype(np.float32))
    want = mxfp8.partial_block_amax(buf[AT:AT + M * K].astype(dtype), (M, K), 0, backend="xla")
    scales = {"rowwise": mxfp8.scales_from_amax(want.rowwise),
              "colwise": mxfp8.scales_from_amax(want.colwise)}
    return buf, scales


def _expected(out, ats, cut, start, scales):
    want = np.asarray(out).copy()
    c = mxfp8.cast_slice(cut, (M, K), start, scales=scales, backend="xla")
    for at, codes in zip(ats, (c.rowwise, c.colwise), strict=True):
        want[at:at + cut.shape[0]] = np.asarray(codes).view(np.uint8)
    return want


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("read", ["bf16", "f32", "f32 as bf16"])
@pytest.mark.parametrize(("start", "n"), SLICES, ids=str)
def test_the_planes_land_where_they_go_with_the_bytes_of_the_slice_cut_out(start, n, read,
                                                                           backend):
    dtype = jnp.bfloat16 if read == "bf16" else jnp.float32
    read_as = jnp.bfloat16 if read == "f32 as bf16" else None
    buf, scales = _case(read_as or dtype)
    buf = buf if read_as is not None else buf.astype(dtype)
    out = jnp.full((2 * M * K + 300,), SENTINEL, jnp.uint8)
    ats = (7, M * K + 150)
    got = mxfp8.cast_slice_into(out, ats, buf, (M, K), start, scales=scales, backend=backend,
                                offset=AT + start, numel=n, read_as=read_as)
    cut = buf[AT + start:AT + start + n].astype(read_as or dtype)
    np.testing.assert_array_equal(np.asarray(got), _expected(out, ats, cut, start, scales))


def _dus_sizes(fn, *args):
    """The update sizes of every ``dynamic_update_slice`` in ``fn``'s jaxpr (sub-jaxprs too)."""
    sizes = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dynamic_update_slice":
                sizes.append(int(np.prod(e.invars[1].aval.shape)))
            for v in e.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sizes


def test_the_pallas_kernel_writes_whole_bands_in_place_and_hands_other_slices_on():
    """A slice of whole 32-row bands: one kernel whose operands are the whole buffer and the
    whole array, no update of a plane's size; a slice inside rows: the planes cast apart and
    written by two updates (the backends' default)."""
    buf, scales = _case(jnp.bfloat16)
    out = jnp.zeros((2 * M * K,), jnp.uint8)

    def into(o, b, start, n):
        return mxfp8.cast_slice_into(o, (0, M * K), b, (M, K), start, scales=scales,
                                     backend="pallas", offset=AT + start, numel=n,
                                     read_as=jnp.bfloat16)

    whole = (K * 32, K * 64)
    assert [ops[0] for ops in pallas_operand_shapes(lambda o, b: into(o, b, *whole), out,
                                                    buf)] == [buf.shape]
    assert out.shape in pallas_operand_shapes(lambda o, b: into(o, b, *whole), out, buf)[0]
    assert _dus_sizes(lambda o, b: into(o, b, *whole), out, buf) == []
    inside = (5, 1000)
    assert out.shape not in pallas_operand_shapes(lambda o, b: into(o, b, *inside), out,
                                                  buf)[0]
    assert _dus_sizes(lambda o, b: into(o, b, *inside), out, buf) == [1000, 1000]


@pytest.mark.parametrize(("kw", "msg"), [
    (dict(out=jnp.zeros((100,), jnp.uint8)), "room for the slice's 1000 bytes"),
    (dict(out=jnp.zeros((4000,), jnp.int8)), "1-D uint8 array"),
    (dict(out=jnp.zeros((2, 2000), jnp.uint8)), "1-D uint8 array"),
    (dict(at=(-1, 2000)), "room for the slice's"),
    (dict(at=(0, 2.5)), "at must be an integer"),
    (dict(at=(0,)), "room for the slice's"),
    (dict(planes=("rowwise",)), "both planes' scales"),
])
def test_bad_arrays_and_positions_are_refused_by_name(kw, msg):
    buf, scales = _case(jnp.bfloat16)
    buf = buf.astype(jnp.bfloat16)
    planes = kw.get("planes", ("rowwise", "colwise"))
    with pytest.raises((ValueError, TypeError), match=msg):
        mxfp8.cast_slice_into(kw.get("out", jnp.zeros((4000,), jnp.uint8)),
                              kw.get("at", (0, 2000)), buf, (M, K), 5,
                              scales={p: scales[p] for p in planes}, offset=AT + 5, numel=1000)


@pytest.mark.gpu
@pytest.mark.parametrize("read", ["bf16", "f32 as bf16"])
def test_the_compiled_kernel_writes_in_place_with_the_reference_bytes(read):
    """On the GPU: the compiled kernel (whole bands in place, other slices handed on) against
    the reference's bytes, the array's other bytes untouched."""
    read_as = jnp.bfloat16 if read == "f32 as bf16" else None
    buf, scales = _case(jnp.bfloat16)
    buf = buf if read_as is not None else buf.astype(jnp.bfloat16)
    out = jnp.full((2 * M * K + 300,), SENTINEL, jnp.uint8)
    ats = (7, M * K + 150)
    for start, n in SLICES:
        got = mxfp8.cast_slice_into(out, ats, buf, (M, K), start, scales=scales,
                                    backend="pallas", offset=AT + start, numel=n,
                                    read_as=read_as)
        cut = buf[AT + start:AT + start + n].astype(read_as or buf.dtype)
        np.testing.assert_array_equal(np.asarray(got), _expected(out, ats, cut, start, scales),
                                      err_msg=f"{start} {n}")
