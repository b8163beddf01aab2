"""The ``te`` backend (``jax_side.mxfp8.te_backend``) against the ``xla`` backend, byte for byte.

- CPU (always): the adapter's own logic that needs no TE -- which blocks are "edge blocks", and
  that splicing takes exactly those from the reference.
- GPU with TE-JAX installed (``@pytest.mark.gpu``; skipped elsewhere): quantize, dequantize and
  the three GEMM roles compared with ``xla`` on random and corner inputs, and the raw divergences
  of TE's pure-JAX quantizer from DESIGN.md 3 pinned (``ContractFix.NONE``). The recorded run is
  in docs/te_backend.md; ``scripts/gpu/te.sh`` repeats it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_side import mxfp8
from jax_side.mxfp8 import GemmImpl, GemmRole, MXFP8Tensor, Plane, te_backend
from jax_side.mxfp8.backend_api import site_for
from jax_side.mxfp8.backends import Backend, decide_backend
from jax_side.mxfp8.te_backend import ContractFix
from jax_side.mxfp8.te_probe import TEPath

# Warnings that TE-JAX's own modules raise while tracing are TE's business, not this contract's.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:transformer_engine"),
    pytest.mark.filterwarnings("ignore::FutureWarning:transformer_engine"),
    pytest.mark.filterwarnings("ignore::UserWarning:transformer_engine"),
]

BF16 = jnp.bfloat16
F32 = jnp.float32
NAN, INF = float("nan"), float("inf")

# One block of 32 values per case (listed values first, zeros after). EDGE cases are where TE's
# pure-JAX quantizer can leave the contract; FINITE cases must match without any fix.
EDGE_BLOCKS = {
    "nan": (NAN, 2.0, 1.0, -NAN),
    "inf": (INF, -INF, 1.0, 2.0**127),
    "neg_inf_only": (-INF,),
    "all_zero": (0.0,),
    "neg_zero": (-0.0, -0.0),
    "fp32_min_subnormal": (2.0**-149, -(2.0**-149)),
    "tiny_normal": (2.0**-110, -(3 * 2.0**-112)),
    "s_subnormal_edge": (1.75 * 2.0**-119,),
}
FINITE_BLOCKS = {
    "amax_448": (448.0, 1.0),
    "amax_464": (464.0, 1.0),
    "amax_896": (896.0, -896.0),
    "rne_ties": (448.0, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, -0.0, -17.0),
    "amax_0p875": (0.875, 0.5),
    "fp32_max": (float(np.finfo(np.float32).max), 1.0),
    "edge_amax_exactly": (2.0**-100, 2.0**-110),
    "wide_range": (2.0**60, 2.0**40, 2.0**20, 1.0, 2.0**-20),
}


def _blocks_matrix(cases: dict[str, tuple[float, ...]], *, column: bool) -> np.ndarray:
    """fp32 (32, 32 * n): case i fills block i -- row 0 of it (rowwise) or column 0 (colwise)."""
    out = np.zeros((32, 32 * len(cases)), np.float32)
    for i, values in enumerate(cases.values()):
        block = np.zeros(32, np.float32)
        block[: len(values)] = values
        if column:
            out[:, 32 * i] = block
        else:
            out[0, 32 * i : 32 * i + 32] = block
    return out


def _random(shape, dtype, seed, *, wide: bool = False) -> jax.Array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if wide:  # every block a different binade, 2**-90 .. 2**90
        m, k = shape
        exps = rng.integers(-90, 91, size=(m // 32, 1, k // 32, 1))
        x = (x.reshape(m // 32, 32, k // 32, 32) * np.exp2(exps)).reshape(shape)
    return jnp.asarray(x.astype(ml_dtypes.bfloat16) if dtype == BF16 else x)


def _bytes(a) -> np.ndarray:
    return None if a is None else np.asarray(a).view(np.uint8)


def _fields(t: MXFP8Tensor) -> dict[str, np.ndarray]:
    return {name: _bytes(getattr(t, name)) for name in
            ("rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale")}


def _assert_same_bytes(got: MXFP8Tensor, want: MXFP8Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    for name, g in _fields(got).items():
        w = _fields(want)[name]
        assert (g is None) == (w is None), name
        if g is not None:
            bad = np.argwhere(g != w)
            assert bad.size == 0, f"{name}: {len(bad)} bytes differ, first at {bad[:4].tolist()}"


# ---------------------------------------------------------------- CPU: adapter logic


@pytest.mark.parametrize("column", [False, True], ids=["rowwise", "colwise"])
def test_edge_blocks_are_exactly_the_nonfinite_and_tiny_blocks(column):
    cases = {**EDGE_BLOCKS, **FINITE_BLOCKS}
    x = jnp.asarray(_blocks_matrix(cases, column=column))
    edge = te_backend.edge_blocks(x, rowwise=True, colwise=True)
    mask = edge.colwise[0] if column else edge.rowwise[0]  # colwise (1, 32n): one per column
    per_case = mask[:: 32] if column else mask
    assert dict(zip(cases, np.asarray(per_case).tolist(), strict=True)) == {
        **{name: True for name in EDGE_BLOCKS}, **{name: False for name in FINITE_BLOCKS}}


def test_splice_takes_exactly_the_edge_blocks_from_the_reference():
    x = jnp.asarray(_blocks_matrix({**EDGE_BLOCKS, **FINITE_BLOCKS}, column=False))
    ref = mxfp8.quantize(x, backend="xla")
    zeros = MXFP8Tensor(  # all-zero bytes (e8m0 has no 0.0, so build them as uint8)
        {p: tuple(jax.lax.bitcast_convert_type(jnp.zeros(a.shape, jnp.uint8), a.dtype)
                  for a in pair) for p, pair in ref.planes.items()},
        ref.shape, ref.dtype)
    edge = te_backend.edge_blocks(x, rowwise=True, colwise=True)
    out = te_backend._splice(zeros, ref, edge)
    row_mask = np.repeat(np.asarray(edge.rowwise), 32, axis=1)
    np.testing.assert_array_equal(_bytes(out.rowwise_data),
                                  np.where(row_mask, _bytes(ref.rowwise_data), 0))
    np.testing.assert_array_equal(_bytes(out.rowwise_scale),
                                  np.where(edge.rowwise, _bytes(ref.rowwise_scale), 0))
    col_mask = np.repeat(np.asarray(edge.colwise), 32, axis=0)
    np.testing.assert_array_equal(_bytes(out.colwise_data),
                                  np.where(col_mask, _bytes(ref.colwise_data), 0))


def test_pure_jax_path_defaults_to_the_contract_fix():
    assert te_backend._DEFAULT_FIX[TEPath.PURE_JAX] is ContractFix.SPLICE_EDGE_BLOCKS
    assert te_backend._DEFAULT_FIX[TEPath.KERNELS] is ContractFix.NONE


# ---------------------------------------------------------------- GPU: parity with xla


@pytest.fixture(scope="module")
def te_path():
    probe = te_backend.probe()
    if not probe.importable:
        pytest.skip(f"TE-JAX not importable here: {probe.detail}")
    return te_backend.te_path()


@pytest.mark.gpu
def test_probe_and_dispatch_on_this_gpu(te_path):
    probe = te_backend.probe()
    choice = decide_backend(Backend.TE, site_for(mxfp8.Platform.GPU))
    assert choice.path is te_path
    kernels = probe.mxfp8_supported and probe.compute_capability // 10 == 10
    assert te_path is (TEPath.KERNELS if kernels else TEPath.PURE_JAX)
    auto = mxfp8.resolve_kernels(None, "gpu")
    assert auto.backend is (Backend.TE if kernels else Backend.PALLAS), auto.reason
    assert auto.path is (TEPath.KERNELS if kernels else None)


SHAPES = [(BF16, (256, 512)), (F32, (128, 96)), (BF16, (4096, 1024))]


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [False, True], ids=["normal", "wide_range"])
@pytest.mark.parametrize("dtype, shape", SHAPES, ids=lambda v: str(v))
def test_quantize_random_matches_xla_bitwise(te_path, dtype, shape, wide):
    x = _random(shape, dtype, seed=shape[0] + wide, wide=wide)
    _assert_same_bytes(mxfp8.quantize(x, backend="te"), mxfp8.quantize(x, backend="xla"))


@pytest.mark.gpu
@pytest.mark.parametrize("rowwise, colwise", [(True, False), (False, True)], ids=["row", "col"])
def test_quantize_single_plane_matches_xla_bitwise(te_path, rowwise, colwise):
    x = _random((256, 256), BF16, seed=3)
    planes = [p for p, on in ((Plane.ROWWISE, rowwise), (Plane.COLWISE, colwise)) if on]
    te = mxfp8.quantize(x, planes=planes, backend="te")
    _assert_same_bytes(te, mxfp8.quantize(x, planes=planes, backend="xla"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("column", [False, True], ids=["rowwise_blocks", "colwise_blocks"])
def test_quantize_corner_blocks_match_xla_bitwise(te_path, dtype, column):
    x = jnp.asarray(_blocks_matrix({**EDGE_BLOCKS, **FINITE_BLOCKS}, column=column)).astype(dtype)
    _assert_same_bytes(mxfp8.quantize(x, backend="te"), mxfp8.quantize(x, backend="xla"))


@pytest.mark.gpu
def test_quantize_under_jit_matches_eager(te_path):
    x = _random((128, 256), BF16, seed=5).at[0, 0].set(jnp.nan)
    jitted = jax.jit(lambda v: mxfp8.quantize(v, backend="te"))(x)
    _assert_same_bytes(jitted, mxfp8.quantize(x, backend="xla"))


# ---------------------------------------------------------------- GPU: TE's raw bytes pinned


def _raw_and_ref(cases, dtype, column):
    x = jnp.asarray(_blocks_matrix(cases, column=column)).astype(dtype)
    raw = te_backend.quantize(x, rowwise=True, colwise=True, fix=ContractFix.NONE)
    return x, raw, mxfp8.quantize(x, backend="xla")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_raw_te_differs_from_the_contract_only_on_edge_blocks(te_path, dtype):
    if te_path is not TEPath.PURE_JAX:
        pytest.skip("the raw divergences are those of TE's pure-JAX quantizer")
    cases = {**EDGE_BLOCKS, **FINITE_BLOCKS}
    x, raw, ref = _raw_and_ref(cases, dtype, column=False)
    block_differs = np.any(
        (_bytes(raw.rowwise_data) != _bytes(ref.rowwise_data)).reshape(32, -1, 32), axis=(0, 2)
    ) | np.any(_bytes(raw.rowwise_scale) != _bytes(ref.rowwise_scale), axis=0)
    # Classified on x as quantized: in bf16, "fp32_max" rounds to +Inf and becomes an Inf block.
    edge = np.asarray(te_backend.edge_blocks(x, rowwise=True, colwise=False).rowwise[0])
    nonfinite = ~np.isfinite(np.asarray(x, np.float32)[0].reshape(-1, 32)).all(axis=1)
    names = list(cases)
    assert not np.any(block_differs & ~edge), [n for n, d in zip(names, block_differs & ~edge,
                                                                  strict=True) if d]
    assert np.all(block_differs[nonfinite]), [n for n, d in zip(names, nonfinite, strict=True)
                                              if d]


NAN_BYTE = None  # any e4m3 NaN, either sign
# What TE 2.20.2's pure-JAX quantizer gives for a non-finite block on the H200 (recorded run in
# docs/te_backend.md): (scale byte, first four element bytes), against the contract's scale.
# NaN block: the NaN amax has exponent 0xFF, which TE's RCEIL step rounds up to 0x100 and its
# uint8 cast wraps to 0x00, so the scale is 2**-127 and every finite nonzero element saturates to
# +-448. Inf block: scale 0xFF, which TE's division uses as +Inf (0xFF << 23): +-Inf / Inf is NaN,
# finite / Inf is 0.
RAW_NONFINITE = {
    "nan": (0x00, (NAN_BYTE, 0x7E, 0x7E, NAN_BYTE), 0x78),  # values (NaN, 2, 1, -NaN)
    "inf": (0xFF, (NAN_BYTE, NAN_BYTE, 0x00, 0x00), 0xFE),  # values (Inf, -Inf, 1, 2**127)
    "neg_inf_only": (0xFF, (NAN_BYTE, 0x00, 0x00, 0x00), 0xFE),  # values (-Inf,)
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(RAW_NONFINITE))
def test_raw_te_bytes_of_a_nonfinite_block_are_pinned(te_path, name):
    """DESIGN.md 3 'known divergence', with TE's exact bytes (fixed by ContractFix)."""
    if te_path is not TEPath.PURE_JAX:
        pytest.skip("the raw divergences are those of TE's pure-JAX quantizer")
    scale, first4, contract_scale = RAW_NONFINITE[name]
    _, raw, ref = _raw_and_ref({name: EDGE_BLOCKS[name]}, F32, column=False)
    row = _bytes(raw.rowwise_data)[0]
    assert _bytes(raw.rowwise_scale)[0, 0] == scale
    for got, want in zip(row[:4].tolist(), first4, strict=True):
        assert (got & 0x7F == 0x7F) if want is NAN_BYTE else got == want, row[:4]
    assert not np.any(row[4:]) and not np.any(_bytes(raw.rowwise_data)[1:])
    assert _bytes(ref.rowwise_scale)[0, 0] == contract_scale


