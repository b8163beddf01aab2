"""bridge.jax_fastpath: the private-JAX CUDA import of ``to_jax`` and its fallback.

(a) On CUDA the fast path returns what the public ``jax.dlpack.from_dlpack`` path returns: an
array of the same dtype, shape and device over the tensor's own memory, for every dtype and both
1-byte float transports. (b) With the private internals missing (removed by monkeypatch) or
changed (an import that raises, or one that returns something other than a view), it reports why
in ``status()`` and ``to_jax`` takes the public path, still zero-copy. The CPU cases check the
lookup and the per-device fallback; the CUDA cases (marked ``gpu``) the whole crossing.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
import torch
from jax._src.lib import _jax

from bridge import jax_fastpath, to_jax, torch_to_jax
from bridge.capabilities import Fp8Transport
from bridge.dtypes import SPECS
from tests.bridge.conftest import jax_bytes, sample, torch_bytes

_PRIVATE_IMPORT = "dlpack_managed_tensor_to_buffer"
_FAKE_CUDA_TENSOR = SimpleNamespace(device=torch.device("cuda", 0))  # only .device is read


@pytest.fixture
def patch_jax():
    """A monkeypatch for JAX's internals; the fast path looks them up again afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        yield mp
    jax_fastpath.reset()
    assert jax_fastpath.status().enabled, jax_fastpath.status()


def test_the_supported_jax_versions_have_the_internals():
    # On a JAX without them the bridge still works (public path, slower on CUDA): update the
    # lookup in bridge/jax_fastpath.py, or accept the cost.
    assert isinstance(jax_fastpath.resolve_internals(), jax_fastpath.Internals)
    assert jax_fastpath.status() == jax_fastpath.FastPathStatus(True, "")


def test_a_missing_private_function_turns_the_fast_path_off(patch_jax):
    patch_jax.delattr(_jax, _PRIVATE_IMPORT)
    status = jax_fastpath.reset()
    assert not status.enabled and f"_jax.{_PRIVATE_IMPORT} is missing" in status.reason
    assert jax_fastpath.import_cuda(_FAKE_CUDA_TENSOR, None) is None


def test_a_missing_private_module_turns_the_fast_path_off(patch_jax):
    patch_jax.delattr(jax._src, "xla_bridge")
    patch_jax.setitem(sys.modules, "jax._src.xla_bridge", None)  # "import" now raises
    status = jax_fastpath.reset()
    assert not status.enabled and "not importable" in status.reason
    assert jax_fastpath.import_cuda(_FAKE_CUDA_TENSOR, None) is None


def test_a_device_jax_cannot_name_takes_the_public_path(patch_jax):
    def no_backend(platform):
        raise RuntimeError(f"Unknown backend {platform}")

    patch_jax.setattr(jax._src.xla_bridge, "get_backend", no_backend)
    jax_fastpath.reset()
    assert jax_fastpath.import_cuda(_FAKE_CUDA_TENSOR, None) is None
    assert jax_fastpath.status().enabled  # only that device: others may still have a twin


# ------------------------------------------------------------------------------------- CUDA

_CASES = [
    pytest.param(s.torch, t, id=f"{str(s.torch).removeprefix('torch.')}-{t.value}")
    for s in SPECS if not s.needs_x64
    for t in ((Fp8Transport.NATIVE, Fp8Transport.UINT8) if s.byte_code else (Fp8Transport.NATIVE,))
]


def _code(dtype, transport):
    spec = next(s for s in SPECS if s.torch == dtype)
    return spec.byte_code if transport is Fp8Transport.UINT8 else None


def _count_public(monkeypatch) -> list:
    calls = []
    real = torch_to_jax.public_import
    monkeypatch.setattr(
        torch_to_jax, "public_import", lambda t, code: (calls.append(t), real(t, code))[1]
    )
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "transport"), _CASES)
def test_fast_path_gives_the_public_paths_array(dtype, transport):
    t = sample(dtype, shape=(8, 96), device="cuda")
    code = _code(dtype, transport)
    fast = jax_fastpath.import_cuda(t, code)
    public = torch_to_jax.public_import(t, code)
    assert fast is not None, jax_fastpath.status()
    for a in (fast, public):
        assert a.unsafe_buffer_pointer() == t.data_ptr()
    def seen(a):
        return type(a), a.dtype, a.shape, a.devices(), a.committed

    assert seen(fast) == seen(public)
    assert (jax_bytes(fast) == torch_bytes(t)).all() and (jax_bytes(public) == torch_bytes(t)).all()


@pytest.mark.gpu
def test_to_jax_takes_the_fast_path_on_cuda(monkeypatch):
    public = _count_public(monkeypatch)
    t = sample(torch.bfloat16, device="cuda")
    assert to_jax(t).unsafe_buffer_pointer() == t.data_ptr()
    assert public == []


def _zero_copy_via_public_path(monkeypatch) -> None:
    public = _count_public(monkeypatch)
    for _ in range(2):  # the fallback sticks: the second call goes straight to the public path
        t = sample(torch.float8_e4m3fn, device="cuda")
        a = to_jax(t, transport="uint8")
        assert a.unsafe_buffer_pointer() == t.data_ptr() and a.dtype == jnp.float8_e4m3fn
        assert (jax_bytes(a) == torch_bytes(t)).all()
    assert len(public) == 2


# The GPU fallback cases change what the fast path sees (resolve_internals), not JAX's module:
# jax.dlpack.from_dlpack, the public path, calls the same private import itself.
def _internals_with(patch, **changes):
    real = jax_fastpath.resolve_internals()
    assert not isinstance(real, str), real
    patch.setattr(jax_fastpath, "resolve_internals", lambda: real._replace(**changes))
    jax_fastpath.reset()


@pytest.mark.gpu
def test_missing_internals_fall_back_to_the_public_path(patch_jax):
    patch_jax.setattr(jax_fastpath, "resolve_internals",
                      lambda: f"jax._src.lib._jax.{_PRIVATE_IMPORT} is missing")
    jax_fastpath.reset()
    _zero_copy_via_public_path(patch_jax)
    assert not jax_fastpath.status().enabled


@pytest.mark.gpu
def test_a_changed_signature_falls_back_to_the_public_path(patch_jax):
    def new_signature(capsule, *, device):
        raise AssertionError("not reached: called with the old positional arguments")

    _internals_with(patch_jax, import_capsule=new_signature)
    _zero_copy_via_public_path(patch_jax)
    assert "TypeError" in jax_fastpath.status().reason


@pytest.mark.gpu
def test_an_import_that_copies_falls_back_to_the_public_path(patch_jax):
    _internals_with(patch_jax, import_capsule=lambda capsule, *args: jnp.zeros((4, 64)))
    _zero_copy_via_public_path(patch_jax)
    assert "not a view of the tensor" in jax_fastpath.status().reason
