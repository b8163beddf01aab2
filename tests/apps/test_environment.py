"""``apps.environment``: the one place the documented environment variables of the library's
switches are read (the library takes them as arguments: tests/test_architecture.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps import environment
from common.kernels import Backend, GemmImpl, KernelConfig

_ALL = (environment.BACKEND, environment.GEMM, environment.CHECK_COLLECTIVES,
        environment.COMM_STREAMS, environment.JAX_CACHE, "XDG_CACHE_HOME")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in _ALL:
        monkeypatch.delenv(name, raising=False)


def test_the_kernel_variables_fill_only_none_fields(monkeypatch):
    assert environment.kernels(None) is None
    monkeypatch.setenv(environment.BACKEND, "xla")
    monkeypatch.setenv(environment.GEMM, "dequant_bf16_dot")
    assert environment.kernels(None) == KernelConfig(Backend.XLA, GemmImpl.DEQUANT_BF16_DOT)
    given = KernelConfig("pallas", "dequant_dot")
    assert environment.kernels(given) == given
    monkeypatch.setenv(environment.BACKEND, "te")  # runs its own GEMM: MXFP8_GEMM does not apply
    assert environment.kernels(None) == KernelConfig(Backend.TE)
    monkeypatch.setenv(environment.BACKEND, "nope")
    with pytest.raises(ValueError, match="unknown MXFP8 backend 'nope'"):
        environment.kernels(None)


@pytest.mark.parametrize("read, name", [
    (environment.check_collectives, environment.CHECK_COLLECTIVES),
    (environment.comm_streams, environment.COMM_STREAMS),
])
def test_a_switch_is_1_or_0_or_unset(monkeypatch, read, name):
    assert read() is False
    monkeypatch.setenv(name, "1")
    assert read() is True
    monkeypatch.setenv(name, "0")
    assert read() is False
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name}='yes': expected 1"):
        read()


def test_the_jax_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert environment.jax_cache_dir() == tmp_path / ".cache" / "mxfp8-fsdp" / "jax"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert environment.jax_cache_dir() == tmp_path / "xdg" / "mxfp8-fsdp" / "jax"
    monkeypatch.setenv(environment.JAX_CACHE, str(tmp_path / "mine"))
    assert environment.jax_cache_dir() == Path(tmp_path / "mine")
    monkeypatch.setenv(environment.JAX_CACHE, "off")
    assert environment.jax_cache_dir() is None


def test_the_library_messages_name_the_same_variables():
    from jax_side import compile_cache
    from torch_side.comm.collective_check import CHECK_ENV

    assert CHECK_ENV == environment.CHECK_COLLECTIVES
    assert compile_cache.ENV_VAR == environment.JAX_CACHE
