"""The persistent compilation cache directory (``jax_side.compile_cache``) is private: created
0700, refused when another user owns it or its group or others may write to it (the executables
cached there are loaded and run by every training process)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from jax_side import compile_cache
from jax_side.compile_cache import UnsafeCacheDir, enable_compilation_cache, prepare_cache_dir


@pytest.fixture
def jax_config_calls(monkeypatch):
    """Record, instead of applying, what enable_compilation_cache sets in JAX's config (this
    test process keeps its own)."""
    import jax

    calls = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: calls.append((name, value)))
    return calls


def test_a_new_cache_directory_is_created_private(tmp_path, jax_config_calls):
    where = tmp_path / "cache" / "jax"
    assert enable_compilation_cache(where) == where
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert ("jax_compilation_cache_dir", str(where)) in jax_config_calls


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_may_write_to_is_refused(tmp_path, jax_config_calls, mode):
    where = tmp_path / "jax"
    where.mkdir()
    where.chmod(mode)
    with pytest.raises(UnsafeCacheDir, match=rf"{where} is not private: its mode 0{mode:o} lets"
                       rf" its group or others write.*chmod 700.*MXFP8_JAX_CACHE=off"):
        enable_compilation_cache(where)
    assert jax_config_calls == []  # JAX never pointed at it


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_refused(tmp_path, jax_config_calls):
    where = tmp_path / "jax"
    where.mkdir(mode=0o700)
    os.chown(where, 12345, -1)
    with pytest.raises(UnsafeCacheDir, match="owned by uid 12345, not by this user"):
        prepare_cache_dir(where)
    assert jax_config_calls == []


def test_no_directory_leaves_the_cache_off(jax_config_calls):
    # (MXFP8_JAX_CACHE=off gives None: apps.environment.jax_cache_dir, tests/apps)
    assert enable_compilation_cache(None) is None and jax_config_calls == []


def test_mxfp8_train_refuses_an_unsafe_cache_before_any_rank_starts(tmp_path):
    where = tmp_path / "shared"
    where.mkdir()
    where.chmod(0o777)
    env = {**os.environ, compile_cache.ENV_VAR: str(where)}
    done = subprocess.run([sys.executable, "-m", "apps.training", "--steps", "1"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "mxfp8-train: error: the JAX compilation cache" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "local cpu ranks" not in done.stdout
