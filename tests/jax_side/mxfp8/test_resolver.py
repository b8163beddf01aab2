"""The one kernel resolver (``jax_side.mxfp8.kernels.resolve_kernels``, DESIGN.md 7).

Every public function resolves its ``kernels`` (or the ``backend=`` / ``impl=`` shorthand) through
it, so what runs is what ``kernel_report`` names; the automatic defaults are read there and
nowhere else (the environment only by the applications: ``apps.environment``). GPUs are
simulated (``machines.simulated_gpu``: hand-made TE probes, a GPU default platform), so the rules
hold on this CPU-only CI.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest

from apps import environment
from common.kernels import Backend, GemmImpl, KernelConfig, Platform
from jax_side import mxfp8
from jax_side.mxfp8.kernels import Origin, resolve_call
from jax_side.mxfp8.te_probe import TEPath, TEProbe
from tests.jax_side.mxfp8.machines import B200, H200, simulated_gpu


@pytest.fixture
def on_gpu(monkeypatch):
    """``on_gpu(probe)``: from then on in the test, a process whose JAX default device is a
    GPU, with the TE probe given."""
    with contextlib.ExitStack() as stack:
        yield lambda probe: stack.enter_context(simulated_gpu(probe))


def _dot_input_dtypes(fn, *args) -> list[str]:
    """Operand dtypes of every dot_general in fn's program: which GEMM implementation ran
    (fp32 operands: dequant_dot; bf16: dequant_bf16_dot)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [
        str(v.aval.dtype)
        for eqn in jaxpr.eqns
        for inner in [eqn, *(e for p in eqn.params.values() if hasattr(p, "eqns") for e in p.eqns)]
        if inner.primitive.name == "dot_general"
        for v in inner.invars
    ]


def test_matmul_runs_the_gemm_that_kernel_report_names(on_gpu):
    # Before the resolver, mxfp8.matmul on a GPU ran dequant_dot while kernel_report (and the
    # linear layer) named dequant_bf16_dot.
    on_gpu(TEProbe(False, "not installed", False, None))
    x = jnp.ones((32, 64), jnp.float32)
    t = mxfp8.quantize(x, kernels=KernelConfig.reference())
    report = mxfp8.kernel_report()
    assert report["gemm"] == "dequant_bf16_dot" and report["platform"] == "gpu"
    named = KernelConfig(report["backend"], report["gemm"])
    got = _dot_input_dtypes(lambda a, b: mxfp8.matmul(a, b), t, t)
    assert got == _dot_input_dtypes(lambda a, b: mxfp8.matmul(a, b, kernels=named), t, t)
    assert got == ["bfloat16", "bfloat16"]


def test_a_chosen_gemm_keeps_the_automatic_default_off_te(on_gpu):
    # Before, the automatic TE choice dropped KernelConfig(gemm=...) without a word.
    on_gpu(B200)
    auto = mxfp8.resolve_kernels(None)
    assert (auto.backend, auto.gemm, auto.path) == (Backend.TE, None, TEPath.KERNELS)
    chosen = mxfp8.resolve_kernels(KernelConfig(gemm="dequant_dot"))
    assert (chosen.backend, chosen.gemm) == (Backend.PALLAS, GemmImpl.DEQUANT_DOT)
    assert "te runs its own GEMM" in chosen.reason


def test_te_quantizes_whole_tensors_and_its_slices_run_on_xla(on_gpu):
    on_gpu(B200)
    for config in (None, KernelConfig("te")):
        resolved = mxfp8.resolve_kernels(config)
        assert resolved.backend is Backend.TE and resolved.slices is Backend.XLA
        assert "slices xla: te has no slice building blocks" in resolved.reason
    assert mxfp8.kernel_report(KernelConfig("te"))["slices"] == "xla"


def test_te_kernels_are_never_picked_below_compute_capability_10(on_gpu):
    on_gpu(H200)
    auto = mxfp8.resolve_kernels(None)
    assert auto.backend is Backend.PALLAS and auto.origin is Origin.AUTOMATIC
    explicit = mxfp8.resolve_kernels(KernelConfig("te"))
    assert explicit.path is TEPath.PURE_JAX and "unsupported" in explicit.reason
    assert mxfp8.kernel_report(KernelConfig("te"))["path"] == "pure_jax"


