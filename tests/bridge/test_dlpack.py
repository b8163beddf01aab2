"""bridge.to_jax / bridge.to_torch: zero-copy (same data pointer), refusals, explicit copies.

Zero-copy is proven by data pointers: ``t.data_ptr() == a.unsafe_buffer_pointer()``.
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import bridge
from bridge import Fp8Transport, ZeroCopyError, to_jax, to_torch
from bridge.dtypes import SPECS, jax_dtype_for
from tests.bridge.conftest import DEVICES, jax_bytes, sample, torch_bytes

# Every row of the bridge's table (a new row is tested by adding it: docs/extending.md, "A bridge
# path"); the 64-bit rows need jax_enable_x64 and have a test of their own.
BYTE_FLOATS = [s.torch for s in SPECS if s.byte_code is not None]
OTHER_DTYPES = [s.torch for s in SPECS if s.byte_code is None and not s.needs_x64]
TRANSPORTS = [None, Fp8Transport.NATIVE, Fp8Transport.UINT8]

CASES = [pytest.param(d, None, id=str(d).removeprefix("torch.")) for d in OTHER_DTYPES] + [
    pytest.param(d, tr, id=f"{str(d).removeprefix('torch.')}-{tr.value if tr else 'detected'}")
    for d in BYTE_FLOATS
    for tr in TRANSPORTS
]


def _jax_device(device: str):
    return jax.devices("cpu" if device == "cpu" else "gpu")[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,transport", CASES)
def test_to_jax_shares_the_torch_buffer(device, dtype, transport):
    t = sample(dtype, device=device)
    a = to_jax(t, transport=transport)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.dtype == jax_dtype_for(dtype)
    assert a.shape == tuple(t.shape)
    assert a.devices() == {_jax_device(device)}
    np.testing.assert_array_equal(jax_bytes(a), torch_bytes(t))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,transport", CASES)
def test_to_torch_shares_the_jax_buffer(device, dtype, transport):
    values = np.asarray(to_jax(sample(dtype)))  # numpy (ml_dtypes) copy of the sample
    a = jax.device_put(values, _jax_device(device))  # a buffer allocated by JAX
    t = to_torch(a, transport=transport)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert t.dtype == dtype and tuple(t.shape) == a.shape and t.device.type == device
    np.testing.assert_array_equal(torch_bytes(t), jax_bytes(a))


@pytest.mark.parametrize("dtype,transport", CASES)
def test_round_trip_returns_to_the_same_address(dtype, transport):
    t = sample(dtype)
    back = to_torch(to_jax(t, transport=transport), transport=transport)
    assert back.data_ptr() == t.data_ptr() and back.dtype == t.dtype


def test_size_one_dims_with_any_stride_are_shared():
    base = torch.arange(64, dtype=torch.float32)
    t = base.as_strided((1, 64), (7, 1))  # contiguous for Torch; the stride of a size-1 dim is free
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


@pytest.mark.parametrize("shape", [(0,), (0, 32), ()], ids=["0", "0x32", "scalar"])
def test_empty_and_scalar_tensors(shape):
    t = torch.zeros(shape)
    a = to_jax(t)
    assert a.shape == shape
    assert tuple(to_torch(a).shape) == shape


def test_aligned_offset_view_is_shared():
    buf = torch.zeros(1024, dtype=torch.uint8)
    view = buf[256:512]  # planes inside FSDP buffers start at >= 256-byte aligned offsets
    assert to_jax(view).unsafe_buffer_pointer() == view.data_ptr()


# ------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.zeros(64, 64).T, id="transposed"),
        pytest.param(lambda: torch.zeros(64, 64)[:, ::2], id="stepped"),
        pytest.param(lambda: torch.zeros(1).expand(64), id="broadcast"),
        pytest.param(lambda: torch.zeros(1).as_strided((32, 32), (0, 0)), id="storage-free"),
    ],
)
def test_refuses_non_contiguous_views_and_copies_on_request(make):
    t = make()
    with pytest.raises(ZeroCopyError, match=r"not contiguous.*copy=True") as err:
        to_jax(t)
    msg = str(err.value)
    for part in (f"shape={tuple(t.shape)}", f"strides={tuple(t.stride())}", "dtype=", "device="):
        assert part in msg
    a = to_jax(t, copy=True)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    assert a.unsafe_buffer_pointer() != t.data_ptr()


def test_refuses_a_misaligned_offset_that_jax_would_silently_copy():
    base = torch.arange(100, dtype=torch.float32)
    t = base[1:65]  # 4 bytes past a 64-byte boundary
    with pytest.raises(ZeroCopyError, match=r"storage_offset=1.*4 bytes past a 64-byte"):
        to_jax(t)
    a = to_jax(t, copy=True)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int16, torch.uint16])
def test_refuses_unsupported_dtypes_even_with_copy(dtype):
    t = torch.zeros(64, dtype=dtype)
    for copy in (False, True):
        with pytest.raises(ZeroCopyError, match=r"not supported; supported: float32"):
            to_jax(t, copy=copy)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_64_bit_dtypes_need_x64_instead_of_silently_narrowing(dtype):
    t = sample(dtype)
    with pytest.raises(ZeroCopyError, match="jax_enable_x64"):
        to_jax(t)
    with jax.enable_x64(True):
        a = to_jax(t)
        assert a.dtype == jax_dtype_for(dtype)
        assert a.unsafe_buffer_pointer() == t.data_ptr()
        assert to_torch(a).data_ptr() == t.data_ptr()


def test_refuses_tensors_that_require_grad():
    w = torch.zeros(64, requires_grad=True)
    with pytest.raises(ZeroCopyError, match=r"requires grad.*detach"):
        to_jax(w)
    assert to_jax(w.detach()).unsafe_buffer_pointer() == w.data_ptr()


def test_to_torch_refuses_multi_device_arrays_and_tracers():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharded = jax.device_put(jnp.zeros((8, 8)), NamedSharding(mesh, PartitionSpec("x")))
    with pytest.raises(ZeroCopyError, match=r"spans \d devices.*addressable_shards"):
        to_torch(sharded)
    shard = sharded.addressable_shards[1].data
    assert to_torch(shard).data_ptr() == shard.unsafe_buffer_pointer()
    with pytest.raises(TypeError, match="tracer"):
        jax.jit(to_torch)(jnp.zeros(4))


def test_to_torch_refuses_a_deleted_array():
    a = jnp.zeros(64)
    a.delete()
    with pytest.raises(ZeroCopyError, match="deleted"):
        to_torch(a)


def test_wrong_input_types():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        to_jax(np.zeros(4))
    with pytest.raises(TypeError, match="expected a jax.Array"):
        to_torch(torch.zeros(4))


# ------------------------------------------------------------------------------------ copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_copy_true_always_copies(dtype):
    t = sample(dtype)
    a = to_jax(t, copy=True)
    assert a.unsafe_buffer_pointer() != t.data_ptr()
    np.testing.assert_array_equal(jax_bytes(a), torch_bytes(t))
    back = to_torch(a, copy=True)
    assert back.data_ptr() != a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(torch_bytes(back), torch_bytes(t))


# ------------------------------------------------------------------------------------ lifetime


def test_jax_view_keeps_the_torch_buffer_alive():
    t = torch.arange(4096, dtype=torch.float32)
    expected = t.numpy().copy()
    a = to_jax(t)
    del t
    gc.collect()
    churn = [torch.full((4096,), -1.0) for _ in range(64)]  # would reuse a freed block
    np.testing.assert_array_equal(np.asarray(a), expected)
    assert all(c.data_ptr() != a.unsafe_buffer_pointer() for c in churn)


def test_torch_view_keeps_the_jax_buffer_alive():
    a = jnp.arange(4096, dtype=jnp.float32)
    t = to_torch(a)
    del a
    gc.collect()
    _ = [jnp.full((4096,), -1.0) for _ in range(64)]
    np.testing.assert_array_equal(t.numpy(), np.arange(4096, dtype=np.float32))


def test_result_brought_back_by_to_torch_is_final_before_torch_overwrites_the_input():
    # The ownership rule: once a JAX result is back in Torch, Torch may overwrite the inputs.
    t = torch.ones(256, 256)
    a = to_jax(t)
    out = to_torch(jnp.sum(a @ a, axis=0))
    t.fill_(0.0)
    np.testing.assert_array_equal(out.numpy(), np.full(256, 256.0 * 256.0, np.float32))


# ------------------------------------------------------------------------------------ detection


def test_dlpack_support_reports_every_one_byte_float_in_both_directions():
    support = bridge.dlpack_support()
    for table in (support.torch_to_jax, support.jax_to_torch):
        assert set(table) == set(BYTE_FLOATS)
        assert all(isinstance(v, Fp8Transport) for v in table.values())
    for key, why in support.notes.items():  # every non-native choice says why
        assert why, key


def test_jax_work_on_names_the_jax_twin_of_a_torch_device():
    from jax_side.mxfp8.backend_api import default_platform

    cpu = bridge.jax_device("cpu")
    assert cpu.platform == "cpu"
    assert to_jax(torch.zeros(64)).devices() == {cpu}
    with bridge.jax_work_on(torch.device("cpu")):
        assert default_platform() == "cpu"
        assert jnp.zeros(3).devices() == {cpu}
    with pytest.raises(ValueError, match="meta.*no JAX counterpart"):
        bridge.jax_device("meta")
