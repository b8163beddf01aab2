"""What this Torch/JAX pair can share: buffer alignment, and how each 1-byte float crosses DLPack.

Alignment: JAX on CPU only aliases buffers aligned to 64 bytes (it copies silently otherwise);
XLA GPU kernels assume entry parameters are 16-byte aligned. The bridge checks both itself.

1-byte floats (float8_e4m3fn, float8_e5m2, float8_e8m0fnu) travel as their native DLPack dtype
where both libraries support it, else as uint8 bytes whose capsule is relabeled (``bridge.capsule``)
for the consumer; both transports are zero-copy. ``dlpack_support()`` probes which one works, once
per process, on first use (not at import, so importing ``bridge`` never starts a JAX backend).
"""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import jax
import numpy as np
import torch

from bridge.devices import start_jax_backend
from bridge.dtypes import BYTE_FLOATS, DtypeSpec

__all__ = ["DlpackSupport", "Fp8Transport", "dlpack_support", "required_alignment"]

_ALIGNMENT = {"cpu": 64, "cuda": 16}


class Fp8Transport(enum.Enum):
    """How a 1-byte float crosses DLPack: as itself, or as uint8 bytes relabeled for the consumer.

    Both are zero-copy (``bridge.capsule``); NATIVE needs both libraries to know the float8 code.
    """

    NATIVE = "native"
    UINT8 = "uint8"


def required_alignment(device_type: str) -> int:
    """Byte alignment a Torch buffer needs to be aliased by JAX on this device type."""
    return _ALIGNMENT[device_type]


def supported_device(device_type: str) -> bool:
    return device_type in _ALIGNMENT


class DlpackSupport(NamedTuple):
    """Transport per 1-byte float dtype and direction, detected once per process (on CPU)."""

    torch_to_jax: dict[torch.dtype, Fp8Transport]
    jax_to_torch: dict[torch.dtype, Fp8Transport]
    notes: dict[str, str]  # why a native path was not taken, per "<direction> <dtype>"


def _probe_torch_to_jax(spec: DtypeSpec) -> str | None:
    t = torch.zeros(64, dtype=spec.torch)
    try:
        a = jax.dlpack.from_dlpack(t, copy=False)
    except Exception as e:  # noqa: BLE001 -- any failure means "not native"; the reason is kept
        return f"{type(e).__name__}: {e}"
    if a.dtype != spec.jax or a.unsafe_buffer_pointer() != t.data_ptr():
        return f"imported as {a.dtype} at a different address"
    return None


def _probe_jax_to_torch(spec: DtypeSpec) -> str | None:
    a = jax.device_put(np.zeros(64, spec.jax), jax.devices("cpu")[0])
    try:
        t = torch.from_dlpack(a)
    except Exception as e:  # noqa: BLE001 -- any failure means "not native"; the reason is kept
        return f"{type(e).__name__}: {e}"
    if t.dtype != spec.torch or a.unsafe_buffer_pointer() != t.data_ptr():
        return f"imported as {t.dtype} at a different address"
    return None


@functools.cache
def dlpack_support() -> DlpackSupport:
    """Detect (once; on first use, not at import, so importing never starts a JAX backend)."""
    start_jax_backend()
    t2j: dict[torch.dtype, Fp8Transport] = {}
    j2t: dict[torch.dtype, Fp8Transport] = {}
    notes: dict[str, str] = {}
    for spec in BYTE_FLOATS:
        for table, probe, direction in (
            (t2j, _probe_torch_to_jax, "torch->jax"),
            (j2t, _probe_jax_to_torch, "jax->torch"),
        ):
            why = probe(spec)
            table[spec.torch] = Fp8Transport.NATIVE if why is None else Fp8Transport.UINT8
            if why is not None:
                notes[f"{direction} {spec.torch}"] = why
    return DlpackSupport(t2j, j2t, notes)


def transport_for(
    spec: DtypeSpec, requested: Fp8Transport | str | None, direction: str
) -> Fp8Transport | None:
    """How ``spec`` crosses in ``direction`` ("torch_to_jax" / "jax_to_torch"): None for a dtype
    that is not a 1-byte float, else ``requested`` if given, else what ``dlpack_support()``
    found."""
    if spec.byte_code is None:
        return None
    if requested is not None:
        return Fp8Transport(requested)
    return getattr(dlpack_support(), direction)[spec.torch]
