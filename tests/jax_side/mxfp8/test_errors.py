"""Bad input gets a clear error naming the shape or dtype and the fix; nothing is corrupted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.formats import Plane
from jax_side import mxfp8


@pytest.mark.parametrize(
    "shape,match",
    [
        ((32,), r"2-D .*got shape \(32,\).*reshape"),
        ((2, 32, 32), r"2-D .*got shape \(2, 32, 32\)"),
        ((32, 40), r"K % 32 == 0.*\(32, 40\).*pad to \(32, 64\)"),
        ((48, 32), r"M % 32 == 0.*\(48, 32\).*pad to \(64, 32\)"),
        ((0, 32), r"non-empty"),
    ],
)
def test_bad_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        mxfp8.quantize(jnp.zeros(shape, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.int32, jnp.uint8, jnp.float8_e4m3fn])
def test_bad_dtypes(dtype):
    with pytest.raises(TypeError, match=rf"bfloat16 or float32.*got dtype {jnp.dtype(dtype)}"):
        mxfp8.quantize(jnp.zeros((32, 32), dtype))


def test_no_plane_requested():
    with pytest.raises(ValueError, match="asks for nothing"):
        mxfp8.quantize(jnp.zeros((32, 32)), planes=())


def test_gemm_contracted_dims_must_match():
    a = mxfp8.quantize(jnp.zeros((32, 64)))
    b = mxfp8.quantize(jnp.zeros((32, 96)))
    with pytest.raises(ValueError, match=r"contracted dims differ.*\(32, 64\).*\(32, 96\)"):
        mxfp8.matmul(a, b, "forward")


def test_gemm_needs_the_role_planes():
    x = mxfp8.quantize(jnp.zeros((32, 64)), planes=(Plane.ROWWISE,))
    w = mxfp8.quantize(jnp.zeros((32, 64)), planes=(Plane.ROWWISE,))
    with pytest.raises(ValueError, match=r"operand b .* needs its colwise plane.*Plane.COLWISE"):
        mxfp8.matmul(mxfp8.quantize(jnp.zeros((32, 32))), w, "dgrad")
    with pytest.raises(ValueError, match=r"operand a .* needs its colwise plane"):
        mxfp8.matmul(x, x, "wgrad")


def test_gemm_operand_types_role_and_out_dtype():
    t = mxfp8.quantize(jnp.zeros((32, 32)))
    with pytest.raises(TypeError, match="must be an MXFP8Tensor"):
        mxfp8.matmul(jnp.zeros((32, 32)), t, "forward")
    with pytest.raises(ValueError, match=r"unknown matmul role .fwd.*forward.*dgrad.*wgrad"):
        mxfp8.matmul(t, t, "fwd")
    with pytest.raises(TypeError, match="out_dtype must be float32 or bfloat16"):
        mxfp8.matmul(t, t, "forward", out_dtype=jnp.float16)


def test_dequantize_bad_plane_and_type():
    t = mxfp8.quantize(jnp.zeros((32, 32)), planes=(Plane.ROWWISE,))
    with pytest.raises(ValueError, match="unknown MXFP8 plane 'diag'"):
        mxfp8.dequantize(t, "diag")
    with pytest.raises(ValueError, match="no colwise plane"):
        mxfp8.dequantize(t, "columnwise")
    with pytest.raises(TypeError, match="expected an MXFP8Tensor"):
        mxfp8.dequantize(jnp.zeros((32, 32)), "rowwise")


def test_scale_inputs_are_checked():
    flat = jnp.zeros((64,), jnp.float32)
    with pytest.raises(ValueError, match=r"expected scale shape \(32, 1\), got \(32, 2\)"):
        mxfp8.cast_slice(flat, (32, 32), 0, scales={"rowwise": jnp.zeros((32, 2), jnp.uint8)})
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        mxfp8.cast_slice(flat, (32, 32), 0, scales={"rowwise": jnp.zeros((32, 1), jnp.float32)})
    with pytest.raises(TypeError, match="expected float32 amax"):
        mxfp8.scales_from_amax(jnp.zeros((4,), jnp.bfloat16))


def test_hand_built_tensor_with_uint8_planes_is_refused():
    """uint8 bytes are not E4M3 values: a value cast turns 0x44 (E4M3 3.0) into 68.0, so the
    constructor refuses them and names the bitcast that reinterprets them."""
    data, scale = np.full((32, 32), 0x44, np.uint8), np.full((32, 1), 127, np.uint8)
    e4m3 = jax.lax.bitcast_convert_type(jnp.asarray(data), jnp.float8_e4m3fn)
    e8m0 = jax.lax.bitcast_convert_type(jnp.asarray(scale), jnp.float8_e8m0fnu)
    f32 = np.dtype(np.float32)
    with pytest.raises(TypeError, match=r"rowwise_data has dtype uint8.*bitcast_convert_type"):
        mxfp8.MXFP8Tensor({Plane.ROWWISE: (data, e8m0)}, (32, 32), f32)
    with pytest.raises(TypeError, match=r"rowwise_scale has dtype uint8.*float8_e8m0fnu"):
        mxfp8.MXFP8Tensor({Plane.ROWWISE: (e4m3, scale)}, (32, 32), f32)
    good = mxfp8.MXFP8Tensor({Plane.ROWWISE: (e4m3, e8m0)}, (32, 32), f32)
    assert float(mxfp8.dequantize(good)[0, 0]) == 3.0


def test_hand_built_tensor_with_wrong_shapes_is_refused():
    t = mxfp8.quantize(jnp.ones((32, 64), jnp.float32))
    with pytest.raises(ValueError, match=r"colwise_scale has shape \(64, 1\), expected \(1, 64\)"):
        mxfp8.MXFP8Tensor({Plane.COLWISE: (t.colwise_data, t.colwise_scale.reshape(64, 1))},
                          t.shape, t.dtype)
    with pytest.raises(ValueError, match=r"rowwise_data has shape \(64, 32\), expected \(32, 64\)"):
        mxfp8.MXFP8Tensor({Plane.ROWWISE: (t.rowwise_data.reshape(64, 32), t.rowwise_scale)},
                          t.shape, t.dtype)
    with pytest.raises(ValueError, match="both be given or both be None"):
        mxfp8.MXFP8Tensor({Plane.ROWWISE: (t.rowwise_data, None)}, t.shape, t.dtype)
    with pytest.raises(ValueError, match=r"M % 32 == 0"):
        mxfp8.MXFP8Tensor({}, (40, 64), t.dtype)


def test_validation_works_under_jit_vmap_and_tree_map():
    """Tracers and batched (vmap-stacked) leaves pass; non-array leaves are not checked."""
    x = jnp.ones((2, 32, 64), jnp.float32)
    stacked = jax.vmap(mxfp8.quantize)(x)  # leaves (2, 32, 64) / (2, 32, 2) with shape (32, 64)
    assert stacked.rowwise_data.shape == (2, 32, 64)
    jitted = jax.jit(lambda t: mxfp8.dequantize(t))(mxfp8.quantize(x[0]))
    assert jitted.shape == (32, 64)
    shapes = jax.tree_util.tree_map(lambda a: a.shape, mxfp8.quantize(x[0]))
    assert shapes.rowwise_data == (32, 64)


def test_scales_from_amax_special_values():
    """DESIGN.md 3 step 3: NaN -> 0xFF (either sign), +Inf -> 0xFE, 0 and -0.0 -> 0x00."""
    amax = jnp.asarray([np.nan, -np.nan, np.inf, 0.0, -0.0], jnp.float32)
    got = np.asarray(jax.lax.bitcast_convert_type(mxfp8.scales_from_amax(amax), jnp.uint8))
    np.testing.assert_array_equal(got, [0xFF, 0xFF, 0xFE, 0x00, 0x00])


@pytest.mark.parametrize("start", [1.5, np.float32(2.0), "0"])
def test_slice_start_must_be_an_integer(start):
    flat = jnp.zeros((64,), jnp.float32)
    with pytest.raises(TypeError, match=r"start must be an integer flat offset"):
        mxfp8.partial_block_amax(flat, (32, 32), start)
    with pytest.raises(TypeError, match=r"start must be an integer flat offset"):
        row = {Plane.ROWWISE: jnp.zeros((32, 1), jnp.uint8)}
        mxfp8.cast_slice(flat, (32, 32), start, scales=row)


def test_float64_input_is_refused_before_jax_narrows_it():
    """With x64 off, jnp.asarray would turn a float64 array into fp32 (a first rounding before
    the bf16 / E4M3 one); quantize refuses it instead, naming the dtype."""
    with pytest.raises(TypeError, match=r"bfloat16 or float32.*got dtype float64"):
        mxfp8.quantize(np.ones((32, 32), np.float64))


@pytest.mark.parametrize(
    "x",
    [[[1.0] * 32] * 32, tuple((1.0,) * 32 for _ in range(32)), 1.0],
    ids=["list", "tuple", "python-float"],
)
def test_non_array_input_is_refused_instead_of_narrowed_to_float32(x):
    """A list of Python floats (float64 values) has no dtype: jnp.asarray would make it float32
    without a word. quantize asks for an array of an explicit dtype instead."""
    with pytest.raises(TypeError) as err:
        mxfp8.quantize(x)
    text = str(err.value)
    assert f"quantize: x is a {type(x).__name__}, not an array" in text, text
    assert "pass a jnp or np array of dtype bfloat16 or float32" in text, text
    explicit = mxfp8.quantize(jnp.asarray(x if isinstance(x, list) else [[1.0] * 32] * 32,
                                          jnp.bfloat16))  # the fix the message gives works
    assert explicit.rowwise_data.shape == (32, 32)
