"""jax_side.mxfp8.quantize / dequantize against the contract (DESIGN.md 3) and the numpy oracle.

Everything is compared byte for byte: the corner-case table has hand-derived bytes, random inputs
are compared to the oracle (which follows the contract literally with IEEE numpy float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.formats import Plane
from jax_side import mxfp8
from jax_side.mxfp8 import e8m0, xla_impl
from tests.jax_side.mxfp8.corner_cases import CORNERS, block_matrix
from tests.oracle import mxfp8_ref as ref

FIELDS = ("rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale")


def as_u8(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def assert_same_bytes(t: mxfp8.MXFP8Tensor, expected: dict[str, np.ndarray], what="") -> None:
    for f in FIELDS:
        got = as_u8(getattr(t, f))
        if not np.array_equal(got, expected[f]):
            bad = np.argwhere(got != expected[f])[:5]
            raise AssertionError(
                f"{what} {f}: {int(np.sum(got != expected[f]))} bytes differ; first at "
                f"{bad.tolist()}: got {[hex(got[tuple(i)]) for i in bad]}, expected "
                f"{[hex(expected[f][tuple(i)]) for i in bad]}"
            )


# ---------------------------------------------------------------------------------------------
# Named corner cases: oracle and implementation both checked against the hand-derived bytes.


@pytest.mark.parametrize("column", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("case", CORNERS, ids=[c.name for c in CORNERS])
def test_corner_case_bytes(case, column):
    x = block_matrix(case, column=column)
    n = len(case.values)
    plane = "colwise" if column else "rowwise"
    expected_elems = np.array(case.elements, np.uint8)
    oracle = ref.quantize(x)
    t = mxfp8.quantize(jnp.asarray(x))
    for source, data, scale in (
        ("oracle", oracle[f"{plane}_data"], oracle[f"{plane}_scale"]),
        ("xla", as_u8(getattr(t, f"{plane}_data")), as_u8(getattr(t, f"{plane}_scale"))),
    ):
        block = data[:n, 0] if column else data[0, :n]
        assert scale[0, 0] == case.scale, f"{source}: scale {scale[0, 0]:#x} ({case.why})"
        np.testing.assert_array_equal(block, expected_elems, err_msg=f"{source}: {case.why}")


# ---------------------------------------------------------------------------------------------
# The E8M0 threshold table (the fast path for the scale byte) against the oracle's float rule.


def test_scale_thresholds_match_oracle_at_every_step():
    t = e8m0.e8m0_thresholds().astype(np.int64)
    probes = np.unique(np.clip(np.concatenate([t - 2, t - 1, t, t + 1]), 0, 0x7F800000))
    amax = probes.astype(np.uint32).view(np.float32)
    got = np.asarray(xla_impl.scale_bytes_from_amax(jnp.asarray(amax)))
    np.testing.assert_array_equal(got, ref.scale_bytes(amax))


def test_scale_bytes_random_amax_bit_patterns():
    bits = np.random.default_rng(0).integers(0, 0x7F800001, size=200_000, dtype=np.uint32)
    amax = bits.view(np.float32)
    got = np.asarray(xla_impl.scale_bytes_from_amax(jnp.asarray(amax)))
    np.testing.assert_array_equal(got, ref.scale_bytes(amax))


def test_exact_integer_rule_agrees_with_oracle_on_boundaries():
    # The table is built from exact integer arithmetic; the oracle uses IEEE numpy floats.
    for b in (0, 1, 2, 100, 127, 128, 200, 246):
        for bits in (b << 23, (b << 23) + 1, (b << 23) + 0x600000, (b << 23) + 0x600001):
            amax = np.array([bits], np.uint32).view(np.float32)
            assert e8m0.e8m0_byte_exact(bits) == ref.scale_bytes(amax)[0], hex(bits)


# ---------------------------------------------------------------------------------------------
# Random inputs over the whole bf16 / fp32 range, with special values, eager and under jit.


@st.composite
def mx_inputs(draw):
    # A few shapes only: every new shape costs an XLA compile, the values are what varies.
    m = draw(st.sampled_from([32, 64]))
    k = draw(st.sampled_from([32, 96]))
    dtype = draw(st.sampled_from([np.float32, ml_dtypes.bfloat16]))
    seed = draw(st.integers(0, 2**32 - 1))
    special_rate = draw(st.sampled_from([0.0, 0.0, 0.01, 0.2]))
    rng = np.random.default_rng(seed)
    # Each row-block of 32 gets its own magnitude, from deep subnormal to near the bf16 max.
    exps = rng.integers(-150, 128, size=(m // 32, 1, k // 32, 1))
    mant = rng.standard_normal((m // 32, 32, k // 32, 32))
    spread = rng.integers(-12, 1, size=mant.shape)  # in-block spread of magnitudes
    x = (mant * np.exp2(exps + spread)).reshape(m, k)
    with np.errstate(over="ignore"):
        x = x.astype(np.float32)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    mask = rng.random(x.shape) < special_rate
    x[mask] = rng.choice(specials, size=int(mask.sum()))
    with np.errstate(over="ignore"):
        return x.astype(dtype)


_quantize_jit = jax.jit(mxfp8.quantize)


@given(mx_inputs())
def test_random_inputs_match_oracle_under_jit(x):
    assert_same_bytes(_quantize_jit(jnp.asarray(x)), ref.quantize(x), "jit")


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_random_inputs_match_oracle_eager(dtype):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 96)) * np.exp2(rng.integers(-140, 120, (64, 1))))
    x = x.astype(np.float32)
    x[3, 5], x[40, 7], x[10, 64] = np.nan, np.inf, -np.inf
    x = x.astype(dtype)
    assert_same_bytes(mxfp8.quantize(jnp.asarray(x)), ref.quantize(x), "eager")


def test_single_plane_requests():
    x = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    expected = ref.quantize(x)
    row = mxfp8.quantize(jnp.asarray(x), planes=(Plane.ROWWISE,))
    col = mxfp8.quantize(jnp.asarray(x), planes=(Plane.COLWISE,))
    assert row.colwise_data is None and row.colwise_scale is None
    assert col.rowwise_data is None and col.rowwise_scale is None
    np.testing.assert_array_equal(as_u8(row.rowwise_data), expected["rowwise_data"])
    np.testing.assert_array_equal(as_u8(col.colwise_scale), expected["colwise_scale"])


def test_tensor_fields_dtypes_shapes_and_pytree():
    x = jnp.ones((64, 96), jnp.bfloat16)
    t = mxfp8.quantize(x)
    assert t.shape == (64, 96) and t.dtype == np.dtype(jnp.bfloat16)
    assert t.rowwise_data.dtype == jnp.float8_e4m3fn and t.rowwise_data.shape == (64, 96)
    assert t.rowwise_scale.dtype == jnp.float8_e8m0fnu and t.rowwise_scale.shape == (64, 3)
    assert t.colwise_data.shape == (64, 96) and t.colwise_scale.shape == (2, 96)
    leaves, treedef = jax.tree_util.tree_flatten(t)
    assert len(leaves) == 4
    assert jax.tree_util.tree_unflatten(treedef, leaves) == t
    row_only = mxfp8.quantize(x, planes=(Plane.ROWWISE,))
    assert len(jax.tree_util.tree_leaves(row_only)) == 2


def test_vmap_over_a_stack_matches_per_item():
    xs = np.random.default_rng(2).standard_normal((3, 32, 64)).astype(np.float32)
    stacked = jax.vmap(mxfp8.quantize)(jnp.asarray(xs))
    for i in range(3):
        expected = ref.quantize(xs[i])
        item = jax.tree_util.tree_map(lambda a, i=i: a[i], stacked)
        assert_same_bytes(item, expected, f"vmap item {i}")


# ---------------------------------------------------------------------------------------------
# Dequantize: exactly e4m3 * 2^(E - 127) in fp32, including subnormal results.


@given(mx_inputs())
def test_dequantize_is_exact(x):
    t = _quantize_jit(jnp.asarray(x))
    for plane, axis in (("rowwise", 1), ("colwise", 0)):
        data, scale = as_u8(getattr(t, f"{plane}_data")), as_u8(getattr(t, f"{plane}_scale"))
        expected = ref.dequantize(data, np.repeat(scale, 32, axis=axis))
        got = np.asarray(mxfp8.dequantize(t, plane))
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_dequantize_keeps_subnormal_results():
    # scale byte 0 (2^-127) with the smallest e4m3 subnormal gives 2^-136, an fp32 subnormal.
    x = np.zeros((32, 32), np.float32)
    x[0, 0] = 2.0**-136
    x[0, 1] = 2.0**-119
    t = mxfp8.quantize(jnp.asarray(x))
    assert as_u8(t.rowwise_scale)[0, 0] == 0
    d = np.asarray(mxfp8.dequantize(t, mxfp8.Plane.ROWWISE))
    assert d[0, 0] == np.float32(2.0**-136) and d[0, 1] == np.float32(2.0**-119)


def test_roundtrip_error_bound_on_normal_data():
    x = np.random.default_rng(3).standard_normal((128, 128)).astype(np.float32)
    t = mxfp8.quantize(jnp.asarray(x))
    for plane in ("rowwise", "colwise"):
        err = np.abs(np.asarray(mxfp8.dequantize(t, plane)) - x)
        # e4m3 has 3 mantissa bits: relative error <= 2^-4 for elements in the normal range
        # of their block; elements far below the block max lose more, bounded by the block max.
        assert np.all(err <= np.maximum(np.abs(x) * 2.0**-4, 2.0**-9 * np.abs(x).max()))
