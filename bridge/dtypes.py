"""The dtype table both bridge directions convert with, and ``ZeroCopyError``.

One row per dtype: its Torch and JAX names, the DLPack code a 1-byte float is relabeled to on the
uint8 transport (``bridge.capsule``), and whether JAX needs ``jax_enable_x64`` to hold it without
narrowing (a narrowing would be a silent copy, so the bridge refuses instead).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.typing import DTypeLike

from bridge.capsule import DLDataTypeCode

__all__ = ["DtypeSpec", "ZeroCopyError", "jax_dtype_for", "torch_dtype_for"]


class ZeroCopyError(BufferError):
    """The bridge cannot share this buffer without a copy (and no copy was requested)."""


class DtypeSpec(NamedTuple):
    torch: torch.dtype
    jax: np.dtype
    byte_code: DLDataTypeCode | None  # DLPack code of a 1-byte float (uint8 transport), else None
    needs_x64: bool


def _spec(td: torch.dtype, jd: DTypeLike, code: DLDataTypeCode | None = None,
          x64: bool = False) -> DtypeSpec:
    return DtypeSpec(td, np.dtype(jd), code, x64)


SPECS: tuple[DtypeSpec, ...] = (
    _spec(torch.float32, jnp.float32),
    _spec(torch.bfloat16, jnp.bfloat16),
    _spec(torch.float16, jnp.float16),
    _spec(torch.float64, jnp.float64, x64=True),
    _spec(torch.uint8, jnp.uint8),
    _spec(torch.int8, jnp.int8),
    _spec(torch.int32, jnp.int32),
    _spec(torch.int64, jnp.int64, x64=True),
    _spec(torch.bool, jnp.bool_),
    _spec(torch.float8_e4m3fn, jnp.float8_e4m3fn, DLDataTypeCode.FLOAT8_E4M3FN),
    _spec(torch.float8_e5m2, jnp.float8_e5m2, DLDataTypeCode.FLOAT8_E5M2),
    _spec(torch.float8_e8m0fnu, jnp.float8_e8m0fnu, DLDataTypeCode.FLOAT8_E8M0FNU),
)
_BY_TORCH = {s.torch: s for s in SPECS}
_BY_JAX = {s.jax: s for s in SPECS}
BYTE_FLOATS = tuple(s for s in SPECS if s.byte_code is not None)


def jax_dtype_for(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype a Torch dtype maps to (the table the bridge converts with)."""
    return spec_for_torch(dtype).jax


def torch_dtype_for(dtype: DTypeLike) -> torch.dtype:
    """The Torch dtype a JAX dtype maps to (the same table)."""
    return spec_for_jax(dtype).torch


def _supported_list() -> str:
    return ", ".join(str(s.torch).removeprefix("torch.") for s in SPECS)


def check_x64(spec: DtypeSpec, what: str) -> None:
    """Refuse a 64-bit dtype while JAX would narrow it to 32 bits."""
    if spec.needs_x64 and not jax.config.read("jax_enable_x64"):
        raise ZeroCopyError(
            f"{what}: dtype {spec.torch} needs jax_enable_x64 (JAX would silently narrow it to "
            f"32 bits, a copy); enable it with jax.config.update('jax_enable_x64', True) or "
            f"cast to a 32-bit dtype first"
        )


def spec_for_torch(dtype: torch.dtype) -> DtypeSpec:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ZeroCopyError(
            f"bridge: torch dtype {dtype} is not supported; supported: {_supported_list()}"
        ) from None


def spec_for_jax(dtype: DTypeLike) -> DtypeSpec:
    try:
        return _BY_JAX[np.dtype(dtype)]
    except KeyError:
        raise ZeroCopyError(
            f"bridge: JAX dtype {dtype} is not supported; supported: {_supported_list()}"
        ) from None
