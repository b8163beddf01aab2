"""The fast GEMM (``dequant_bf16_dot``, the GPU default) against the exact reference
(``dequant_dot``), with a stated tolerance and why.

Why the tolerance: an E4M3 element times its E8M0 scale has at most 4 significant bits, so its
bf16 conversion is exact wherever the value is at least 2^-130 (bf16 keeps 8 significant bits
down to 2^-126 and subnormals down to 2^-133). A product of two such values has at most 8
significant bits: exact in fp32. So the fast path and the reference sum the same exact fp32
products, in another order (and, on tensor cores, with their own fp32 accumulation rounding): per
output element the two differ by at most ~K rounding errors of the running sum,
``|fast - ref| <= (K + 2) * 2^-22 * sum_k |a_k * b_k|`` (a factor 4 over the classical
``K * 2^-24`` recursive-summation bound, for the tensor cores' accumulation). Values below
2^-130 are rounded to bf16 on a GPU (flushed to zero where XLA flushes subnormals, as on CPU):
each such element changes its products by less than 2^-130 * |b|, stated and tested below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_side import mxfp8
from jax_side.mxfp8 import GemmRole, KernelConfig, resolve_kernels

ROLES = {
    GemmRole.FORWARD: ((64, 128), (96, 128), lambda a, b: a @ b.T, ("rowwise", "rowwise")),
    GemmRole.DGRAD: ((64, 96), (96, 128), lambda a, b: a @ b, ("rowwise", "colwise")),
    GemmRole.WGRAD: ((64, 96), (64, 128), lambda a, b: a.T @ b, ("colwise", "colwise")),
}


def _operands(role, seed):
    a_shape, b_shape, _, _ = ROLES[role]
    k1, k2 = jax.random.split(jax.random.key(seed))
    # wide dynamic range: per-row scales from 2^-20 to 2^20, so blocks get very different scales
    a = jax.random.normal(k1, a_shape) * jnp.exp2(jax.random.randint(k1, (a_shape[0], 1), -20, 20))
    b = jax.random.normal(k2, b_shape) * jnp.exp2(jax.random.randint(k2, (b_shape[0], 1), -20, 20))
    return mxfp8.quantize(a.astype(jnp.bfloat16)), mxfp8.quantize(b.astype(jnp.bfloat16))


@pytest.mark.parametrize("role", list(GemmRole), ids=[r.value for r in GemmRole])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_gemm_is_the_reference_up_to_accumulation_order(role, seed):
    a, b = _operands(role, seed)
    _, _, product, planes = ROLES[role]
    ref = np.asarray(mxfp8.matmul(a, b, role, impl="dequant_dot"), np.float64)
    fast = np.asarray(mxfp8.matmul(a, b, role, impl="dequant_bf16_dot"), np.float64)
    abs_a = np.abs(np.asarray(mxfp8.dequantize(a, planes[0]), np.float64))
    abs_b = np.abs(np.asarray(mxfp8.dequantize(b, planes[1]), np.float64))
    k = abs_a.shape[1] if role is GemmRole.FORWARD or role is GemmRole.DGRAD else abs_a.shape[0]
    bound = (k + 2) * 2.0**-22 * product(abs_a, abs_b)
    assert np.all(np.abs(fast - ref) <= bound), float(np.max(np.abs(fast - ref) - bound))
    assert fast.dtype == ref.dtype and np.all(np.isfinite(fast))


def test_elements_below_bf16_range_are_rounded_within_the_stated_bound():
    """A block with scale byte 0 (2^-127) holds elements down to 2^-136: the reference keeps them
    (exact fp32 dequantize); the fast path rounds them to bf16 (or flushes them, on CPU): each
    product changes by less than 2^-130 * |b|."""
    tiny = np.zeros((32, 32), np.float32)
    tiny[0, :8] = np.ldexp(np.float32(1.0), np.arange(-136, -128))  # 2^-136 .. 2^-129
    a = mxfp8.quantize(jnp.asarray(tiny))
    assert int(np.asarray(a.rowwise_scale).view(np.uint8)[0, 0]) == 0  # the smallest scale
    b = mxfp8.quantize(jnp.ones((32, 32), jnp.float32))
    ref = np.asarray(mxfp8.matmul(a, b, "forward", impl="dequant_dot"), np.float64)
    fast = np.asarray(mxfp8.matmul(a, b, "forward", impl="dequant_bf16_dot"), np.float64)
    assert ref[0, 0] == pytest.approx(sum(2.0**e for e in range(-136, -128)), rel=1e-6)
    below = sum(2.0**e for e in range(-136, -130))  # the elements under 2^-130
    assert abs(fast[0, 0] - ref[0, 0]) <= below + 1e-45
    np.testing.assert_array_equal(fast[1:], ref[1:])  # zero rows stay exactly zero


def test_kernel_config_chooses_the_gemm_and_the_default_is_per_device():
    cpu = resolve_kernels(None, "cpu")
    gpu = resolve_kernels(None, "gpu")
    assert cpu.gemm.value == "dequant_dot" and gpu.gemm.value == "dequant_bf16_dot"
    assert "default on gpu" in gpu.reason
    explicit = resolve_kernels(KernelConfig("xla", "dequant_bf16_dot"), "cpu")
    assert explicit.gemm.value == "dequant_bf16_dot" and "explicitly" in explicit.reason
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_kernels(KernelConfig(gemm="scaled_matmul"), "cpu")


def test_gemm_environment_variable_overrides_only_the_default(monkeypatch):
    """An application's MXFP8_GEMM (apps.environment.kernels) fills only a None gemm."""
    from apps import environment

    monkeypatch.setenv(environment.GEMM, "dequant_bf16_dot")
    assert resolve_kernels(environment.kernels(None), "cpu").gemm.value == "dequant_bf16_dot"
    pinned = resolve_kernels(environment.kernels(KernelConfig(gemm="dequant_dot")), "cpu")
    assert pinned.gemm.value == "dequant_dot"
    assert resolve_kernels(None, "cpu").gemm.value == "dequant_dot"  # the library: no env


def test_cpu_work_in_a_gpu_process_runs_the_reference_backend(monkeypatch):
    """On the GPU machine, CPU tensors (the parity report's --device cpu) must not get the GPU's
    automatic backend: compiled Pallas on CPU arrays failed there ("Only interpret mode is
    supported on CPU backend"). Simulated here: the default device and the probe say H200."""
    from jax_side.mxfp8.te_probe import TEProbe
    from tests.jax_side.mxfp8.machines import simulated_gpu

    h200 = TEProbe(False, "not installed", False, 90)
    with simulated_gpu(h200):
        assert resolve_kernels(None, "gpu").backend.value == "pallas"
        cpu = resolve_kernels(None, "cpu")
        assert cpu.backend.value == "xla" and "work on the CPU" in cpu.reason
        with pytest.raises(ValueError, match="default device is 'gpu'.*backend='xla'"):
            resolve_kernels(KernelConfig(backend="pallas"), "cpu")
