"""Devices and streams on both sides: starting JAX, the JAX twin of a Torch device, current streams.

Rule 3 of the ownership note (``bridge/dlpack.py``) -- CUDA ordering through the DLPack
``stream`` argument -- is carried out with the helpers here: ``device_ctx`` makes the tensor's
device current so that Torch's "current stream" means that device's, and ``torch_stream_for`` is
the stream number ``to_torch`` hands to ``jax.Array.__dlpack__``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import torch

__all__ = ["jax_device", "jax_work_on", "start_jax_backend"]

_JAX_STARTED = False


def start_jax_backend() -> list:
    """Start JAX's backend (once) without moving Torch's current CUDA device, and without its
    GPU memory preallocation (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless set); JAX's devices.

    Seen on a 2-GPU H200 host (torch 2.11, jax 0.11.2): starting JAX's GPU backend left the CUDA
    runtime's current device at the last GPU it set up, so afterwards ``device="cuda"`` meant
    cuda:1 for Torch and ``Tensor.__dlpack__`` refused cuda:0 tensors ("Can't export tensors on a
    different CUDA device index"). The bridge starts JAX through here before its first transfer;
    a process that touches JAX before Torch allocates should call it too.
    """
    global _JAX_STARTED
    if not _JAX_STARTED:
        # JAX reads it (no API sets it) when it creates its GPU client, so only before that:
        # JAX must not preallocate most of a GPU Torch shares (ownership rule 5, bridge/dlpack.py)
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        prev = torch.cuda.current_device() if torch.cuda.is_available() else None
        jax.devices()
        if prev is not None and torch.cuda.current_device() != prev:
            torch.cuda.set_device(prev)
        _JAX_STARTED = True
    return jax.devices()


def device_ctx(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current, so Torch's "current stream" in ``__dlpack__`` is that device's."""
    if device.type != "cuda" or torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def torch_stream_for(dl_device: tuple[int, int]) -> int | None:
    """The DLPack ``stream`` argument naming Torch's current stream of a DLPack device (None off
    CUDA): the stream a producer must order its buffer before."""
    kind, index = dl_device
    if int(kind) != 2:  # kDLCUDA
        return None
    s = torch.cuda.current_stream(index).cuda_stream
    return 1 if s == 0 else s  # DLPack: 1 = legacy default stream, 0 is disallowed


def jax_device(device: torch.device | str) -> jax.Device:
    """The JAX device that holds what ``to_jax`` imports from Torch tensors on ``device``."""
    start_jax_backend()
    device = torch.device(device)
    if device.type == "cpu":
        return jax.devices("cpu")[0]
    if device.type != "cuda":
        raise ValueError(
            f"jax_device: Torch device {device} has no JAX counterpart here; use 'cpu' or 'cuda'"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if index >= len(gpus):
        raise ValueError(
            f"jax_device: Torch device cuda:{index} but JAX sees {len(gpus)} GPU(s) "
            f"({jax.devices()}); install a CUDA jaxlib and keep CUDA_VISIBLE_DEVICES the same"
        )
    return gpus[index]


def jax_work_on(device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Context manager: new JAX work (and the kernels ``resolve_kernels`` picks) goes to the JAX
    twin of Torch ``device``. Needed for Flax/JAX code on CPU tensors in a GPU process."""
    return jax.default_device(jax_device(device))
