"""The ``fp8_blocked`` GEMM with the GELU in its epilogue (``jax_side.mxfp8.epilogue``, issue 33).

The reference (``gelu_aux_reference``: the fp32 accumulator, the GELU in fp32, one rounding to
bf16) against numpy in float64; the CPU path (the exact dot, then the reference) byte for byte;
the linear's fused forward (``blocked_operands.forward_post``) against the plain fp32 forward and
the reference; and, on the GPU, cuBLASLt's ``GELU_AUX`` epilogue within the stated bound of the
reference, the GELU's input byte-equal to the plain GEMM's bf16 output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.formats import Plane
from common.kernels import KernelConfig
from jax_side import linear as L
from jax_side.mxfp8 import blocked_operands, epilogue, resolve_kernels
from jax_side.mxfp8.gemm_impls import blocked_product
from jax_side.mxfp8.reblock import blocked_dot_reference, reblock_rows, reblock_tiles
from models import gpt_math

SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 8.0, -8.0, 20.0, -20.0, 1e30, -1e30,
           float("inf"), float("-inf"), float("nan")]


def _x(shape=(64, 96), seed=0, dtype=jnp.bfloat16):
    x = 4.0 * jax.random.normal(jax.random.key(seed), shape)
    x = x.reshape(-1).at[:len(SPECIAL)].set(jnp.asarray(SPECIAL)).reshape(shape)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_epilogues_gelu_is_the_models_byte_for_byte(dtype):
    x = _x(dtype=dtype)
    assert np.asarray(epilogue.gelu_tanh(x)).tobytes() == np.asarray(
        gpt_math.gelu_tanh(x)).tobytes()


def _gelu64(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def test_the_reference_is_the_gelu_rounded_once():
    """Against float64 numpy: within one bf16 ulp (a rounding, either way where fp32 arithmetic
    lands near a tie), except where 1 + tanh cancels (large negative inputs, values near 0:
    there the absolute error is below 2^-16 of the accumulator); the GELU's input is the
    accumulator rounded once to bf16, NaN and Inf kept."""
    acc = np.asarray(_x((256, 128), 1, jnp.float32))
    g, h = epilogue.gelu_aux_reference(jnp.asarray(acc))
    assert np.asarray(h).tobytes() == np.asarray(jnp.asarray(acc).astype(jnp.bfloat16)).tobytes()
    finite = np.isfinite(acc) & (np.abs(acc) < 1e4)
    with np.errstate(all="ignore"):
        want = _gelu64(acc)
        err = np.abs(np.asarray(g, np.float64) - want)
        ok = (epilogue.bf16_ulps(g, want) <= 1) | (err <= 2.0 ** -16 * np.abs(acc))
        assert ok[finite].all(), np.abs(acc[finite & ~ok]).max()
    assert np.isnan(np.asarray(g, np.float32)[np.isnan(acc)]).all()
    assert (np.asarray(g, np.float32)[acc == np.inf] == np.inf).all()


def _operands(m=200, k=256, n=384, seed=2):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (m, k)).astype(jnp.bfloat16)
    w = 0.05 * jax.random.normal(kb, (n, k))
    kernels = resolve_kernels(KernelConfig(backend="xla", gemm="fp8_blocked"))
    return a, L.quantize_weight(w, kernels=kernels).only(Plane.ROWWISE), kernels


def _rows_and_tiles(a, w):
    from jax_side.mxfp8 import quantize

    def u8(plane):
        data, scale = plane
        return data, jax.lax.bitcast_convert_type(scale, jnp.uint8)

    ra = reblock_rows(*u8(quantize(a, planes="rowwise").plane(Plane.ROWWISE)))
    return ra, reblock_tiles(*u8(w.plane(Plane.ROWWISE)))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path's bytes")
def test_on_the_cpu_the_product_is_the_exact_dot_then_the_reference():
    a, w, _ = _operands(m=128)
    ra, rb = _rows_and_tiles(a, w)
    acc = blocked_dot_reference(ra, rb)
    g, h = epilogue.blocked_product_gelu(ra, rb, 120, 300)
    want_g, want_h = epilogue.gelu_aux_reference(acc)
    assert np.asarray(g).tobytes() == np.asarray(want_g[:120, :300]).tobytes()
    assert np.asarray(h).tobytes() == np.asarray(want_h[:120, :300]).tobytes()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path's bytes")
@pytest.mark.parametrize("keep", [True, False])
def test_the_fused_forward_is_the_fp32_forward_then_the_reference(keep):
    """``forward_post(post="gelu_tanh")``: (GELU, input) of the fp32 GEMM output rounded once
    each (200 tokens: padded to 256 and cut back), and the same wgrad tiles as ``forward``."""
    a, w, kernels = _operands()
    g, h, kept = blocked_operands.forward_post(a, w, "gelu_tanh", keep, kernels)
    y, kept_plain = blocked_operands.forward(a, w, jnp.float32, jnp.float32, keep, kernels)
    want_g, want_h = epilogue.gelu_aux_reference(y)
    assert g.shape == h.shape == (200, 384)
    assert np.asarray(g).tobytes() == np.asarray(want_g).tobytes()
    assert np.asarray(h).tobytes() == np.asarray(want_h).tobytes()
    if keep:
        assert np.asarray(kept.tiles.data).tobytes() == np.asarray(
            kept_plain.tiles.data).tobytes()
    else:
        assert kept is None and kept_plain is None


def test_post_names_an_epilogue_or_is_refused():
    epilogue.check_post("gelu_tanh", "here")
    for bad in ("relu", gpt_math.gelu_tanh, None):
        with pytest.raises(ValueError, match=r"here: post=.* expected one of \['gelu_tanh'\]"):
            epilogue.check_post(bad, "here")


def _within_bound(got, want, acc):
    """``EPILOGUE_BOUND_ULPS`` of the reference's magnitude, or 2^-16 of the accumulator's where
    1 + tanh cancels; the largest excess as the message."""
    g, w = (np.asarray(jnp.asarray(v, jnp.float32), np.float64) for v in (got, want))
    err = np.abs(g - w)
    ulps = epilogue.bf16_ulps(got, want)
    ok = (ulps <= epilogue.EPILOGUE_BOUND_ULPS) | (
        err <= 2.0 ** -16 * np.abs(np.asarray(acc, np.float64)))
    return bool(ok.all()), float(ulps[~ok].max()) if not ok.all() else 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 2048, 8192), (1024, 1024, 4096)])
def test_on_the_gpu_cublaslts_gelu_epilogue_stays_within_the_bound(shape):
    m, k, n = shape
    a, w, _ = _operands(m, k, n)
    ra, rb = _rows_and_tiles(a, w)
    acc = jax.jit(lambda x, y: blocked_product(x, y, m, n, jnp.float32))(ra, rb)
    plain = jax.jit(lambda x, y: blocked_product(x, y, m, n, jnp.bfloat16))(ra, rb)
    g, h = jax.jit(lambda x, y: epilogue.blocked_product_gelu(x, y, m, n))(ra, rb)
    assert np.asarray(h).tobytes() == np.asarray(plain).tobytes(), "the GELU's input"
    ok, worst = _within_bound(g, epilogue.gelu_aux_reference(acc)[0], acc)
    assert ok, f"GELU_AUX: {worst} ulps"

