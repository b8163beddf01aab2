"""The weights' re-block into the ``fp8_blocked`` GEMM's 128x128 tiles as one Pallas kernel
(``pallas_reblock``, issue 33): the bytes of ``reblock.reblock_tiles`` (after ``pad_to``) for
both planes -- the rowwise plane as it is, the colwise plane transposed -- on arbitrary codes
(NaN codes of both signs, zeros, every byte) and scale bytes (0, 0xFF, blocks up to 60 binades
below their tile's largest), shapes that need padding, planes read in place from flat buffers
at any offset (the kernel's operands are the whole buffers: no slice is copied out);
interpreted here, compiled on the GPU; and the layer's weights re-blocked by it when the
backend is ``pallas``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from common.formats import Plane, round_up
from common.kernels import KernelConfig
from jax_side import mxfp8
from jax_side.linear import FlatPlane
from jax_side.mxfp8 import blocked_operands as blocked
from jax_side.mxfp8 import reblock
from jax_side.mxfp8.kernels import resolve_kernels
from jax_side.mxfp8.pallas_reblock import reblock_tiles_2d, reblock_tiles_flat
from tests.jax_side.mxfp8.pallas_calls import pallas_operand_shapes


def _plane(n, k, colwise, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    shape = (n // 32, k) if colwise else (n, k // 32)
    scale = rng.integers(110, 135, shape, dtype=np.uint8)
    scale[0, 0] = 0xFF  # a NaN block: its tile's scale becomes NaN, the others shift to zero
    scale[-1, -1] = 0
    scale.flat[5::7] = rng.integers(70, 135, scale.flat[5::7].shape, dtype=np.uint8)
    codes[:4, :] = 0
    return (lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn),
            jnp.asarray(scale))


def _want(data, scale, colwise):
    d, s = (data.T, scale.T) if colwise else (data, scale)
    r, k = d.shape
    return reblock.reblock_tiles(*reblock.pad_to(d, s, round_up(r, 128), round_up(k, 128)))


def _u8(a):
    return np.asarray(lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.uint8 else a)


def _check(got, want, what):
    assert got.data.dtype == jnp.float8_e4m3fn and got.scale.dtype == jnp.uint8, what
    assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape, what
    np.testing.assert_array_equal(_u8(got.data), _u8(want.data), err_msg=f"{what} data")
    np.testing.assert_array_equal(_u8(got.scale), _u8(want.scale), err_msg=f"{what} scale")


SHAPES = [(256, 384), (160, 96), (384, 128)]


@pytest.mark.parametrize("colwise", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernel_writes_the_bytes_of_reblock_tiles(shape, colwise):
    data, scale = _plane(*shape, colwise, seed=sum(shape))
    got = reblock_tiles_2d(data, scale, colwise=colwise, interpret=True)
    _check(got, _want(data, scale, colwise), f"{shape} colwise={colwise}")
    assert got.scale[0, 0] == 0xFF


def _buffers(data, scale, data_at, scale_at):
    """The plane's codes and scale bytes inside longer flat buffers, at the given offsets."""
    d = jnp.concatenate([jnp.full((data_at,), 0x7F, jnp.uint8), _u8(data).reshape(-1),
                         jnp.full((77,), 0xFF, jnp.uint8)])
    s = jnp.concatenate([jnp.full((scale_at,), 0xFF, jnp.uint8), scale.reshape(-1),
                         jnp.full((5,), 0xFF, jnp.uint8)])
    return d, s


@pytest.mark.parametrize("colwise", [False, True], ids=["rowwise", "colwise"])
def test_a_plane_in_flat_buffers_is_read_where_it_lies(colwise):
    """``reblock_tiles_flat`` on a plane at odd offsets of longer buffers (neighbours full of NaN
    codes and 0xFF scales, which must not leak in) gives ``reblock_tiles``' bytes, and its
    kernel's operands are the whole buffers: no slice of the plane is copied out first."""
    data, scale = _plane(256, 384, colwise, seed=11)
    d, s = _buffers(data, scale, 1001, 37)
    got = reblock_tiles_flat(d, s, 1001, 37, (256, 384), colwise=colwise, interpret=True)
    _check(got, _want(data, scale, colwise), f"colwise={colwise}")
    calls = pallas_operand_shapes(lambda d, s: reblock_tiles_flat(
        d, s, 1001, 37, (256, 384), colwise=colwise, interpret=True), d, s)
    assert calls == [[d.shape, s.shape]]


