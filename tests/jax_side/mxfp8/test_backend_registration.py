"""A kernel backend added exactly as docs/extending.md says ("A kernel backend"), from the tests
alone, resolves to itself and runs.

The walkthrough: (1) a class implementing ``backend_api.KernelBackend`` -- here the ``xla``
backend under the name ``fake``, counting the operations it runs; (2) ``register_backend`` with a
loader. Then ``KernelConfig(backend="fake")``, ``MXFP8_BACKEND=fake`` (read by the applications,
``apps.environment.kernels``), ``resolve_kernels``,
``kernel_report``, the public functions (``quantize``, ``matmul``, the slice building blocks) and
a training step of the JAX MXFP8 linear all name it and run it, and the conformance suite
(``test_backend_conformance.py``) passes on it. The fixture unregisters it, so no other test
sees it.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from apps import environment
from common.gemm_roles import GemmRole
from common.kernels import Backend, KernelConfig, Platform
from jax_side import mxfp8
from jax_side.linear import mxfp8_linear
from jax_side.mxfp8.backend_api import Availability, Capabilities, Execution, KernelBackend
from jax_side.mxfp8.backends import backend_impl, register_backend, unregister_backend
from jax_side.mxfp8.kernels import Origin
from jax_side.mxfp8.xla_backend import BACKEND as XLA
from tests.jax_side.mxfp8.test_backend_conformance import (  # run here on the fake: see below
    test_every_backend_resolves_to_itself_and_is_reported_as_itself,  # noqa: F401
    test_matmul_is_the_product_of_the_oracle_dequantized_operands,  # noqa: F401
    test_quantize_is_the_oracle_byte_for_byte,  # noqa: F401
    test_slice_operations_rebuild_the_oracle_bytes,  # noqa: F401
)


class FakeBackend(KernelBackend):
    """Step 1 of the guide: a ``KernelBackend`` -- its name, capabilities and five operations
    (its availability is the default one, read from ``runs_on``). It runs the ``xla`` kernels
    and counts each operation it is asked for (counted once per trace under ``jax.jit``)."""

    name = "fake"
    capabilities = Capabilities(
        runs_on=((Platform.CPU, Execution.COMPILED), (Platform.GPU, Execution.COMPILED)),
        slices=True,
        own_gemm=False,
    )

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def quantize(self, x, *, planes):
        self.calls["quantize"] += 1
        return XLA.quantize(x, planes=planes)

    def partial_block_amax(self, flat, shape, start, planes):
        self.calls["partial_block_amax"] += 1
        return XLA.partial_block_amax(flat, shape, start, planes)

    def scales_from_amax(self, amax):
        self.calls["scales_from_amax"] += 1
        return XLA.scales_from_amax(amax)

    def cast_slice(self, flat, shape, start, row_b, col_b):
        self.calls["cast_slice"] += 1
        return XLA.cast_slice(flat, shape, start, row_b, col_b)

    def matmul(self, a, b, role, gemm):
        self.calls["matmul"] += 1
        return XLA.matmul(a, b, role, gemm)


@pytest.fixture
def fake(monkeypatch):
    """Step 2 of the guide: register it (and, here, unregister it after the test)."""
    monkeypatch.delenv(environment.BACKEND, raising=False)
    monkeypatch.delenv(environment.GEMM, raising=False)
    impl = FakeBackend()
    backend = register_backend("fake", lambda: impl)
    try:
        yield impl
    finally:
        unregister_backend(backend)


@pytest.fixture
def kernels(fake):
    """The conformance suite's fixture, imported above: what the public resolver gives for the
    fake (its tests then run the public functions with it)."""
    return mxfp8.resolve_kernels(KernelConfig("fake"))


def test_config_environment_resolver_and_report_all_name_it(fake, monkeypatch):
    config = KernelConfig(backend="fake")
    assert config.backend is Backend("fake") is Backend.parse("FAKE")
    resolved = mxfp8.resolve_kernels(config)
    assert (resolved.backend.value, resolved.slices.value, resolved.origin) == (
        "fake", "fake", Origin.CONFIG)
    assert resolved.reason.startswith("backend fake: requested explicitly; ")
    report = mxfp8.kernel_report(config)
    assert (report["backend"], report["slices"], report["gemm"]) == ("fake", "fake", "dequant_dot")
    assert backend_impl("fake") is fake

    monkeypatch.setenv(environment.BACKEND, "fake")  # an application's command line
    assert environment.kernels(None) == config
    from_env = mxfp8.resolve_kernels(environment.kernels(None))
    assert from_env.backend is config.backend and from_env.origin is Origin.CONFIG


def test_it_is_never_the_automatic_default_unless_preferred(fake):
    assert mxfp8.resolve_kernels(None).backend is not Backend("fake")


def test_the_public_functions_run_it(fake):
    x = jax.random.normal(jax.random.key(0), (64, 96), jnp.float32)
    want = mxfp8.quantize(x, kernels=KernelConfig("xla"))
    got = mxfp8.quantize(x, kernels=KernelConfig("fake"))
    assert fake.calls["quantize"] == 1
    np.testing.assert_array_equal(np.asarray(got.rowwise_data).view(np.uint8),
                                  np.asarray(want.rowwise_data).view(np.uint8))
    mxfp8.quantize(x, backend="fake")  # the shorthand keyword, the same path
    assert fake.calls["quantize"] == 2
    y = mxfp8.matmul(got, got, GemmRole.FORWARD, kernels=KernelConfig("fake"))
    assert fake.calls["matmul"] == 1
    np.testing.assert_array_equal(y, mxfp8.matmul(want, want, kernels=KernelConfig("xla")))
    amax = mxfp8.partial_block_amax(x.reshape(-1)[:100], (64, 96), 0, backend="fake")
    mxfp8.scales_from_amax(amax.rowwise, backend="fake")
    assert fake.calls["partial_block_amax"] == fake.calls["scales_from_amax"] == 1
    # a slice of a longer buffer: the default partial_block_amax_at cuts it out and calls the
    # backend's own partial_block_amax (a backend may override it to read in place)
    at = mxfp8.partial_block_amax(x.reshape(-1), (64, 96), 10, backend="fake", offset=10,
                                  numel=90)
    assert fake.calls["partial_block_amax"] == 2
    np.testing.assert_array_equal(at.rowwise, mxfp8.partial_block_amax(
        x.reshape(-1)[10:100], (64, 96), 10, backend="xla").rowwise)


def test_a_training_step_runs_on_it(fake):
    """One SGD step of the JAX MXFP8 linear (forward, dgrad, wgrad) with the fake's kernels:
    the fake ran quantize and every GEMM, and the step equals the xla step bit for bit."""
    x = jax.random.normal(jax.random.key(1), (32, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (64, 64), jnp.float32) * 0.1

    def step(config):
        def loss(w):
            return jnp.sum(mxfp8_linear(x, w, kernels=config) ** 2)

        value, grad = jax.value_and_grad(loss)(w)
        return value, w - 0.01 * grad

    loss, w_new = step(KernelConfig("fake"))
    assert fake.calls["quantize"] >= 1 and fake.calls["matmul"] >= 3  # forward, dgrad, wgrad
    ref_loss, ref_w = step(KernelConfig("xla"))
    np.testing.assert_array_equal(loss, ref_loss)
    np.testing.assert_array_equal(w_new, ref_w)


def test_unregistered_it_is_unknown_again():
    backend = register_backend("fake", FakeBackend)
    config = KernelConfig(backend)
    assert mxfp8.resolve_kernels(config).backend is backend
    unregister_backend("fake")
    with pytest.raises(ValueError, match="backend 'fake' has no implementation in this build"):
        mxfp8.resolve_kernels(config)  # not answered from the resolver's cache
    known = r"unknown MXFP8 backend 'fake'.*\['xla', 'pallas', 'te'\]"
    with pytest.raises(ValueError, match=known):
        KernelConfig("fake")


def test_registration_refuses_what_would_not_resolve():
    with pytest.raises(ValueError, match="'xla' exists already"):
        register_backend("xla", FakeBackend)
    with pytest.raises(ValueError, match="built-in members cannot be removed"):
        unregister_backend("pallas")
    with pytest.raises(ValueError, match="lower case letters"):
        register_backend("My Kernels", FakeBackend)
    with pytest.raises(TypeError, match="load must be a function"):
        register_backend("fake", FakeBackend())
    misnamed = register_backend("other", FakeBackend)  # its class says name = "fake"
    try:
        with pytest.raises(ValueError, match=r"'other'.*named 'fake'.*name = 'other'"):
            mxfp8.resolve_kernels(KernelConfig("other"))
    finally:
        unregister_backend(misnamed)


def test_a_backend_that_cannot_run_here_says_why(monkeypatch):
    """Its availability is the one answer the resolver uses: the error names the backend, the
    platform and the reason, and the automatic default is untouched."""
    class GpuOnly(FakeBackend):
        name = "gpu_only"

        def availability(self, site):
            return Availability.unusable(f"needs a GPU ({site.platform.value} work here)")

    backend = register_backend("gpu_only", GpuOnly)
    try:
        with pytest.raises(RuntimeError, match=r"'gpu_only' was requested for work on cpu, but "
                                               r"it cannot run here: needs a GPU .*'xla'"):
            mxfp8.kernel_report(KernelConfig("gpu_only"), "cpu")
        assert mxfp8.resolve_kernels(None, "cpu").backend is Backend.XLA
    finally:
        unregister_backend(backend)
