"""``jax_side.block_scaled``: weight planes of block formats other than MXFP8, read by the
reference numerics, against the numpy oracle; ``FlatPlane`` routes by its ``blocks``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from common.formats import MXFP8_BLOCKS, Plane, ScaleBlocks
from common.gemm_roles import GemmRole
from common.kernels import GemmImpl, KernelConfig
from jax_side import block_scaled
from jax_side.linear import FlatPlane, backward, forward, quantize_activation
from jax_side.mxfp8 import dequantize
from tests.oracle import mxfp8_ref as ref

B16 = ScaleBlocks("float8_e4m3fn", "float8_e8m0fnu", 16, 448.0)
REFERENCE = KernelConfig.reference()


def _weight(seed: int, shape=(64, 96)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-8, 8, (shape[0], 1)))
    return w.astype(jnp.bfloat16).astype(np.float32)


def _flat(q: dict, plane: Plane, blocks: ScaleBlocks, shape) -> FlatPlane:
    """A plane of the oracle's bytes inside flat buffers, at offsets, as FSDP hands them."""
    data = np.concatenate([np.zeros(256, np.uint8), q[f"{plane.value}_data"].reshape(-1)])
    scale = np.concatenate([np.zeros(512, np.uint8), q[f"{plane.value}_scale"].reshape(-1)])
    return FlatPlane(jnp.asarray(data), jnp.asarray(scale), 256, 512, shape, plane, blocks)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("plane", [Plane.ROWWISE, Plane.COLWISE])
def test_dequantize_plane_is_the_oracles_for_any_block_size(block, plane):
    w = _weight(block)
    q = ref.quantize(w, block=block)
    blocks = B16 if block == 16 else MXFP8_BLOCKS
    got = block_scaled.dequantize_plane(jnp.asarray(q[f"{plane.value}_data"]),
                                        jnp.asarray(q[f"{plane.value}_scale"]), plane, blocks)
    axis = 1 if plane is Plane.ROWWISE else 0
    want = ref.dequantize(q[f"{plane.value}_data"],
                          np.repeat(q[f"{plane.value}_scale"], block, axis=axis))
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(
        np.asarray(_flat(q, plane, blocks, w.shape).dequantized()), want)


def test_a_flat_plane_says_which_numerics_read_it():
    q = ref.quantize(_weight(1), block=16)
    plane = _flat(q, Plane.ROWWISE, B16, (64, 96))
    assert not plane.is_mxfp8
    with pytest.raises(ValueError, match="not an MXFP8 plane"):
        plane.tensor()
    assert _flat(ref.quantize(_weight(1)), Plane.ROWWISE, MXFP8_BLOCKS, (64, 96)).is_mxfp8


def test_forward_and_dgrad_on_a_block16_weight_are_the_reference_gemm():
    """y = x W^T and dx = dy W with x, dy MXFP8 and W in 16-element blocks: the fp32 dot of the
    dequantized operands, exactly."""
    w = _weight(2)
    q = ref.quantize(w, block=16)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((32, 96)).astype(np.float32))
    dy = jnp.asarray(rng.standard_normal((32, 64)).astype(np.float32))
    row, col = (_flat(q, p, B16, w.shape) for p in (Plane.ROWWISE, Plane.COLWISE))
    y = forward(x, row, out_dtype=jnp.float32, keep_x_colwise=False, kernels=REFERENCE).y
    xq, dyq = quantize_activation(x, kernels=REFERENCE), quantize_activation(dy, kernels=REFERENCE)
    w_row = ref.dequantize(q["rowwise_data"], np.repeat(q["rowwise_scale"], 16, axis=1))
    want = np.asarray(dequantize(xq, Plane.ROWWISE)).astype(np.float64) @ w_row.T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-6)
    dx = backward(dy, col, None, dx_dtype=jnp.float32, dw_dtype=jnp.float32,
                  kernels=REFERENCE).dx
    np.testing.assert_array_equal(
        np.asarray(dx), np.asarray(block_scaled.matmul(dyq, col.dequantized(), GemmRole.DGRAD,
                                                       GemmImpl.DEQUANT_DOT)))
