"""Bad input gets a clear error naming the shape or dtype and the fix; nothing is corrupted."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

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
        mxfp8.quantize(jnp.zeros((32, 32)), rowwise=False, colwise=False)


def test_gemm_contracted_dims_must_match():
    a = mxfp8.quantize(jnp.zeros((32, 64)))
    b = mxfp8.quantize(jnp.zeros((32, 96)))
    with pytest.raises(ValueError, match=r"contracted dims differ.*\(32, 64\).*\(32, 96\)"):
        mxfp8.matmul(a, b, "forward")


def test_gemm_needs_the_role_planes():
    x = mxfp8.quantize(jnp.zeros((32, 64)), colwise=False)
    w = mxfp8.quantize(jnp.zeros((32, 64)), colwise=False)
    with pytest.raises(ValueError, match=r"operand b .* needs its colwise plane.*colwise=True"):
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
    t = mxfp8.quantize(jnp.zeros((32, 32)), colwise=False)
    with pytest.raises(ValueError, match="unknown MXFP8 plane 'diag'"):
        mxfp8.dequantize(t, "diag")
    with pytest.raises(ValueError, match="no colwise plane"):
        mxfp8.dequantize(t, "columnwise")
    with pytest.raises(TypeError, match="expected an MXFP8Tensor"):
        mxfp8.dequantize(jnp.zeros((32, 32)), "rowwise")


def test_scale_inputs_are_checked():
    flat = jnp.zeros((64,), jnp.float32)
    with pytest.raises(ValueError, match=r"expected scale shape \(32, 1\), got \(32, 2\)"):
        mxfp8.cast_slice(flat, (32, 32), 0, rowwise_scale=jnp.zeros((32, 2), jnp.uint8))
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        mxfp8.cast_slice(flat, (32, 32), 0, rowwise_scale=jnp.zeros((32, 1), jnp.float32))
    with pytest.raises(TypeError, match="expected float32 amax"):
        mxfp8.scales_from_amax(jnp.zeros((4,), jnp.bfloat16))