def test_the_environment_gemm_of_an_application_does_not_apply_to_te(on_gpu, monkeypatch):
    """MXFP8_GEMM fills a None gemm (apps.environment.kernels: the library reads no
    environment), so the automatic default steers off TE as for a chosen GEMM; where the backend
    is te, it does not apply."""
    on_gpu(B200)
    monkeypatch.setenv(environment.GEMM, "dequant_dot")
    assert mxfp8.resolve_kernels(environment.kernels(None)).backend is Backend.PALLAS
    te = mxfp8.resolve_kernels(environment.kernels(KernelConfig("te")))
    assert te.backend is Backend.TE and te.gemm is None
    monkeypatch.setenv(environment.BACKEND, "te")
    with pytest.raises(ValueError, match="te backend runs Transformer Engine's own GEMM"):
        environment.kernels(KernelConfig(gemm="dequant_dot"))
def test_shorthand_keywords_are_the_same_path_as_kernels():
    assert resolve_call("q", None, "xla", "dequant_dot") == mxfp8.resolve_kernels(
        KernelConfig("xla", "dequant_dot")
    )
    x = jnp.ones((32, 32), jnp.float32)
    with pytest.raises(TypeError, match="quantize: pass either kernels=.*not both"):
        mxfp8.quantize(x, backend="xla", kernels=KernelConfig("xla"))
    with pytest.raises(ValueError, match="te backend runs Transformer Engine's own GEMM"):
        mxfp8.matmul(mxfp8.quantize(x), mxfp8.quantize(x), backend="te", impl="dequant_dot")


def test_resolved_kernels_pass_through_for_their_own_platform():
    resolved = mxfp8.resolve_kernels(KernelConfig("xla"), "cpu")
    assert mxfp8.resolve_kernels(resolved) is resolved
    assert mxfp8.resolve_kernels(resolved, Platform.CPU) is resolved
    with pytest.raises(ValueError, match="resolved for cpu work were passed for work on gpu"):
        mxfp8.resolve_kernels(resolved, "gpu")
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        mxfp8.resolve_kernels(None, "tpu")


def test_a_call_on_cpu_arrays_in_a_gpu_process_takes_the_cpus_kernels(on_gpu):
    """In a process whose JAX default device is a GPU, ``quantize`` / ``matmul`` / the slice
    functions on arrays that lie on the CPU resolve for the CPU (the reference, the exact GEMM),
    as the bridge does for CPU tensors: the GPU's default there (Pallas) cannot run on the CPU.
    Traced values (inside ``jit``), numpy inputs and GPU arrays keep JAX's default device."""
    from jax_side.mxfp8.kernels import placement

    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.linspace(-3.0, 3.0, 32 * 64, dtype=jnp.float32).reshape(32, 64), cpu)
    want = mxfp8.quantize(x)  # (the CPU process: the reference)
    on_gpu(H200)
    assert mxfp8.resolve_kernels(None).platform is Platform.GPU
    resolved = resolve_call("quantize", None, operands=(x,))
    assert (resolved.platform, resolved.backend, resolved.gemm) == (
        Platform.CPU, Backend.XLA, GemmImpl.DEQUANT_DOT)
    got = mxfp8.quantize(x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and jax.device_get(a).tobytes() == jax.device_get(b).tobytes()
    assert placement(got, got) is Platform.CPU and placement() is None
    jax.make_jaxpr(lambda t: placement(t) is None or pytest.fail("a tracer has a placement"))(x)
    out = mxfp8.matmul(got, got)  # forward: x (32, 64) . W (32, 64)^T on the CPU
    assert out.shape == (32, 32) and next(iter(out.devices())).platform == "cpu"
    with pytest.raises(ValueError, match="kernels resolved for gpu work were passed for work "
                                         "on cpu"):
        mxfp8.quantize(x, kernels=mxfp8.resolve_kernels(None))
