"""``common.shared_pool`` and ``bridge.memory_pool``: one CUDA memory pool for Torch and JAX.

On the CPU: what ``use_shared_pool`` sets and what it refuses, by name. On the GPU (a fresh
process each, since both frameworks read the allocator choice when they start CUDA): both
allocate from the device's default pool, the pool's counters see both, memory JAX frees is
reused by Torch (the pool's reserved high-water mark stays at one buffer's size, where two
private caches would hold two), and the MXFP8 linear's bytes are those of the default allocators.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bridge import memory_pool
from common import shared_pool

ROOT = Path(__file__).resolve().parents[2]
ENV_KEYS = ("XLA_PYTHON_CLIENT_ALLOCATOR", "PYTORCH_CUDA_ALLOC_CONF")


@pytest.fixture
def clean_env(monkeypatch):
    for k in ENV_KEYS:  # set first, so that teardown restores them whatever the test set
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: False)
    return monkeypatch


def test_use_shared_pool_sets_both_allocators(clean_env):
    shared_pool.use_shared_pool()
    assert os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "cuda_async"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    shared_pool.use_shared_pool()  # twice: the same
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"


def test_use_shared_pool_keeps_the_other_torch_allocator_options(clean_env):
    clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8")
    shared_pool.use_shared_pool()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == (
        "backend:cudaMallocAsync,garbage_collection_threshold:0.8")


@pytest.mark.parametrize(("key", "value", "match"), [
    ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform", r"XLA_PYTHON_CLIENT_ALLOCATOR='platform'"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,backend:native",
     r"asks Torch for the 'native' allocator backend"),
])
def test_use_shared_pool_refuses_another_allocator_by_name(clean_env, key, value, match):
    clean_env.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        shared_pool.use_shared_pool()
    other = next(k for k in ENV_KEYS if k != key)
    assert other not in os.environ, "nothing is set when refused"


def test_use_shared_pool_refuses_once_torch_started_cuda(clean_env):
    clean_env.setattr("torch.cuda.is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="Torch has already started CUDA"):
        shared_pool.use_shared_pool()
    assert not any(k in os.environ for k in ENV_KEYS)


def test_pool_stats_without_a_cuda_driver_says_so(monkeypatch):
    def no_driver(name, *a, **kw):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    with pytest.raises(RuntimeError, match=r"the CUDA driver \(libcuda.so.1\) is not loadable"):
        memory_pool.pool_stats()


def test_require_shared_pool_where_torch_has_no_cuda_says_what_to_do():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the GPU tests below check the pool itself")
    with pytest.raises(RuntimeError, match=r"allocator backend 'no CUDA'.*use_shared_pool\(\) "
                                           r"must run before torch is imported"):
        memory_pool.require_shared_pool()


def _fresh_process(body: str, shared: bool = True) -> str:
    """Run ``body`` in a new Python process (the shared pool set up first, or each framework's
    own allocator); its stdout."""
    code = textwrap.dedent("""
        from common.shared_pool import use_shared_pool
        use_shared_pool()
        import sys; assert "torch" not in sys.modules
    """ if shared else "") + textwrap.dedent(body)
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.gpu
def test_torch_and_jax_allocate_from_one_pool_and_reuse_each_others_memory():
    out = _fresh_process("""
        import gc
        import jax, numpy as np, torch
        from bridge.memory_pool import pool_stats, require_shared_pool, reset_pool_peak
        assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
        require_shared_pool(0)
        GiB = 2**30
        torch.cuda.synchronize(); reset_pool_peak(0); base = pool_stats(0)
        a = jax.device_put(np.ones((GiB // 4,), np.float32)).block_until_ready()  # 1 GiB, JAX
        mid = pool_stats(0)
        assert mid.used - base.used >= GiB, (base, mid)
        del a; gc.collect()
        torch.cuda.synchronize()  # (the device: JAX's free has run)
        t = torch.ones(GiB // 4, device="cuda")  # 1 GiB, Torch, after JAX freed its GiB
        torch.cuda.synchronize()
        end = pool_stats(0)
        assert end.used - base.used >= GiB, (base, end)
        # one GiB at a time: the pool never held both (two private caches would hold 2 GiB)
        assert end.used_high - base.used < 1.5 * GiB, (base, end)
        assert end.reserved_high - base.reserved < 1.5 * GiB, (base, end)
        print("ok", (end.used_high - base.used) / GiB)
    """)
    assert out.startswith("ok"), out


@pytest.mark.gpu
def test_the_mxfp8_linear_gives_the_same_bytes_in_the_shared_pool():
    """The bridge's MXFP8 linear (forward and backward, DLPack both ways) in the shared pool:
    the bytes of the same computation with each framework's own allocator."""
    code = textwrap.dedent("""
        import hashlib
        import torch
        from bridge import mxfp8_linear
        assert torch.cuda.get_allocator_backend() == BACKEND
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(256, 512, device="cuda", generator=g, requires_grad=True)
        w = torch.randn(384, 512, device="cuda", generator=g, requires_grad=True)
        y = mxfp8_linear(x, w)
        y.backward(torch.ones_like(y))
        for t in (y, x.grad, w.grad):
            print(hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest())
    """)
    shared = _fresh_process(code.replace("BACKEND", "'cudaMallocAsync'"))
    own = _fresh_process(code.replace("BACKEND", "'native'"), shared=False)
    assert len(shared.split()) == 3 and shared == own