def test_it_takes_uint8_codes_and_refuses_what_is_not_a_plane():
    data, scale = _plane(128, 256, False, seed=1)
    got = reblock_tiles_2d(_u8(data), scale, colwise=False, interpret=True)
    _check(got, _want(data, scale, False), "uint8 codes")
    d, s = _buffers(data, scale, 64, 8)
    with pytest.raises(ValueError, match="runs past its buffers"):
        reblock_tiles_flat(d, s, 64, 8 + 100, (128, 256), colwise=False)
    with pytest.raises(ValueError, match="multiples of 128"):
        reblock_tiles_flat(d, s, 64, 8, (96, 256), colwise=False)
    with pytest.raises(ValueError, match=r"scale bytes \(uint8 or e8m0\) of shape \(4, 256\)"):
        reblock_tiles_2d(data, scale, colwise=True, interpret=True)
    with pytest.raises(ValueError, match="multiples of 32"):
        reblock_tiles_2d(data[:100], scale[:100], colwise=False, interpret=True)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        reblock_tiles_2d(data.astype(jnp.float32), scale, colwise=False, interpret=True)


def test_the_pallas_backend_reblocks_the_weights_with_it(monkeypatch):
    """``blocked_operands.weight_tiles`` on the ``pallas`` backend calls the kernel (forward:
    rowwise, dgrad: colwise) -- in place for a ``FlatPlane`` whose dims are multiples of 128,
    on the sliced and padded plane otherwise -- and gives ``b_tiles``' bytes; other backends
    keep XLA's re-block."""
    calls = []
    for name in ("reblock_tiles_2d", "reblock_tiles_flat"):
        real = getattr(blocked, name)
        monkeypatch.setattr(blocked, name, lambda *a, real=real, name=name, **k:
                            calls.append((name[14:], k["colwise"])) or real(*a, **k))
    pallas = resolve_kernels(KernelConfig(backend="pallas", gemm="fp8_blocked"))
    xla = resolve_kernels(KernelConfig(backend="xla", gemm="fp8_blocked"))
    for shape in ((256, 384), (160, 96)):
        w = mxfp8.quantize(jax.random.normal(jax.random.key(2), shape, jnp.float32) * 0.02,
                           backend="xla")
        for role, plane in ((mxfp8.GemmRole.FORWARD, Plane.ROWWISE),
                            (mxfp8.GemmRole.DGRAD, Plane.COLWISE)):
            want = blocked.weight_tiles(w, role, xla)
            _check(blocked.weight_tiles(w, role, pallas), want, f"{role.value} {shape}")
            flat = _flat_plane(w, plane)
            _check(blocked.weight_tiles(flat, role, pallas), want, f"{role.value} {shape} flat")
            _check(blocked.weight_tiles(flat, role, xla), want, f"{role.value} {shape} xla")
    assert calls == [("2d", False), ("flat", False), ("2d", True), ("flat", True),
                     ("2d", False), ("2d", False), ("2d", True), ("2d", True)]
    with pytest.raises(ValueError, match="the weight's rowwise plane was given; dgrad reads"):
        blocked.weight_tiles(_flat_plane(w, Plane.ROWWISE), mxfp8.GemmRole.DGRAD, pallas)


def _flat_plane(w, plane):
    data, scale = w.plane(plane)
    d, s = _buffers(data, _u8(scale), 512, 16)
    return FlatPlane(d, s, 512, 16, w.shape, plane)


@pytest.mark.gpu
@pytest.mark.parametrize("colwise", [False, True], ids=["rowwise", "colwise"])
def test_the_compiled_kernel_writes_the_bytes_of_reblock_tiles(colwise):
    for shape in (*SHAPES, (2048, 1024)):
        data, scale = _plane(*shape, colwise, seed=sum(shape) + 7)
        for warps in (2, 4, 8):
            _check(reblock_tiles_2d(data, scale, colwise=colwise, num_warps=warps),
                   _want(data, scale, colwise), f"{shape} colwise={colwise} warps={warps}")
        if shape[0] % 128 == 0 and shape[1] % 128 == 0:
            d, s = _buffers(data, scale, 4096 + 16, 48)
            _check(reblock_tiles_flat(d, s, 4096 + 16, 48, shape, colwise=colwise),
                   _want(data, scale, colwise), f"{shape} colwise={colwise} in place")
