"""``tests/compile_once.py`` wraps private JAX functions only where their signatures are the ones
it was written for; elsewhere it changes nothing (issue 30, item 15: jax 0.11 added a parameter to
``_cache_read`` and the wrapper broke every spawned world of the GPU pass)."""

from __future__ import annotations

import types

from tests import compile_once


def _module(read, compile_and_write) -> types.SimpleNamespace:
    return types.SimpleNamespace(_cache_read=read, _compile_and_write_cache=compile_and_write)


def _read_0_10(module_name, cache_key, compile_options, backend, executable_devices):
    return ("cached", module_name, cache_key), None


def _compile_0_10(backend, computation, executable_devices, compile_options, host_callbacks,
                  module_name, cache_key):
    return "compiled"


def _read_0_11(module_name, cache_key, compile_options, backend, executable_devices,
               host_callbacks):
    return None, None


def test_a_changed_signature_is_left_alone():
    fake = _module(_read_0_11, _compile_0_10)
    assert not compile_once.compatible(fake)
    assert compile_once.install(fake) is False
    assert fake._cache_read is _read_0_11 and fake._compile_and_write_cache is _compile_0_10
    assert not getattr(fake, "_compile_once_installed", False)


def test_missing_functions_are_left_alone():
    fake = types.SimpleNamespace(_cache_read=_read_0_10)
    assert compile_once.install(fake) is False
    assert fake._cache_read is _read_0_10


def test_the_expected_signature_is_wrapped_once_and_passes_calls_through():
    fake = _module(_read_0_10, _compile_0_10)
    assert compile_once.install(fake) is True
    wrapped = fake._cache_read
    assert wrapped is not _read_0_10
    assert compile_once.install(fake) is True and fake._cache_read is wrapped  # not twice
    # no cache directory configured: no lock is taken, the call goes straight through
    assert wrapped("m", "", None, None, None) == (("cached", "m", ""), None)
    assert fake._compile_and_write_cache(None, None, None, None, (), "m", "") == (
        ("cached", "m", ""))  # found "in the cache" by the read it makes first


def test_jax_0_10_is_the_version_the_wrappers_were_written_for():
    import jax
    from jax._src import compiler

    if jax.__version__.startswith("0.10."):  # CI's JAX; the H200's 0.11.2 is left alone
        assert compile_once.compatible(compiler)
