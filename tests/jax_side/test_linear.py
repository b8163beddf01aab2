"""The Flax twin's linear math (``jax_side.linear``): quantization points, token padding,
external planes, the high-precision control, and errors. No torch here (DESIGN.md 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import KernelConfig, LinearMode
from jax_side.linear import (
    high_precision_linear,
    linear_fn,
    mxfp8_linear,
    quantize_weight,
)
from jax_side.mxfp8 import GemmRole, matmul, quantize


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _pad_np(a: jax.Array) -> jax.Array:
    """Zero rows up to the next multiple of 32, built in numpy (independent of pad_tokens)."""
    a = np.asarray(a)
    out = np.zeros((-(-a.shape[0] // 32) * 32, a.shape[1]), a.dtype)
    out[: a.shape[0]] = a
    return jnp.asarray(out)


def _reference(x, w, dy):
    """The bridge op's recipe spelled out: pad tokens, quantize, one GEMM per role, slice."""
    t = x.shape[0]
    xq, dyq = quantize(_pad_np(x)), quantize(_pad_np(dy))
    wq = quantize(w.astype(jnp.bfloat16))
    y = matmul(xq, wq, GemmRole.FORWARD)[:t]
    dx = matmul(dyq, wq, GemmRole.DGRAD)[:t]
    dw = matmul(dyq, xq, GemmRole.WGRAD)
    return y, dx, dw


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("tokens", [32, 40, 7])
def test_mxfp8_linear_matches_the_recipe_bit_for_bit(tokens):
    x, w, dy = _rand((tokens, 64), 0), _rand((96, 64), 1) * 0.05, _rand((tokens, 96), 2)
    y, vjp = jax.vjp(lambda a, b: mxfp8_linear(a, b), x, w)
    dx, dw = vjp(dy)
    ry, rdx, rdw = _reference(x, w, dy)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_token_padding_rows_are_invisible():
    """T = 40: the last 32x1 colwise block holds 8 real rows; its scales are those of quantizing
    the 8 rows alone, and rows 0..31 quantize exactly as without the extra rows."""
    x = _rand((40, 64), 3)
    q = quantize(_pad_np(x))
    alone = quantize(_pad_np(x[32:]))
    np.testing.assert_array_equal(_bits(q.colwise_scale[1]), _bits(alone.colwise_scale[0]))
    np.testing.assert_array_equal(_bits(q.colwise_data[32:40]), _bits(alone.colwise_data[:8]))
    np.testing.assert_array_equal(_bits(q.colwise_data[40:]), np.zeros((24, 64), np.uint8))
    head = quantize(x[:32])
    np.testing.assert_array_equal(_bits(q.rowwise_data[:32]), _bits(head.rowwise_data))


def test_external_planes_are_used_as_is_and_weight_values_never_read():
    x, w, dy = _rand((40, 64), 4), _rand((64, 64), 5) * 0.05, _rand((40, 64), 6)
    planes = quantize_weight(w)
    slot = jnp.full_like(w, jnp.nan)  # would poison every output if it were read
    y, vjp = jax.vjp(lambda a, b: mxfp8_linear(a, b, planes), x, slot)
    dx, dw = vjp(dy)
    ry, rdx, rdw = _reference(x, w, dy)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_high_precision_control_is_an_fp32_matmul():
    x, w = _rand((40, 64), 7), _rand((96, 64), 8)
    y = high_precision_linear(x, w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    assert linear_fn(LinearMode.HIGH_PRECISION).func is high_precision_linear  # bound kernels
    assert linear_fn("mxfp8").func is mxfp8_linear  # bound to the resolved kernels


def _dots(jaxpr) -> list:
    """Every dot_general of a jaxpr and the jaxprs inside it: its operand dtypes."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    found += _dots(sub)
    return found


def test_bf16_control_runs_every_gemm_on_bf16_operands():
    """The bf16 control with a tensor-core GEMM (not the exact ``dequant_dot``): forward, dgrad
    and wgrad all take bf16 operands (JAX's own transpose would run the backward's two GEMMs on
    an fp32 cotangent: fp32/TF32 GEMMs), and the gradients are the exact-product, fp32-accumulated
    ones of the HIGHEST-precision reference (accumulation order only)."""
    from jax_side.mxfp8.kernels import resolve_kernels

    tc = resolve_kernels(KernelConfig(gemm="dequant_bf16_dot"))
    x = _rand((64, 96), 3).astype(jnp.bfloat16)
    w = _rand((48, 96), 4).astype(jnp.bfloat16)
    dy = _rand((64, 48), 5).astype(jnp.bfloat16)

    def vjp(kernels):
        y, pull = jax.vjp(lambda a, b: high_precision_linear(a, b, kernels=kernels), x, w)
        return (y, *pull(dy))

    jaxpr = jax.make_jaxpr(lambda: vjp(tc))().jaxpr
    assert _dots(jaxpr) == [("bfloat16", "bfloat16")] * 3, _dots(jaxpr)
    got, want = vjp(tc), vjp(resolve_kernels(KernelConfig(gemm="dequant_dot")))
    for name, g, r in zip(("y", "dx", "dw"), got, want, strict=True):
        assert g.dtype == r.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2**-7, atol=1e-6, err_msg=name)


def test_errors_name_the_problem():
    x, w = _rand((8, 64), 9), _rand((32, 96), 10)
    with pytest.raises(ValueError, match=r"same K.*reshape"):
        mxfp8_linear(x, w)
    with pytest.raises(ValueError, match="planes of this very parameter"):
        mxfp8_linear(x, _rand((32, 64), 11), quantize_weight(_rand((64, 64), 12)))
    with pytest.raises(ValueError, match="high-precision control"):
        high_precision_linear(x, _rand((32, 64), 11), quantize_weight(_rand((32, 64), 12)))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        mxfp8_linear(x.astype(jnp.float16), _rand((32, 64), 11))
    with pytest.raises(ValueError, match="unknown linear mode"):
        linear_fn("fp4")


@pytest.mark.parametrize("external_planes", [False, True], ids=["quantized", "planes"])
def test_zero_tokens_give_empty_outputs_and_a_zero_weight_gradient(external_planes):
    x, w = jnp.zeros((0, 64), jnp.float32), _rand((96, 64), 7) * 0.05
    planes = quantize_weight(w) if external_planes else None
    y, vjp = jax.vjp(lambda a, b: mxfp8_linear(a, b, planes), x, w)
    dx, dw = vjp(jnp.zeros((0, 96), jnp.float32))
    assert y.shape == (0, 96) and dx.shape == (0, 64)
    assert dw.shape == (96, 64) and not np.asarray(dw).any()


def test_float64_inputs_are_refused_not_narrowed():
    """With x64 off, JAX would narrow a float64 numpy array to fp32 silently (then round again
    to bf16 / E4M3): refused up front, naming the argument."""
    x, w = np.ones((32, 64)), np.ones((96, 64), np.float32)
    with pytest.raises(TypeError, match=r"mxfp8_linear: x has dtype float64.*astype"):
        mxfp8_linear(x, w)
    with pytest.raises(TypeError, match=r"mxfp8_linear: weight has dtype float64"):
        mxfp8_linear(w[:32].copy(), w.astype(np.float64))
    with pytest.raises(TypeError, match=r"high_precision_linear: x has dtype float64"):
        high_precision_linear(x, w)
