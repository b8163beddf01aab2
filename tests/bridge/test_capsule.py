"""bridge.capsule: relabeling a DLPack capsule's dtype (the uint8 transport for 1-byte floats)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import bridge.jax_to_torch
import bridge.torch_to_jax
from bridge import Fp8Transport, to_jax, to_torch
from bridge.capsule import DLDataType, DLDataTypeCode, read_dtype, relabel
from bridge.dtypes import jax_dtype_for
from tests.bridge.conftest import jax_bytes, sample, torch_bytes

CODES = {
    torch.uint8: DLDataTypeCode.UINT,
    torch.float8_e4m3fn: DLDataTypeCode.FLOAT8_E4M3FN,
    torch.float8_e5m2: DLDataTypeCode.FLOAT8_E5M2,
    torch.float8_e8m0fnu: DLDataTypeCode.FLOAT8_E8M0FNU,
}


@pytest.mark.parametrize("dtype", list(CODES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_code_table_matches_what_both_libraries_export(dtype, versioned):
    kw = {"max_version": (1, 0)} if versioned else {}
    t = torch.zeros(64, dtype=dtype)
    try:
        capsule = t.__dlpack__(**kw)
    except (BufferError, RuntimeError, TypeError) as e:
        pytest.skip(f"this torch cannot export {dtype} natively ({e}); the uint8 path covers it")
    assert read_dtype(capsule) == DLDataType(CODES[dtype], 8, 1)
    a = jax.device_put(np.zeros(64, jax_dtype_for(dtype)), jax.devices("cpu")[0])
    assert read_dtype(a.__dlpack__(**kw)) == DLDataType(CODES[dtype], 8, 1)


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_relabel_changes_only_the_dtype_torch_sees(versioned):
    kw = {"max_version": (1, 0)} if versioned else {}
    src = sample(torch.float8_e4m3fn)
    capsule = src.view(torch.uint8).__dlpack__(**kw)
    relabel(capsule, DLDataTypeCode.FLOAT8_E4M3FN)
    out = torch.from_dlpack(capsule)
    assert out.dtype == torch.float8_e4m3fn and out.data_ptr() == src.data_ptr()
    np.testing.assert_array_equal(torch_bytes(out), torch_bytes(src))


def test_relabel_refuses_wider_elements_and_consumed_capsules():
    capsule = torch.zeros(4, dtype=torch.float32).__dlpack__()
    with pytest.raises(ValueError, match="only 8-bit, 1-lane"):
        relabel(capsule, DLDataTypeCode.FLOAT8_E4M3FN)
    capsule = torch.zeros(4, dtype=torch.uint8).__dlpack__()
    torch.from_dlpack(capsule)  # consumes it (renamed 'used_dltensor')
    with pytest.raises(ValueError, match="unconsumed DLPack capsule"):
        relabel(capsule, DLDataTypeCode.FLOAT8_E4M3FN)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e8m0fnu])
def test_forced_uint8_transport_goes_through_relabel(monkeypatch, dtype):
    calls = []

    def spy(capsule, code):
        calls.append((read_dtype(capsule).code, int(code)))
        relabel(capsule, code)

    for direction in (bridge.torch_to_jax, bridge.jax_to_torch):
        monkeypatch.setattr(direction, "relabel", spy)
    t = sample(dtype)
    a = to_jax(t, transport=Fp8Transport.UINT8)
    assert calls == [(DLDataTypeCode.UINT, CODES[dtype])]  # Torch exported bytes, JAX saw float8
    back = to_torch(a, transport="uint8")
    assert calls[1] == (CODES[dtype], DLDataTypeCode.UINT)  # JAX exported float8, Torch saw bytes
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr() == a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(jax_bytes(a), torch_bytes(t))
    calls.clear()
    to_torch(to_jax(t, transport="native"), transport="native")
    assert calls == []
