"""The Pallas kernels (``pallas_impl`` and the modules it launches: ``pallas_elements``,
``pallas_tiles``, ``pallas_kernels``) against the ``xla`` backend, byte for byte.

- CPU: the kernels run in Pallas interpret mode (on XLA:CPU, which flushes subnormal floats, so
  these runs also check that the kernels are FTZ-proof); the element and scale math is also
  checked exhaustively as plain jnp (every bf16 bit pattern x every scale byte, every E8M0
  threshold and its neighbours); and the kernels are lowered to Triton IR for CUDA (no GPU
  needed) to catch primitives the Triton lowering lacks.
- GPU (``@pytest.mark.gpu``): the compiled kernels on the same inputs and large shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.formats import Plane
from jax_side import mxfp8
from jax_side.mxfp8 import e8m0, reblock, xla_impl
from jax_side.mxfp8 import pallas_elements as pe
from jax_side.mxfp8 import pallas_impl as pk
from jax_side.mxfp8.pallas_tiles import KernelKind, TileKey
from tests.jax_side.mxfp8.corner_cases import CORNERS, block_matrix, special_mix

FIELDS = ("rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale")
MODES = pk.FTZ_PROOF_PATHS  # the FTZ-proof element paths (interpret mode and GPU)
ALL_MODES = tuple(pk.ElementPath)  # + NATIVE (compiled kernels only)
SMALL_TILES = pk.Tiles(block_m=32, block_k=64)  # several programs, two chunks each


def u8(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def assert_bytes_equal(got, want, what: str) -> None:
    got, want = u8(got), u8(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)[:5]
        raise AssertionError(
            f"{what}: {int(np.sum(got != want))} bytes differ; first at {bad.tolist()}: got "
            f"{[hex(got[tuple(i)]) for i in bad]}, xla {[hex(want[tuple(i)]) for i in bad]}")


def assert_same_as_xla(x, *, rowwise=True, colwise=True, interpret=True, tiles=None,
                       mode=None) -> None:
    x = jnp.asarray(x)
    got = pk.quantize_2d(x, rowwise=rowwise, colwise=colwise, interpret=interpret, tiles=tiles,
                         e4m3_cast=mode)
    planes = [p for p, on in ((Plane.ROWWISE, rowwise), (Plane.COLWISE, colwise)) if on]
    want = mxfp8.quantize(x, planes=planes, backend="xla")
    for f in FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), f
        if w is not None:
            assert g.dtype == w.dtype, f"{f}: {g.dtype} != {w.dtype}"
            assert_bytes_equal(g, w, f"{f} {x.shape} {x.dtype} mode={mode} tiles={tiles}")


xla_cast = jax.jit(xla_impl.cast_2d)  # eager XLA compiles every op: one program is faster


# ---------------------------------------------------------------------------------------------
# Element and scale math as plain jnp (exhaustive where it is cheap).


def every_bf16_as_fp32_bits() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint32) << 16


@pytest.mark.parametrize("mode", MODES, ids=lambda p: p.value)
def test_cast_any_every_bf16_pattern_at_every_scale_byte(mode):
    bits = every_bf16_as_fp32_bits()
    el = pe.elements(jnp.asarray(bits.view(np.int32)))
    cast = jax.jit(lambda e: pe.cast_any(el, e, mode))
    ref = jax.jit(lambda e: jax.lax.bitcast_convert_type(
        xla_impl.cast_2d(jnp.asarray(bits), jnp.broadcast_to(e, bits.shape)), jnp.uint8))
    for e in range(256):
        assert_bytes_equal(cast(jnp.int32(e)), ref(jnp.uint8(e)), f"scale byte {e}")


@pytest.mark.parametrize("mode", MODES, ids=lambda p: p.value)
def test_cast_own_every_bf16_pattern_where_its_premise_holds(mode):
    # _cast_own assumes E came from the block's amax: |x| * 2**(127 - E) < 448 * (1 + 2**-20)
    # for finite x (Inf/NaN any E < 0xFF). Check every bf16 x at every E where that holds.
    bits = every_bf16_as_fp32_bits()
    with np.errstate(invalid="ignore"):  # NaN patterns
        x64 = np.abs(bits.view(np.float32).astype(np.float64))
    el = pe.elements(jnp.asarray(bits.view(np.int32)))
    cast = jax.jit(lambda e: pe.cast_own(el, e, mode))
    ref = jax.jit(lambda e: jax.lax.bitcast_convert_type(
        xla_impl.cast_2d(jnp.asarray(bits), jnp.broadcast_to(e, bits.shape)), jnp.uint8))
    checked = 0
    for e in range(255):
        with np.errstate(over="ignore", invalid="ignore"):
            ok = ~np.isfinite(x64) | (np.ldexp(x64, 127 - e) < 448.0 * (1 + 2.0**-20))
        got, want = u8(cast(jnp.int32(e)))[ok], u8(ref(jnp.uint8(e)))[ok]
        assert_bytes_equal(got, want, f"scale byte {e}")
        checked += int(ok.sum())
    assert checked > 255 * 30000


def _normal_bf16_bits() -> np.ndarray:
    """Every bf16 pattern except the subnormals (XLA:CPU flushes those; the GPU tests cover
    them): normals, +-0, +-Inf and every NaN."""
    bits = every_bf16_as_fp32_bits()
    exp = (bits >> 23) & 0xFF
    return bits[(exp != 0) | ((bits & 0x7FFFFFFF) == 0)]


@pytest.mark.parametrize("nan_scale", [False, True], ids=["own-scale", "any-scale"])
def test_native_cast_every_normal_bf16_pattern_at_every_scale_byte(nan_scale):
    # The "native" element math as plain jnp on CPU, against xla. Checked wherever XLA:CPU gives
    # what the GPU gives: not for subnormal x or scale byte 254 (factor 2**-127), which XLA:CPU
    # flushes, and not where |x| * 2**k >= 464 (Inf or saturating finite x), which XLA's convert
    # makes NaN while the GPU's cvt.rn.satfinite gives 448 as the contract does. The compiled
    # GPU tests (test_gpu_*, mode "native") check all of those.
    bits = _normal_bf16_bits()
    with np.errstate(invalid="ignore"):
        x64 = np.abs(bits.view(np.float32).astype(np.float64))
    el = pe.native_elements(jnp.asarray(bits.view(np.int32)))
    cast = jax.jit(lambda e: pe.cast_native(el, e, nan_scale=nan_scale))
    ref = jax.jit(lambda e: jax.lax.bitcast_convert_type(
        xla_impl.cast_2d(jnp.asarray(bits), jnp.broadcast_to(e, bits.shape)), jnp.uint8))
    checked = 0
    for e in [*range(254), *([255] if nan_scale else [])]:
        with np.errstate(over="ignore", invalid="ignore"):
            ok = np.isnan(x64) | (np.isfinite(x64) & (np.ldexp(x64, 127 - e) < 464.0))
        if e == 255:
            ok[:] = True  # every byte is NaN (0x7F | sign) on both
        assert_bytes_equal(u8(cast(jnp.int32(e)))[ok], u8(ref(jnp.uint8(e)))[ok],
                           f"native, scale byte {e}")
        checked += int(ok.sum())
    assert checked > 254 * 30000


def test_native_cast_and_shift_in_one_cast_every_normal_bf16_pattern():
    # pallas_blocked's codes on the native path: x cast at its 1x32 block's own scale byte E,
    # then shifted by diff <= 0 to the merged block's (reblock.shift_codes), made by one e4m3
    # cast (cast_shift_native). Against the FTZ-proof composition, as plain jnp on the CPU: every
    # bf16 pattern but the subnormals (XLA:CPU flushes them, and the factor 2**-127 of scale
    # byte 254; the compiled GPU test of the blocked kernel covers both) and +-Inf (XLA:CPU's
    # convert makes NaN of them where the GPU saturates), at every other own-scale byte E
    # (|x| * 2**(127 - E) below 448 * (1 + 2**-20), as the block's RCEIL scale keeps it) and
    # shifts across the range, past the clamp at -30 too.
    bits = _normal_bf16_bits()
    with np.errstate(invalid="ignore"):
        x64 = np.abs(bits.view(np.float32).astype(np.float64))
    b = jnp.asarray(bits.view(np.int32))
    native, ftz_proof = pe.native_elements(b), pe.elements(b)
    fused = jax.jit(lambda e, d: pe.cast_shift_native(native, e, d))
    ref = jax.jit(lambda e, d: reblock.shift_codes(
        pe.cast_own(ftz_proof, e, pe.ElementPath.FLOAT), d))
    checked = 0
    for e in range(254):
        with np.errstate(over="ignore", invalid="ignore"):
            ok = np.isnan(x64) | (np.isfinite(x64)
                                  & (np.ldexp(x64, 127 - e) < 448.0 * (1 + 2.0**-20)))
        for d in (0, -1, -2, -3, -4, -5, -7, -9, -12, -17, -25, -30, -31, -40):
            assert_bytes_equal(u8(fused(jnp.int32(e), jnp.int32(d)))[ok],
                               u8(ref(jnp.int32(e), jnp.int32(d)))[ok],
                               f"scale byte {e}, shift {d}")
            checked += int(ok.sum())
    assert checked > 100_000_000


def test_native_mode_is_refused_in_interpret_mode_and_default_follows_the_mode():
    x = jnp.zeros((32, 32), jnp.float32)
    with pytest.raises(ValueError, match="native.*interpret"):
        pk.quantize_2d(x, rowwise=True, colwise=True, interpret=True, e4m3_cast="native")
    with pytest.raises(ValueError, match="native.*interpret"):
        pk.cast_2d(x, jnp.zeros((32, 1), jnp.uint8), interpret=True, e4m3_cast="native")
    assert pk.element_path(None, True) is pk.INTERPRET_DEFAULT is pk.ElementPath.FLOAT
    assert pk.element_path(None, False) is pk.COMPILED_DEFAULT is pk.ElementPath.NATIVE
    assert pk.element_path("int", True) is pk.ElementPath.INT  # values are parsed


def test_tile_defaults_are_keyed_by_kernel_dtype_and_path():
    assert all(isinstance(key, TileKey) for key in pk.DEFAULT_TILES)
    for kind in KernelKind:  # every kernel has a default for each dtype, for any element path
        for dtype in ("bfloat16", "float32"):
            assert isinstance(pk.DEFAULT_TILES[TileKey(kind, dtype)], pk.Tiles)
    native = TileKey(KernelKind.QUANTIZE, "bfloat16", pk.ElementPath.NATIVE)
    assert pk.DEFAULT_TILES[native].chunk_k == 128


@pytest.mark.parametrize("mode", MODES, ids=lambda p: p.value)
def test_cast_any_random_fp32_patterns_and_scales(mode):
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 32, size=1 << 16, dtype=np.uint64).astype(np.uint32)
    bits[: 1 << 12] &= 0x807FFFFF  # plenty of fp32 subnormals
    scale = rng.integers(0, 256, size=bits.shape).astype(np.uint8)
    scale[: 1 << 11] = rng.integers(0, 12, size=1 << 11)  # scales at which subnormals matter
    got = jax.jit(lambda b, e: pe.cast_any(pe.elements(b), e, mode))(
        jnp.asarray(bits.view(np.int32)), jnp.asarray(scale).astype(jnp.int32))
    want = xla_cast(jnp.asarray(bits), jnp.asarray(scale))
    assert_bytes_equal(got, want, "random fp32")


@pytest.mark.parametrize("mode", MODES, ids=lambda p: p.value)
def test_e4m3_rounding_at_every_e4m3_boundary(mode):
    # Every e4m3 magnitude, the midpoints between neighbours, and one fp32 ulp either side.
    vals = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = (vals[:-1] + vals[1:]) / np.float32(2)
    v = np.concatenate([vals, mids, np.nextafter(mids, np.float32(0)),
                        np.nextafter(mids, np.float32(1000))])
    v = v[v <= np.float32(448)]
    got = pe.e4m3_from_v(jnp.asarray(v), mode)
    want = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(got), want)


def threshold_probes() -> np.ndarray:
    """fp32 amax values at every E8M0 threshold and its two neighbours either side."""
    t = e8m0.e8m0_thresholds().astype(np.int64)
    probes = np.unique(np.clip(np.concatenate([t - 2, t - 1, t, t + 1, t + 2]), 0, 0x7F800000))
    return probes.astype(np.uint32).view(np.float32)


def test_scale_rule_matches_threshold_table():
    rng = np.random.default_rng(5)
    rand = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    amax = np.concatenate([threshold_probes(), rand.view(np.float32),
                           np.array([np.inf, -np.inf, np.nan, -0.0, 0.0], np.float32)])
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax), jnp.int32)
    want = np.asarray(xla_impl.scale_bytes_from_amax(jnp.asarray(amax)))
    got = pe.scale_bytes_of_bits(bits).astype(jnp.uint8)
    np.testing.assert_array_equal(np.asarray(got), want)
    # The kernel variant, for amax bits in [0, +Inf] (what a NaN-ignoring block amax can be).
    in_range = (amax >= 0) & ~np.isnan(amax) & (np.signbit(amax) == 0)
    got = pe.scale_bytes_of_bits(bits, any_bits=False).astype(jnp.uint8)
    np.testing.assert_array_equal(np.asarray(got)[in_range], want[in_range])


def test_scales_from_amax_kernel_matches_xla():
    amax = jnp.asarray(threshold_probes())
    got = pk.scales_from_amax(amax, interpret=True)
    want = mxfp8.scales_from_amax(amax)
    assert got.dtype == want.dtype == jnp.float8_e8m0fnu
    assert_bytes_equal(got, want, "scales_from_amax")
    small = jnp.asarray(np.array([[0.0, 1.0, 448.0], [np.inf, 2.0**-140, 1e30]], np.float32))
    assert_bytes_equal(pk.scales_from_amax(small, interpret=True), mxfp8.scales_from_amax(small),
                       "scales_from_amax 2x3")


# ---------------------------------------------------------------------------------------------
# The kernels in interpret mode.


@pytest.mark.parametrize("column", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("case", CORNERS, ids=[c.name for c in CORNERS])
def test_corner_cases(case, column):
    x = block_matrix(case, column=column)
    t = pk.quantize_2d(jnp.asarray(x), rowwise=True, colwise=True, interpret=True)
    plane = "colwise" if column else "rowwise"
    data, scale = u8(getattr(t, f"{plane}_data")), u8(getattr(t, f"{plane}_scale"))
    n = len(case.values)
    assert scale[0, 0] == case.scale, f"scale {scale[0, 0]:#x} ({case.why})"
    block = data[:n, 0] if column else data[0, :n]
    np.testing.assert_array_equal(block, np.array(case.elements, np.uint8), err_msg=case.why)
    assert_same_as_xla(x)


@pytest.mark.parametrize("mode", MODES, ids=lambda p: p.value)
def test_every_threshold_inside_the_kernel(mode):
    # One block per threshold probe: the probe first, then a spread of smaller values and a
    # subnormal; rowwise blocks are rows, colwise blocks the same values transposed.
    amax = threshold_probes()
    m = -(-amax.size // 32) * 32
    x = np.zeros((m, 32), np.float32)
    x[: amax.size, 0] = amax
    x[: amax.size, 1] = -amax * np.float32(0.7)
    x[: amax.size, 2] = amax * np.float32(2.0**-9)
    x[:, 3] = np.float32(-(2.0**-140))
    assert_same_as_xla(x, colwise=False, mode=mode)
    assert_same_as_xla(np.ascontiguousarray(x.T), rowwise=False, mode=mode)


F32, BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(
    "shape,dtype,mode",
    [((32, 32), F32, "float"), ((96, 160), BF16, "float"), ((96, 160), F32, "int"),
     ((64, 288), BF16, "int")],
    ids=lambda v: str(v) if not isinstance(v, np.dtype) else v.name,
)
def test_random_with_specials(shape, dtype, mode):
    assert_same_as_xla(special_mix(shape, dtype, seed=shape[0] + shape[1]), tiles=SMALL_TILES,
                       mode=mode)


@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpret"),
                                       pytest.param(False, marks=pytest.mark.gpu, id="compiled")])
@pytest.mark.parametrize("planes", [(True, False), (False, True)], ids=["rowwise", "colwise"])
def test_single_plane(planes, interpret):
    x = special_mix((64, 96), ml_dtypes.bfloat16, seed=11)
    assert_same_as_xla(x, rowwise=planes[0], colwise=planes[1], tiles=SMALL_TILES,
                       interpret=interpret)


def test_one_chunk_per_program():
    assert_same_as_xla(special_mix((64, 256), ml_dtypes.bfloat16, seed=2), tiles=pk.Tiles(32, 32))


def test_wide_chunks_in_every_kernel():
    # (32, 64) chunks reshape for the rowwise blocks (quantize, amax, cast); 64-row tiles,
    # loads issued lazily.
    tiles = pk.Tiles(64, 128, chunk_k=64, preload=False)
    x = jnp.asarray(special_mix((64, 256), np.float32, seed=5))
    assert_same_as_xla(x, tiles=tiles)
    want = mxfp8.quantize(x, backend="xla")
    amax = pk.block_amax_2d(x, rowwise=True, colwise=True, interpret=True, tiles=tiles)
    ref = mxfp8.partial_block_amax(x.reshape(-1), x.shape, 0)
    assert_bytes_equal(amax.rowwise, ref.rowwise, "rowwise amax")
    assert_bytes_equal(amax.colwise, ref.colwise, "colwise amax")
    cast = pk.cast_2d(x, want.rowwise_scale, want.colwise_scale, interpret=True, tiles=tiles)
    assert_bytes_equal(cast.rowwise, want.rowwise_data, "rowwise cast")
    assert_bytes_equal(cast.colwise, want.colwise_data, "colwise cast")



@pytest.mark.parametrize("interpret", [pytest.param(True, id="interpret"),
                                       pytest.param(False, marks=pytest.mark.gpu, id="compiled")])
def test_block_amax_matches_xla(interpret):
    x = jnp.asarray(special_mix((96, 160), np.float32, seed=4))
    got = pk.block_amax_2d(x, rowwise=True, colwise=True, interpret=interpret, tiles=SMALL_TILES)
    want = mxfp8.partial_block_amax(x.reshape(-1), x.shape, 0)
    assert got.rowwise.dtype == jnp.float32
    assert_bytes_equal(got.rowwise, want.rowwise, "rowwise amax")
    assert_bytes_equal(got.colwise, want.colwise, "colwise amax")


@pytest.mark.parametrize(
    ("mode", "interpret"),
    [pytest.param(m, True, id=f"{m.value}-interpret") for m in MODES]
    + [pytest.param(m, False, marks=pytest.mark.gpu, id=f"{m.value}-compiled")
       for m in ALL_MODES],
)
def test_cast_2d_with_arbitrary_scale_bytes(mode, interpret):
    # Scales that are not the blocks' own (saturation, NaN byte 0xFF, tiny and huge scales).
    rng = np.random.default_rng(9)
    x = jnp.asarray(special_mix((64, 96), ml_dtypes.bfloat16, seed=9))
    rs = rng.integers(0, 256, size=(64, 3)).astype(np.uint8)
    cs = rng.integers(0, 256, size=(2, 96)).astype(np.uint8)
    rs[0, :] = [0, 0xFE, 0xFF]
    got = pk.cast_2d(x, jnp.asarray(rs).view(jnp.float8_e8m0fnu), jnp.asarray(cs),
                     interpret=interpret, tiles=SMALL_TILES, e4m3_cast=mode)
    bits = xla_impl.fp32_bits(x)
    assert_bytes_equal(got.rowwise, xla_cast(bits, xla_impl.expand_rowwise(rs)), "row")
    assert_bytes_equal(got.colwise, xla_cast(bits, xla_impl.expand_colwise(cs)), "col")
    only_col = pk.cast_2d(x, None, jnp.asarray(cs), interpret=interpret)
    assert only_col.rowwise is None
    assert_bytes_equal(only_col.colwise, got.colwise, "colwise alone")


# ---------------------------------------------------------------------------------------------
# Flat slices: the public slice functions with backend="pallas" (pallas_backend, interpret mode
# on CPU) against backend="xla".


def check_slice(x: np.ndarray, start: int, n: int) -> None:
    m, k = x.shape
    flat = jnp.asarray(x.reshape(-1)[start : start + n])
    got = mxfp8.partial_block_amax(flat, (m, k), start, backend="pallas")
    want = mxfp8.partial_block_amax(flat, (m, k), start, backend="xla")
    assert_bytes_equal(got.rowwise, want.rowwise, f"row amax [{start}, +{n})")
    assert_bytes_equal(got.colwise, want.colwise, f"col amax [{start}, +{n})")
    whole = mxfp8.quantize(jnp.asarray(x), backend="xla")
    scales = {p: whole.plane(p).scale for p in Plane}
    c = mxfp8.cast_slice(flat, (m, k), start, scales=scales, backend="pallas")
    ref = mxfp8.cast_slice(flat, (m, k), start, scales=scales, backend="xla")
    assert c.rowwise.dtype == jnp.float8_e4m3fn and c.rowwise.shape == (n,)
    assert_bytes_equal(c.rowwise, ref.rowwise, f"row cast [{start}, +{n})")
    assert_bytes_equal(c.colwise, ref.colwise, f"col cast [{start}, +{n})")


@pytest.mark.parametrize(
    "start,n",
    [(1000, 0), (64 * 3 + 40, 1), (64 * 31 + 5, 64 * 2 + 2)],
    ids=["empty", "single_element", "across_band"],  # more cuts: the split test below
)
def test_slices_match_xla(start, n):
    check_slice(special_mix((96, 64), ml_dtypes.bfloat16, seed=start + n), start, n)


def test_split_into_slices_reproduces_whole_quantize():
    x = special_mix((64, 64), np.float32, seed=21)
    m, k = x.shape
    bounds = [0, 701, 64 * 33 + 3, m * k]  # cuts mid-block and across the band edge
    flat = x.reshape(-1)
    parts = [(s, jnp.asarray(flat[s:e])) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    amax = [mxfp8.partial_block_amax(p, (m, k), s, backend="pallas") for s, p in parts]
    rs = mxfp8.scales_from_amax(jnp.max(jnp.stack([a.rowwise for a in amax]), 0),
                                backend="pallas")
    cs = mxfp8.scales_from_amax(jnp.max(jnp.stack([a.colwise for a in amax]), 0),
                                backend="pallas")
    casts = [mxfp8.cast_slice(p, (m, k), s, scales={Plane.ROWWISE: rs, Plane.COLWISE: cs},
                              backend="pallas") for s, p in parts]
    want = mxfp8.quantize(jnp.asarray(x), backend="xla")
    assert_bytes_equal(rs, want.rowwise_scale, "rowwise_scale")
    assert_bytes_equal(cs, want.colwise_scale, "colwise_scale")
    for plane in ("rowwise", "colwise"):
        data = np.concatenate([u8(getattr(c, plane)) for c in casts]).reshape(m, k)
        assert_bytes_equal(data, getattr(want, f"{plane}_data"), plane)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(32, 64), (64, 96)]),
       dtype=st.sampled_from([np.float32, ml_dtypes.bfloat16]),
       rate=st.sampled_from([0.0, 0.02, 0.3]))
def test_random_inputs_property(seed, shape, dtype, rate):
    assert_same_as_xla(special_mix(shape, dtype, seed, rate), tiles=SMALL_TILES)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"M % 32 == 0 and K % 32 == 0"):
        pk.quantize_2d(jnp.zeros((32, 48), jnp.float32), rowwise=True, colwise=True)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        pk.quantize_2d(jnp.zeros((32, 32), jnp.float16), rowwise=True, colwise=True)
    with pytest.raises(ValueError, match="e4m3_cast"):
        pk.quantize_2d(jnp.zeros((32, 32), jnp.float32), rowwise=True, colwise=True,
                       e4m3_cast="fast")
    with pytest.raises(ValueError, match="outside"):
        mxfp8.partial_block_amax(jnp.zeros((8,), jnp.float32), (32, 32), 1020, backend="pallas")
    with pytest.raises(ValueError, match="chunk_k"):
        pk.quantize_2d(jnp.zeros((32, 32), jnp.float32), rowwise=True, colwise=True,
                       tiles=pk.Tiles(chunk_k=48))


# ---------------------------------------------------------------------------------------------
# Triton lowering (CPU): every primitive in the kernels has a Triton lowering rule.

LOWERED = {
    "quantize_both": lambda x, mode: pk.quantize_2d(x, rowwise=True, colwise=True,
                                                    e4m3_cast=mode),
    "quantize_rowwise": lambda x, mode: pk.quantize_2d(x, rowwise=True, colwise=False,
                                                       e4m3_cast=mode),
    "block_amax": lambda x, mode: pk.block_amax_2d(x, rowwise=True, colwise=True),
    "cast": lambda x, mode: pk.cast_2d(x, jnp.zeros((64, 4), jnp.uint8),
                                       jnp.zeros((2, 128), jnp.uint8), e4m3_cast=mode),
    "scales": lambda x, mode: pk.scales_from_amax(x.astype(jnp.float32)),
    "quantize_chunk128": lambda x, mode: pk.quantize_2d(
        x, rowwise=True, colwise=True, e4m3_cast=mode, tiles=pk.Tiles(32, 128, 2, chunk_k=128)),
    "cast_chunk64": lambda x, mode: pk.cast_2d(
        x, jnp.zeros((64, 4), jnp.uint8), jnp.zeros((2, 128), jnp.uint8), e4m3_cast=mode,
        tiles=pk.Tiles(32, 128, 4, chunk_k=64)),
}


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda p: p.value)
@pytest.mark.parametrize("name", sorted(LOWERED))
def test_kernels_lower_to_triton_for_cuda(name, mode):
    if jax.default_backend() == "gpu":
        pytest.skip("the GPU tests compile the kernels for real")
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    traced = jax.jit(lambda v: LOWERED[name](v, mode)).trace(x)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernels.

GPU_SHAPES = [(32, 32), (96, 160), (64, 288), (2304, 768), (768, 3072), (4096, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda p: p.value)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_random_with_specials(shape, dtype, mode):
    assert_same_as_xla(special_mix(shape, dtype, seed=1), interpret=False, mode=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda p: p.value)
def test_gpu_corners_and_thresholds(mode):
    for case in CORNERS:
        for column in (False, True):
            assert_same_as_xla(block_matrix(case, column=column), interpret=False, mode=mode)
    amax = threshold_probes()
    x = np.zeros((-(-amax.size // 32) * 32, 32), np.float32)
    x[: amax.size, 0] = amax
    x[:, 1] = np.float32(-(2.0**-140))
    assert_same_as_xla(x, colwise=False, interpret=False, mode=mode)
    assert_same_as_xla(np.ascontiguousarray(x.T), rowwise=False, interpret=False, mode=mode)
    got = pk.scales_from_amax(jnp.asarray(amax))
    assert_bytes_equal(got, mxfp8.scales_from_amax(jnp.asarray(amax)), "scales_from_amax")


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [pk.Tiles(32, 256, 4, preload=False), pk.Tiles(64, 256, 2),
                                   pk.Tiles(128, 128, 4), pk.Tiles(32, 512, 8, preload=False),
                                   pk.Tiles(32, 128, 1, preload=False, chunk_k=64),
                                   pk.Tiles(32, 128, 2, chunk_k=128)],
                         ids=str)
def test_gpu_tiles(tiles):
    assert_same_as_xla(special_mix((4096, 3072), ml_dtypes.bfloat16, seed=2), interpret=False,
                       tiles=tiles)


@pytest.mark.gpu
def test_gpu_amax_cast_and_slices():
    x = special_mix((256, 768), ml_dtypes.bfloat16, seed=8)
    for start, n in [(0, 0), (77, 1), (768 * 31 + 5, 768 * 3), (0, 256 * 768)]:
        m, k = x.shape
        flat = jnp.asarray(x.reshape(-1)[start : start + n])
        got = mxfp8.partial_block_amax(flat, (m, k), start, backend="pallas")
        want = mxfp8.partial_block_amax(flat, (m, k), start, backend="xla")
        assert_bytes_equal(got.rowwise, want.rowwise, "row amax")
        assert_bytes_equal(got.colwise, want.colwise, "col amax")
        whole = mxfp8.quantize(jnp.asarray(x), backend="xla")
        scales = {p: whole.plane(p).scale for p in Plane}
        c = mxfp8.cast_slice(flat, (m, k), start, scales=scales, backend="pallas")
        ref = mxfp8.cast_slice(flat, (m, k), start, scales=scales, backend="xla")
        assert_bytes_equal(c.rowwise, ref.rowwise, "row cast")
        assert_bytes_equal(c.colwise, ref.colwise, "col cast")
