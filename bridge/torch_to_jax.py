"""Torch -> JAX: the checks and the import behind ``bridge.to_jax`` (rules: ``bridge/dlpack.py``).

A tensor is shared only if JAX can alias it as it is: contiguous, aligned (``bridge.capabilities``),
not requiring grad, of a dtype in the table (``bridge.dtypes``). Otherwise ``ZeroCopyError`` names
the tensor and the fix, unless the caller asked for a copy. CUDA tensors go through the fast path
(``bridge.jax_fastpath``) where it applies, else through ``jax.dlpack.from_dlpack``.
"""

from __future__ import annotations

import jax
import torch

from bridge import jax_fastpath
from bridge.capabilities import Fp8Transport, required_alignment, supported_device, transport_for
from bridge.capsule import DLDataTypeCode, relabel
from bridge.devices import device_ctx, start_jax_backend
from bridge.dtypes import DtypeSpec, ZeroCopyError, check_x64, spec_for_torch

__all__ = ["describe_tensor", "import_tensor"]


def describe_tensor(t: torch.Tensor) -> str:
    align = required_alignment(t.device.type) if supported_device(t.device.type) else None
    mod = f", data_ptr % {align} = {t.data_ptr() % align}" if align else ""
    return (
        f"torch.Tensor(shape={tuple(t.shape)}, dtype={t.dtype}, strides={tuple(t.stride())}, "
        f"storage_offset={t.storage_offset()}, device={t.device}{mod})"
    )


def _check_shareable(t: torch.Tensor) -> None:
    if t.requires_grad:
        raise ZeroCopyError(
            f"to_jax: {describe_tensor(t)} requires grad; JAX takes no part in Torch autograd. "
            f"Pass t.detach() (same memory), or use bridge.mxfp8_linear for a differentiable op"
        )
    if not t.is_contiguous():
        raise ZeroCopyError(
            f"to_jax: {describe_tensor(t)} is not contiguous, so JAX cannot alias it. "
            f"Pass copy=True to accept a copy, or share a contiguous tensor"
        )
    align = required_alignment(t.device.type)
    if t.data_ptr() % align:
        raise ZeroCopyError(
            f"to_jax: {describe_tensor(t)} starts {t.data_ptr() % align} bytes past a "
            f"{align}-byte boundary; JAX on {t.device.type} only aliases {align}-byte aligned "
            f"buffers (on CPU it would copy silently). Pass copy=True to accept a copy, or "
            f"allocate the buffer so that each shared view starts at an aligned offset"
        )


def _check_torch_input(t: object, what: str) -> DtypeSpec:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if not supported_device(t.device.type):
        raise ZeroCopyError(f"{what}: {describe_tensor(t)} is on an unsupported device type")
    spec = spec_for_torch(t.dtype)
    check_x64(spec, what)
    return spec


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """Same memory, row-major strides (Torch lets size-1 dims carry any stride)."""
    rev, acc = [], 1
    for d in reversed(t.shape):
        rev.append(acc)
        acc *= max(d, 1)
    strides = tuple(reversed(rev))
    return t if t.stride() == strides else t.as_strided(t.shape, strides)


class TorchExport:
    """What ``jax.dlpack.from_dlpack`` reads: ``t.__dlpack__`` called with t's device current
    (JAX calls it after its own device work, which can leave another GPU current), and for the
    uint8 transport the capsule relabeled to the 1-byte float ``code``."""

    def __init__(self, t: torch.Tensor, code: DLDataTypeCode | None = None):
        self._t, self._code = t, code

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._t.__dlpack_device__()

    def __dlpack__(self, *, stream: int | None = None, **_unused: object) -> object:
        with device_ctx(self._t.device):
            capsule = self._t.__dlpack__(stream=stream)  # legacy capsule: fixed struct layout
        if self._code is not None:
            relabel(capsule, self._code)
        return capsule


def public_import(t: torch.Tensor, code: DLDataTypeCode | None) -> jax.Array:
    """``jax.dlpack.from_dlpack`` of a checked, canonical tensor (bytes relabeled to ``code``)."""
    src = TorchExport(t) if code is None else TorchExport(t.view(torch.uint8), code)
    with device_ctx(t.device):
        return jax.dlpack.from_dlpack(src, copy=False)


def import_tensor(t: torch.Tensor, copy: bool, transport: Fp8Transport | str | None) -> jax.Array:
    """``to_jax(t, copy=copy, transport=transport)`` without the crossing count."""
    spec = _check_torch_input(t, "to_jax")
    start_jax_backend()
    if copy:
        t = t.detach().clone(memory_format=torch.contiguous_format)
    _check_shareable(t)
    t = _canonical(t)
    mode = transport_for(spec, transport, "torch_to_jax")
    code = None if mode in (None, Fp8Transport.NATIVE) else spec.byte_code
    a = jax_fastpath.import_cuda(t, code) if t.device.type == "cuda" else None
    if a is None:
        a = public_import(t, code)
    if a.dtype != spec.jax or (t.numel() and a.unsafe_buffer_pointer() != t.data_ptr()):
        raise ZeroCopyError(
            f"to_jax: JAX imported {describe_tensor(t)} as {a.dtype} at a different address "
            f"(transport {mode}); this JAX/Torch pair does not alias it. Pass copy=True"
        )
    return a
