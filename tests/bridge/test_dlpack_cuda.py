"""CUDA rules of the ownership note in bridge/dlpack.py: stream ordering, lifetime, devices, memory.

Every test here is marked ``gpu`` (skipped without CUDA). Pending Torch work is made long with
``torch.cuda._sleep`` so that a missing stream dependency would show up as wrong values.
"""

from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge import to_jax, to_torch

pytestmark = pytest.mark.gpu

_SPIN_CYCLES = 200_000_000  # ~0.1 s of GPU time on an H200 clock


@jax.jit
def _heavy_sum(a):
    """A JAX computation that reads ``a`` for a while (a chain of matmuls), then sums it."""
    m = a.reshape(1024, -1)[:, :1024]
    acc = m
    for _ in range(32):
        acc = jnp.tanh(acc @ m / 1024.0)
    return jnp.sum(a) + 0.0 * jnp.sum(acc)


@pytest.mark.parametrize("side_stream", [False, True], ids=["current", "side-stream"])
def test_jax_reads_only_after_pending_torch_writes(side_stream):
    t = torch.zeros(1 << 20, device="cuda")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())  # t's zero-fill comes first
    with torch.cuda.stream(stream):
        torch.cuda._sleep(_SPIN_CYCLES)
        t.fill_(1.0)  # queued behind the spin on Torch's current stream
        a = to_jax(t)
    assert float(jnp.sum(a)) == float(1 << 20)


def test_torch_reads_only_after_pending_jax_writes():
    a = jnp.ones((1 << 20,), jnp.float32)
    out = to_torch(_heavy_sum(a))
    assert out.item() == float(1 << 20)


def test_torch_may_overwrite_an_input_once_a_result_is_back():
    t = torch.ones(1 << 20, device="cuda")
    out = to_torch(_heavy_sum(to_jax(t)))  # Torch's stream now waits for JAX's read of t
    t.fill_(-1.0)
    torch.cuda.synchronize()
    assert out.item() == float(1 << 20)


def test_jax_view_keeps_the_torch_block_out_of_the_caching_allocator():
    t = torch.full((1 << 20,), 3.0, device="cuda")
    ptr = t.data_ptr()
    a = to_jax(t)
    del t
    gc.collect()
    churn = [torch.full((1 << 20,), -1.0, device="cuda") for _ in range(8)]
    assert all(c.data_ptr() != ptr for c in churn)
    assert float(jnp.sum(a)) == 3.0 * (1 << 20)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_each_side_stays_on_the_same_device_index():
    t = torch.arange(1024, dtype=torch.float32, device="cuda:1")
    a = to_jax(t)
    assert a.devices() == {jax.devices("gpu")[1]}
    back = to_torch(a * 2)
    assert back.device == torch.device("cuda:1")
    np.testing.assert_array_equal(back.cpu().numpy(), 2 * np.arange(1024, dtype=np.float32))


def test_jax_does_not_preallocate_the_gpu():
    assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
    jnp.ones(1024).block_until_ready()
    free, total = torch.cuda.mem_get_info()
    assert free > 0.5 * total, (free, total)


def test_cpu_work_in_a_gpu_process_runs_on_cpu_with_the_reference_kernels():
    """The parity report's --device cpu on the GPU machine: the bridge op on CPU tensors and the
    Flax twin under ``jax_work_on("cpu")`` resolve to the xla backend (Pallas compiled for the GPU
    on CPU arrays failed here with "Only interpret mode is supported on CPU backend")."""
    from bridge import jax_device, jax_work_on, mxfp8_linear
    from jax_side.linear import quantize_activation
    from jax_side.mxfp8 import resolve_kernels

    assert jax_device("cuda:0") == to_jax(torch.zeros(64, device="cuda:0")).devices().pop()
    assert resolve_kernels(None, "cpu").backend.value == "xla"
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(96, 64, requires_grad=True)
    mxfp8_linear(x, w).sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    with jax_work_on("cpu"):
        q = quantize_activation(jnp.ones((32, 64), jnp.float32))
        assert q.rowwise_data.devices() == {jax_device("cpu")}