# ---------------------------------------------------------------- GPU: dequantize and GEMM


@pytest.mark.gpu
@pytest.mark.parametrize("plane", [Plane.ROWWISE, Plane.COLWISE], ids=lambda p: p.value)
def test_te_dequantize_matches_xla_on_random_data(te_path, plane):
    t = mxfp8.quantize(_random((256, 512), BF16, seed=7, wide=True), backend="xla")
    got = np.asarray(te_backend.dequantize(t, plane)).view(np.uint32)
    np.testing.assert_array_equal(got, np.asarray(mxfp8.dequantize(t, plane)).view(np.uint32))


ROLE_SHAPES = {  # (a logical shape, b logical shape) for (M, N, K) = (256, 384, 512)
    GemmRole.FORWARD: ((256, 512), (384, 512)),
    GemmRole.DGRAD: ((256, 384), (384, 512)),
    GemmRole.WGRAD: ((256, 384), (256, 512)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("role", list(GemmRole), ids=lambda r: r.value)
def test_te_gemm_matches_xla_scaled_matmul_bitwise_and_dequant_dot_closely(te_path, role):
    a_shape, b_shape = ROLE_SHAPES[role]
    a = mxfp8.quantize(_random(a_shape, BF16, seed=11), backend="xla")
    b = mxfp8.quantize(_random(b_shape, BF16, seed=12), backend="xla")
    te = np.asarray(mxfp8.matmul(a, b, role, backend="te"))
    exact = np.asarray(mxfp8.matmul(a, b, role, impl=GemmImpl.DEQUANT_DOT, backend="xla"))
    rel = np.linalg.norm(te - exact) / np.linalg.norm(exact)
    assert rel < 1e-5, rel
    if te_path is TEPath.PURE_JAX:  # TE's pure-JAX GEMM is jax.nn.scaled_matmul on our bytes
        scaled = np.asarray(mxfp8.matmul(a, b, role, impl=GemmImpl.SCALED_MATMUL, backend="xla"))
        np.testing.assert_array_equal(te.view(np.uint32), scaled.view(np.uint32))


@pytest.mark.gpu
def test_gemm_leaves_te_custom_call_state_as_it_was(te_path):
    import importlib

    prim = importlib.import_module("transformer_engine.jax.cpp_extensions.gemm").GemmPrimitive
    before = (prim.enabled(), "_is_enabled" in prim.__dict__)
    a = mxfp8.quantize(_random((128, 256), BF16, seed=13), backend="xla")
    mxfp8.matmul(a, a, GemmRole.FORWARD, backend="te").block_until_ready()
    assert (prim.enabled(), "_is_enabled" in prim.__dict__) == before
