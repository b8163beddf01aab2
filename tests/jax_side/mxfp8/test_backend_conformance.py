"""Every kernel backend of the table that can run here, through the public resolver
(``resolve_kernels``, ``kernel_report``) and the public functions, against the numpy oracle
(``tests/oracle``).

Parametrized over ``backends.registered()``: ``xla`` and ``pallas`` (interpret mode on a CPU)
always, ``te`` where it says it can run (GPU machines with the ``[te]`` extra; skipped elsewhere
with its reason). Each backend must resolve to itself and be reported as itself; every public
operation its kernels run must give the oracle's bytes on every shape and input here (NaN,
+-Inf, +-0 and subnormals included), the slice building blocks of a backend without them running
on the reference; and its declared interface (``KernelBackend``: ``Capabilities``,
``availability``) must agree with where it runs. ``test_backend_registration.py`` runs the same
public path on a backend registered from the tests.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from common.formats import ALL_PLANES, Plane
from common.gemm_roles import GemmRole
from common.kernels import Backend, GemmImpl, KernelConfig, Platform
from jax_side import mxfp8
from jax_side.mxfp8.backend_api import (
    BackendUnavailable,
    Capabilities,
    Execution,
    Fit,
    KernelBackend,
    UnsupportedOperation,
    default_platform,
    site_for,
)
from jax_side.mxfp8.backends import REFERENCE, backend_impl, registered
from jax_side.mxfp8.kernels import ResolvedKernels
from tests.jax_side.mxfp8.corner_cases import special_mix
from tests.oracle import mxfp8_ref as oracle

FIELDS = ("rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale")
F32, BF16 = np.float32, ml_dtypes.bfloat16
# (shape, dtype): one row of blocks, several blocks of each kind with M != K. Few: every new
# shape compiles every kernel again (Pallas in interpret mode is slow); test_pallas.py and
# test_quantize.py cover many more shapes backend by backend.
CASES = [((32, 64), F32), ((64, 96), BF16)]


@pytest.fixture(params=registered(), ids=lambda b: b.value)
def kernels(request, monkeypatch) -> ResolvedKernels:
    """What the public resolver gives for ``KernelConfig(backend)`` here (skipped, with the
    backend's own reason, where it cannot run)."""
    monkeypatch.delenv("MXFP8_GEMM", raising=False)
    try:
        return mxfp8.resolve_kernels(KernelConfig(request.param))
    except BackendUnavailable as e:
        pytest.skip(str(e))


def u8(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _case_id(case) -> str:
    (m, k), dtype = case
    return f"{m}x{k}-{np.dtype(dtype).name}"


def test_every_backend_resolves_to_itself_and_is_reported_as_itself(kernels):
    backend = kernels.backend
    impl = backend_impl(backend)  # the table's entry: its declared interface
    assert isinstance(impl, KernelBackend) and impl.backend is backend
    assert isinstance(impl.capabilities, Capabilities)
    caps = impl.capabilities
    report = mxfp8.kernel_report(KernelConfig(backend))
    assert report["backend"] == backend.value and report["origin"] == "config"
    assert report["kernels"] == kernels.reason
    assert report["kernels"].startswith(f"backend {backend.value}: requested explicitly; ")
    assert kernels.slices is (backend if caps.slices else REFERENCE)
    assert report["slices"] == kernels.slices.value
    assert (kernels.gemm is None) == caps.own_gemm
    assert report["gemm"] == (backend.value if caps.own_gemm else kernels.gemm.value)
    assert report["execution"] == caps.execution(default_platform()).value
    if not caps.slices:  # what it lacks, it refuses by name (the resolver routes around it)
        _assert_slices_refused(impl, (32, 32), (0, jnp.zeros((64,), jnp.float32)))
    if caps.own_gemm:
        with pytest.raises(UnsupportedOperation, match="runs its own GEMM"):
            impl.matmul(None, None, GemmRole.FORWARD, GemmImpl.DEQUANT_DOT)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_quantize_is_the_oracle_byte_for_byte(kernels, case):
    shape, dtype = case
    x = special_mix(shape, dtype, seed=shape[0] + shape[1])
    want = oracle.quantize(x)
    got = mxfp8.quantize(jnp.asarray(x), kernels=kernels)
    for field in FIELDS:
        np.testing.assert_array_equal(u8(getattr(got, field)), want[field], err_msg=field)
    if case == CASES[0]:
        row_only = mxfp8.quantize(jnp.asarray(x), planes=Plane.ROWWISE, kernels=kernels)
        assert row_only.colwise_data is None and row_only.colwise_scale is None
        np.testing.assert_array_equal(u8(row_only.rowwise_data), want["rowwise_data"])


def _slices_of(x: np.ndarray, cuts: list[int]):
    flat = x.reshape(-1)
    bounds = [0, *cuts, flat.size]
    return [(s, jnp.asarray(flat[s:e])) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]


def test_slice_operations_rebuild_the_oracle_bytes(kernels):
    """Partial amax per slice, MAX-merge, scales, cast per slice: the distributed recipe
    (DESIGN.md 5) in one process, cut mid-block and mid-row inside a 32-row band (one cut: every
    slice length compiles its own programs). They run on ``kernels.slices``: the backend's own,
    or the reference's where it has none."""
    shape, dtype = CASES[1]
    m, k = shape
    x = special_mix(shape, dtype, seed=7)
    parts = _slices_of(x, [k * 40 + 5])  # row 40, column 5: inside the second band
    want = oracle.quantize(x)
    amax = [mxfp8.partial_block_amax(p, shape, s, kernels=kernels) for s, p in parts]
    rs = mxfp8.scales_from_amax(jnp.max(jnp.stack([a.rowwise for a in amax]), axis=0),
                                kernels=kernels)
    cs = mxfp8.scales_from_amax(jnp.max(jnp.stack([a.colwise for a in amax]), axis=0),
                                kernels=kernels)
    np.testing.assert_array_equal(u8(rs), want["rowwise_scale"])
    np.testing.assert_array_equal(u8(cs), want["colwise_scale"])
    scales = {Plane.ROWWISE: rs, Plane.COLWISE: cs}
    casts = [mxfp8.cast_slice(p, shape, s, scales=scales, kernels=kernels) for s, p in parts]
    for plane in ("rowwise", "colwise"):
        data = np.concatenate([u8(getattr(c, plane)) for c in casts]).reshape(m, k)
        np.testing.assert_array_equal(data, want[f"{plane}_data"], err_msg=plane)


def _assert_slices_refused(impl, shape, part) -> None:
    start, flat = part
    calls = {
        "partial_block_amax": lambda: impl.partial_block_amax(flat, shape, start, ALL_PLANES),
        "scales_from_amax": lambda: impl.scales_from_amax(jnp.zeros((4,), jnp.float32)),
        "cast_slice": lambda: impl.cast_slice(flat, shape, start, None, None),
    }
    for name, call in calls.items():
        with pytest.raises(UnsupportedOperation, match=f"{impl.name!r} has no {name}"):
            call()


def test_scales_from_amax_at_every_threshold_is_the_oracle(kernels):
    rng = np.random.default_rng(1)
    amax = np.concatenate([
        np.abs(rng.standard_normal(256)).astype(np.float32) * np.exp2(rng.integers(-140, 127, 256)),
        np.array([0.0, 448.0, 464.0, np.inf, 2.0**-149, np.finfo(np.float32).max], np.float32),
    ]).astype(np.float32)
    got = mxfp8.scales_from_amax(jnp.asarray(amax), kernels=kernels)
    np.testing.assert_array_equal(u8(got), oracle.scale_bytes(amax))


def test_matmul_is_the_product_of_the_oracle_dequantized_operands(kernels):
    """Forward role: y = a @ b.T on the dequantized planes, to fp32-accumulation level (the GEMM
    sums exact fp32 products; only the order of the sum differs from float64). Every GEMM
    implementation of a backend without its own GEMM; the backend's own GEMM otherwise."""
    shape, dtype = CASES[1]  # the shape quantized above: no new compilation
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((2, *shape)) * np.exp2(rng.integers(-8, 8, (2, shape[0], 1))))
    qa, qb = (mxfp8.quantize(jnp.asarray(v.astype(dtype)), kernels=kernels) for v in (a, b))
    deq = [oracle.dequantize(u8(t.rowwise_data), np.repeat(u8(t.rowwise_scale), 32, axis=1))
           for t in (qa, qb)]
    want = deq[0].astype(np.float64) @ deq[1].astype(np.float64).T
    if kernels.gemm is None:
        configs = [kernels]
    else:
        configs = [KernelConfig(kernels.backend, g)
                   for g in (GemmImpl.DEQUANT_DOT, GemmImpl.DEQUANT_BF16_DOT)]
    for config in configs:
        got = np.asarray(mxfp8.matmul(qa, qb, GemmRole.FORWARD, kernels=config), np.float64)
        assert got.shape == (shape[0], shape[0])
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-5, (config, rel)


def test_availability_says_where_the_backend_runs(kernels):
    impl = backend_impl(kernels.backend)
    for platform in Platform:
        found = impl.availability(site_for(platform))
        assert isinstance(found.reason, str) and found.reason
        if impl.capabilities.execution(platform) is None:
            assert found.fit is Fit.UNUSABLE and found.fix
    # it just resolved for work here, so it must say it runs here
    here = default_platform()
    assert impl.availability(site_for(here)).fit is not Fit.UNUSABLE
    assert impl.capabilities.execution(here) is not None
    if kernels.backend is Backend.PALLAS:
        from jax_side.mxfp8.pallas_backend import interpret_mode

        interpreted = impl.capabilities.execution(here) is Execution.INTERPRETED
        assert interpret_mode() is interpreted


def test_te_refuses_what_it_lacks_even_where_te_is_not_installed():
    """The refusals need no TE: they are raised before any TE call (so this runs on CPU CI)."""
    te = backend_impl(Backend.TE)
    assert not te.capabilities.slices and te.capabilities.own_gemm
    flat = jnp.zeros((64,), jnp.float32)
    _assert_slices_refused(te, (32, 32), (0, flat))
    with pytest.raises(UnsupportedOperation, match="'te' has no GEMM implementation "
                                                   "'dequant_dot' .*runs its own GEMM"):
        te.matmul(None, None, GemmRole.FORWARD, GemmImpl.DEQUANT_DOT)
    assert te.availability(site_for(Platform.CPU)).fit is Fit.UNUSABLE
    with pytest.raises(BackendUnavailable, match="'te' was requested for work on cpu.*'xla'"):
        mxfp8.resolve_kernels(KernelConfig("te"), "cpu")
