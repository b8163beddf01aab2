"""Shared helpers for the bridge tests: devices (CUDA cases are marked ``gpu``) and sample data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def sample(dtype: torch.dtype, shape=(4, 64), device="cpu", seed=0) -> torch.Tensor:
    """Deterministic values covering the dtype (e8m0: every byte but NaN; ints: full range)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype == torch.float8_e8m0fnu:
        t = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8).view(dtype)
    elif dtype in (torch.uint8, torch.int8, torch.int32, torch.int64):
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g)
        t = t.to(dtype)
    else:
        t = (torch.randn(shape, generator=g, dtype=torch.float32) * 8).to(dtype)
    return t.to(device)


def torch_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a (contiguous) tensor, for bitwise comparisons."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().copy()


def jax_bytes(a) -> np.ndarray:
    return np.asarray(a).reshape(-1).view(np.uint8).copy()
