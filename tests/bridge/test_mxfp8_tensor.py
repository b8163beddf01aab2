"""TorchMXFP8Tensor and the zero-copy transfer of whole MXFP8 tensors in both directions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge import (
    MXFP8WeightPlanes,
    TorchMXFP8Tensor,
    ZeroCopyError,
    to_jax_mxfp8,
    to_torch_mxfp8,
)
from jax_side.mxfp8 import MXFP8Tensor, Plane, dequantize, quantize
from tests.bridge.conftest import DEVICES, jax_bytes, torch_bytes

M, K = 64, 96
FIELDS = ("rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale")


def _quantized(device="cpu") -> MXFP8Tensor:
    x = jax.random.normal(jax.random.key(0), (M, K), jnp.float32) * 5
    x = jax.device_put(x.astype(jnp.bfloat16), jax.devices("cpu" if device == "cpu" else "gpu")[0])
    return quantize(x)


def _fsdp_style_uint8(q: MXFP8Tensor, device="cpu") -> TorchMXFP8Tensor:
    """All four planes as uint8 views into one buffer, each at a 256-byte aligned offset."""
    planes = [np.asarray(getattr(q, f)).view(np.uint8) for f in FIELDS]
    offsets, at = [], 0
    for p in planes:
        offsets.append(at)
        at += -(-p.size // 256) * 256
    buf = torch.zeros(at, dtype=torch.uint8, device=device)
    views = []
    for p, off in zip(planes, offsets, strict=True):
        v = buf[off : off + p.size].view(p.shape)
        v.copy_(torch.from_numpy(p.copy()))
        views.append(v)
    planes = {Plane.ROWWISE: views[:2], Plane.COLWISE: views[2:]}
    return TorchMXFP8Tensor(planes, shape=(M, K), dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", [None, "native", "uint8"])
def test_to_torch_mxfp8_shares_every_plane(device, transport):
    q = _quantized(device)
    tt = to_torch_mxfp8(q, transport=transport)
    assert tt.shape == (M, K) and tt.dtype == torch.bfloat16
    for f in FIELDS:
        a, t = getattr(q, f), getattr(tt, f)
        assert t.data_ptr() == a.unsafe_buffer_pointer(), f
        assert t.dtype == (torch.float8_e4m3fn if "data" in f else torch.float8_e8m0fnu)
        np.testing.assert_array_equal(torch_bytes(t), jax_bytes(a))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", [None, "native", "uint8"])
def test_to_jax_mxfp8_shares_uint8_fsdp_buffers(device, transport):
    q = _quantized(device)
    tt = _fsdp_style_uint8(q, device)
    back = to_jax_mxfp8(tt, transport=transport)
    assert back.shape == q.shape and back.dtype == q.dtype
    for f in FIELDS:
        a, t = getattr(back, f), getattr(tt, f)
        assert a.unsafe_buffer_pointer() == t.data_ptr(), f
        assert a.dtype == getattr(q, f).dtype
    for plane in Plane:
        np.testing.assert_array_equal(
            np.asarray(dequantize(back, plane)), np.asarray(dequantize(q, plane))
        )


def test_round_trip_keeps_addresses_and_missing_planes():
    q = quantize(jnp.ones((M, K), jnp.float32), planes=(Plane.COLWISE,))
    tt = to_torch_mxfp8(q)
    assert tt.rowwise_data is None and not tt.has_plane("rowwise") and tt.has_plane(Plane.COLWISE)
    back = to_jax_mxfp8(tt)
    assert back.rowwise_data is None and back.rowwise_scale is None
    assert back.colwise_data.unsafe_buffer_pointer() == q.colwise_data.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="no rowwise plane"):
        tt.rowwise()


def test_implements_the_weight_planes_protocol():
    tt = to_torch_mxfp8(_quantized())
    assert isinstance(tt, MXFP8WeightPlanes)
    data, scale = tt.colwise()
    assert tuple(data.shape) == (M, K) and tuple(scale.shape) == (M // 32, K)
    data, scale = tt.rowwise()
    assert tuple(data.shape) == (M, K) and tuple(scale.shape) == (M, K // 32)


def _u8(*shape):
    return torch.zeros(shape, dtype=torch.uint8)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param(
            dict(rowwise_scale=_u8(M // 32, K)),
            r"rowwise scale .* must have shape "
            r"\(64, 3\)",
            id="colwise-shaped-rowwise-scale",
        ),  # fmt: skip
        pytest.param(
            dict(colwise_data=_u8(K, M)),
            r"colwise data .* shape \(64, 96\)",
            id="transposed-colwise-data",
        ),  # fmt: skip
        pytest.param(dict(rowwise_data=torch.zeros(M, K)), "dtype in", id="float32-data"),
        pytest.param(dict(rowwise_scale=None), "both be given", id="half-a-plane"),
        pytest.param(dict(shape=(M, 40)), "K % 32 == 0", id="bad-shape"),
        pytest.param(dict(dtype=torch.float16), "float32 or torch.bfloat16", id="bad-dtype"),
    ],
)
def test_invalid_planes_are_refused_with_the_expected_layout(kwargs, match):
    parts = dict(
        rowwise_data=_u8(M, K),
        rowwise_scale=_u8(M, K // 32),
        colwise_data=_u8(M, K),
        colwise_scale=_u8(M // 32, K),
        shape=(M, K),
        dtype=torch.bfloat16,
    )
    parts.update(kwargs)
    planes = {p: (parts[f"{p.value}_data"], parts[f"{p.value}_scale"]) for p in Plane}
    with pytest.raises(ValueError, match=match):
        TorchMXFP8Tensor(planes, parts["shape"], parts["dtype"])


def test_misaligned_planes_are_refused_not_copied():
    buf = torch.zeros(M * K + 16, dtype=torch.uint8)
    data = buf[16:].view(M, K)  # 16 bytes past a 64-byte boundary
    tt = TorchMXFP8Tensor({Plane.ROWWISE: (data, _u8(M, K // 32))}, (M, K), torch.float32)
    with pytest.raises(ZeroCopyError, match="16 bytes past a 64-byte boundary"):
        to_jax_mxfp8(tt)
