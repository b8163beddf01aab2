"""Every kernel backend available here, through its declared interface
(``jax_side.mxfp8.backend_api.KernelBackend``), against the numpy oracle (``tests/oracle``).

Parametrized over ``common.kernels.Backend``: ``xla`` and ``pallas`` (interpret mode on a CPU)
always, ``te`` where TE-JAX is importable (GPU machines with the ``[te]`` extra; skipped
elsewhere). Each operation a backend has must give the oracle's bytes on every shape and input
here (NaN, +-Inf, +-0 and subnormals included); each capability it lacks must raise
``UnsupportedOperation`` naming the backend and the operation; and ``Capabilities`` must agree
with where the backend runs.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from common.formats import ALL_PLANES, Plane
from common.gemm_roles import GemmRole
from common.kernels import Backend, GemmImpl, Platform
from jax_side.mxfp8 import te_probe
from jax_side.mxfp8.backend_api import (
    Capabilities,
    Execution,
    KernelBackend,
    UnsupportedOperation,
    default_platform,
)
from jax_side.mxfp8.backends import backend_impl
from tests.jax_side.mxfp8.corner_cases import special_mix
from tests.oracle import mxfp8_ref as oracle

FIELDS = ("rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale")
F32, BF16 = np.float32, ml_dtypes.bfloat16
# (shape, dtype): one row of blocks, several blocks of each kind with M != K. Few: every new
# shape compiles every kernel again (Pallas in interpret mode is slow); test_pallas.py and
# test_quantize.py cover many more shapes backend by backend.
CASES = [((32, 64), F32), ((64, 96), BF16)]


def _param(backend: Backend):
    if backend is Backend.TE and not te_probe.probe().importable:
        why = f"TE-JAX not importable here: {te_probe.probe().detail}"
        return pytest.param(backend, id=backend.value, marks=pytest.mark.skip(reason=why))
    return pytest.param(backend, id=backend.value)


@pytest.fixture(params=[_param(b) for b in Backend])
def impl(request) -> KernelBackend:
    return backend_impl(request.param)


def u8(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _case_id(case) -> str:
    (m, k), dtype = case
    return f"{m}x{k}-{np.dtype(dtype).name}"


def test_every_backend_implements_the_declared_interface(impl):
    assert isinstance(impl, KernelBackend)
    assert isinstance(impl.capabilities, Capabilities)
    assert backend_impl(impl.backend.value) is impl  # one object per backend, by enum or name
    runs_on = dict(impl.capabilities.runs_on)
    assert runs_on and all(isinstance(p, Platform) for p in runs_on)
    assert all(isinstance(e, Execution) for e in runs_on.values())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_quantize_is_the_oracle_byte_for_byte(impl, case):
    shape, dtype = case
    x = special_mix(shape, dtype, seed=shape[0] + shape[1])
    want = oracle.quantize(x)
    got = impl.quantize(jnp.asarray(x), planes=ALL_PLANES)
    for field in FIELDS:
        np.testing.assert_array_equal(u8(getattr(got, field)), want[field], err_msg=field)
    if case == CASES[0]:
        row_only = impl.quantize(jnp.asarray(x), planes=(Plane.ROWWISE,))
        assert row_only.colwise_data is None and row_only.colwise_scale is None
        np.testing.assert_array_equal(u8(row_only.rowwise_data), want["rowwise_data"])


def _slices_of(x: np.ndarray, cuts: list[int]):
    flat = x.reshape(-1)
    bounds = [0, *cuts, flat.size]
    return [(s, jnp.asarray(flat[s:e])) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]


def test_slice_operations_rebuild_the_oracle_bytes(impl):
    """Partial amax per slice, MAX-merge, scales, cast per slice: the distributed recipe
    (DESIGN.md 5) in one process, cut mid-block and mid-row inside a 32-row band (one cut: every
    slice length compiles its own programs)."""
    shape, dtype = CASES[1]
    m, k = shape
    x = special_mix(shape, dtype, seed=7)
    parts = _slices_of(x, [k * 40 + 5])  # row 40, column 5: inside the second band
    if not impl.capabilities.slices:
        _assert_slices_refused(impl, shape, parts[0])
        return
    want = oracle.quantize(x)
    amax = [impl.partial_block_amax(p, shape, s, ALL_PLANES) for s, p in parts]
    rs = impl.scales_from_amax(jnp.max(jnp.stack([a.rowwise for a in amax]), axis=0))
    cs = impl.scales_from_amax(jnp.max(jnp.stack([a.colwise for a in amax]), axis=0))
    np.testing.assert_array_equal(u8(rs), want["rowwise_scale"])
    np.testing.assert_array_equal(u8(cs), want["colwise_scale"])
    casts = [impl.cast_slice(p, shape, s, u8(rs), u8(cs)) for s, p in parts]
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
        with pytest.raises(UnsupportedOperation, match=f"{impl.backend.value!r} has no {name}"):
            call()


def test_scales_from_amax_at_every_threshold_is_the_oracle(impl):
    if not impl.capabilities.slices:
        pytest.skip("no slice operations (checked to raise above)")
    rng = np.random.default_rng(1)
    amax = np.concatenate([
        np.abs(rng.standard_normal(256)).astype(np.float32) * np.exp2(rng.integers(-140, 127, 256)),
        np.array([0.0, 448.0, 464.0, np.inf, 2.0**-149, np.finfo(np.float32).max], np.float32),
    ]).astype(np.float32)
    got = impl.scales_from_amax(jnp.asarray(amax))
    np.testing.assert_array_equal(u8(got), oracle.scale_bytes(amax))


def test_matmul_is_the_product_of_the_oracle_dequantized_operands(impl):
    """Forward role: y = a @ b.T on the dequantized planes, to fp32-accumulation level (the GEMM
    sums exact fp32 products; only the order of the sum differs from float64)."""
    shape, dtype = CASES[1]  # the shape quantized above: no new compilation
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((2, *shape)) * np.exp2(rng.integers(-8, 8, (2, shape[0], 1))))
    qa, qb = (impl.quantize(jnp.asarray(v.astype(dtype)), planes=ALL_PLANES)
              for v in (a, b))
    deq = [oracle.dequantize(u8(t.rowwise_data), np.repeat(u8(t.rowwise_scale), 32, axis=1))
           for t in (qa, qb)]
    want = deq[0].astype(np.float64) @ deq[1].astype(np.float64).T
    if impl.capabilities.own_gemm:
        with pytest.raises(UnsupportedOperation, match="runs its own GEMM"):
            impl.matmul(qa, qb, GemmRole.FORWARD, GemmImpl.DEQUANT_DOT)
        gemms = [None]
    else:
        gemms = [GemmImpl.DEQUANT_DOT, GemmImpl.DEQUANT_BF16_DOT]
    for gemm in gemms:
        got = np.asarray(impl.matmul(qa, qb, GemmRole.FORWARD, gemm), np.float64)
        assert got.shape == (shape[0], shape[0])
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-5, (gemm, rel)


def test_capabilities_say_where_the_backend_runs(impl):
    here = default_platform()
    for platform in Platform:
        execution = impl.capabilities.execution(platform)
        if execution is None:
            with pytest.raises(UnsupportedOperation, match=f"does not run on {platform.value}"):
                impl.check_platform(platform)
        else:
            assert impl.check_platform(platform) is execution
    # the backend just ran on this platform in the tests above, so it must claim to
    assert impl.capabilities.execution(here) is not None
    if impl.backend is Backend.PALLAS:
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
    with pytest.raises(UnsupportedOperation, match="'te' does not run on cpu.*backend='xla'"):
        te.check_platform(Platform.CPU)
