"""``bridge.determinism``: the XLA flags and Torch switches of reproducible GPU runs reach every
rank, and a user's explicit XLA flag wins. (That two GPU launches give the same bits is checked on
the GPU machine by scripts/gpu/repro.sh, whose results are in BENCHMARKS.md.)"""

from __future__ import annotations

import os

import pytest
import torch

from bridge import determinism
from bridge.determinism import XLA_DETERMINISTIC_FLAGS, make_deterministic, merge_xla_flags
from torch_side.launch import run_local_ranks


def test_flags_are_appended_to_the_users_flags():
    merged, overridden = merge_xla_flags("--xla_dump_to=/tmp/x", XLA_DETERMINISTIC_FLAGS)
    assert merged.split() == ["--xla_dump_to=/tmp/x", *XLA_DETERMINISTIC_FLAGS]
    assert overridden == ()


def test_a_flag_the_user_set_is_kept_and_reported():
    merged, overridden = merge_xla_flags("--xla_gpu_autotune_level=4", XLA_DETERMINISTIC_FLAGS)
    assert "--xla_gpu_autotune_level=4" in merged.split()
    assert "--xla_gpu_autotune_level=0" not in merged.split()
    assert "--xla_gpu_deterministic_ops=true" in merged.split()
    assert overridden == ("--xla_gpu_autotune_level",)


def test_merging_twice_changes_nothing():
    once, _ = merge_xla_flags("", XLA_DETERMINISTIC_FLAGS)
    assert merge_xla_flags(once, XLA_DETERMINISTIC_FLAGS) == (once, ())


@pytest.fixture
def restore_torch_determinism(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def test_make_deterministic_sets_both_sides(restore_torch_determinism):
    report = make_deterministic()
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == determinism.CUBLAS_WORKSPACE
    for flag in XLA_DETERMINISTIC_FLAGS:
        assert flag in os.environ["XLA_FLAGS"].split()
    assert report.torch_deterministic and report.xla_flags == os.environ["XLA_FLAGS"]


def test_a_started_gpu_backend_without_the_flags_is_refused(restore_torch_determinism,
                                                             monkeypatch):
    monkeypatch.setattr(determinism, "_jax_backend_started", lambda: True)
    monkeypatch.setattr(determinism, "_jax_uses_gpu", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(RuntimeError, match="before the first JAX computation"):
        make_deterministic()
    assert os.environ["XLA_FLAGS"] == ""  # nothing half-applied


def rank_xla_flags() -> str:
    return os.environ["XLA_FLAGS"]


def test_the_users_xla_flags_reach_spawned_ranks(monkeypatch):
    """The launcher used to replace XLA_FLAGS, so `XLA_FLAGS=... mxfp8-train` never reached JAX."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true "
                                    "--xla_force_host_platform_device_count=4")
    flags = run_local_ranks(rank_xla_flags, 1, ())[0].split()
    assert "--xla_gpu_deterministic_ops=true" in flags
    assert [f for f in flags if "device_count" in f] == ["--xla_force_host_platform_device_count=1"]
