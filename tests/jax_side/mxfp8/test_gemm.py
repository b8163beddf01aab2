"""MXFP8 GEMM in the three training roles against a float64 reference of the dequantized operands.

The reference multiplies exactly the values the GEMM sees (dequantized planes, exact in fp32) in
float64, so the only difference left is fp32 accumulation: the relative error bound is a small
multiple of K * 2^-24 on well-conditioned random data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_side import mxfp8
from jax_side.mxfp8 import GemmRole

M, N, K = 64, 96, 128


def _q(shape, seed, dtype=jnp.bfloat16):
    x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)
    return x, mxfp8.quantize(x)


def _deq64(t, plane):
    return np.asarray(mxfp8.dequantize(t, plane)).astype(np.float64)


def _reference(role, a, b):
    if role is GemmRole.FORWARD:
        return _deq64(a, "rowwise") @ _deq64(b, "rowwise").T
    if role is GemmRole.DGRAD:
        return _deq64(a, "rowwise") @ _deq64(b, "colwise")
    return _deq64(a, "colwise").T @ _deq64(b, "colwise")


ROLE_OPERANDS = {
    GemmRole.FORWARD: ((M, K), (N, K), (M, N)),  # x, W -> y
    GemmRole.DGRAD: ((M, N), (N, K), (M, K)),  # dy, W -> dx
    GemmRole.WGRAD: ((M, N), (M, K), (N, K)),  # dy, x -> dW
}


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("role", list(GemmRole), ids=[r.value for r in GemmRole])
def test_roles_match_float64_reference(role, out_dtype):
    a_shape, b_shape, out_shape = ROLE_OPERANDS[role]
    _, a = _q(a_shape, 1)
    _, b = _q(b_shape, 2)
    out = mxfp8.matmul(a, b, role, out_dtype=out_dtype)
    assert out.shape == out_shape and out.dtype == out_dtype
    ref = _reference(role, a, b)
    got = np.asarray(out.astype(jnp.float32)).astype(np.float64)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    tol = 1e-5 if out_dtype == jnp.float32 else 2.0**-8  # fp32 accumulation / one bf16 rounding
    assert rel < tol, f"{role.value}: relative error {rel:.2e} >= {tol:.0e}"


def test_bf16_output_is_the_rounded_fp32_result():
    _, a = _q((M, K), 3)
    _, b = _q((N, K), 4)
    f32 = mxfp8.matmul(a, b, "forward")
    bf16 = mxfp8.matmul(a, b, "forward", out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16), np.asarray(f32.astype(jnp.bfloat16)))


def test_matmul_under_jit_equals_eager():
    _, a = _q((M, K), 5)
    _, b = _q((N, K), 6)
    eager = mxfp8.matmul(a, b, GemmRole.FORWARD)
    jitted = jax.jit(lambda a, b: mxfp8.matmul(a, b, GemmRole.FORWARD))(a, b)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_quantized_gemm_tracks_high_precision_product():
    # End-to-end sanity of the recipe: MXFP8 forward vs the unquantized product, e4m3 level.
    x, xq = _q((M, K), 7, jnp.float32)
    w, wq = _q((N, K), 8, jnp.float32)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = np.asarray(mxfp8.matmul(xq, wq, "forward"))
    assert np.abs(got - exact).max() / np.abs(exact).max() < 0.05


def test_scaled_matmul_impl_refuses_on_cpu():
    if jax.devices()[0].platform == "gpu":
        pytest.skip("CPU-only behaviour")
    _, a = _q((M, K), 1)
    _, b = _q((N, K), 2)
    with pytest.raises(ValueError, match="needs a GPU"):
        mxfp8.matmul(a, b, "forward", impl="scaled_matmul")


@pytest.mark.gpu
@pytest.mark.parametrize("role", list(GemmRole), ids=[r.value for r in GemmRole])
def test_scaled_matmul_agrees_with_reference_on_gpu(role):
    a_shape, b_shape, _ = ROLE_OPERANDS[role]
    _, a = _q(a_shape, 1)
    _, b = _q(b_shape, 2)
    ref = np.asarray(mxfp8.matmul(a, b, role)).astype(np.float64)
    got = np.asarray(mxfp8.matmul(a, b, role, impl="scaled_matmul")).astype(np.float64)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
