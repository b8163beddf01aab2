"""JAX -> Torch: the checks and the export behind ``bridge.to_torch`` (rules: ``bridge/dlpack.py``).

A concrete single-device array of a dtype in the table (``bridge.dtypes``) is exported with Torch's
current stream of its device as the DLPack ``stream``, so that stream waits until the JAX buffer is
ready (ordering rule 3). 1-byte floats on the uint8 transport are relabeled to uint8 for Torch and
re-viewed as their float8 dtype (same bytes, same pointer).
"""

from __future__ import annotations

import jax
import torch

from bridge.capabilities import Fp8Transport, transport_for
from bridge.capsule import DLDataTypeCode, relabel
from bridge.devices import start_jax_backend, torch_stream_for
from bridge.dtypes import DtypeSpec, ZeroCopyError, check_x64, spec_for_jax

__all__ = ["describe_array", "export_array"]


def describe_array(a: jax.Array) -> str:
    return f"jax.Array(shape={a.shape}, dtype={a.dtype}, sharding={a.sharding})"


def _check_jax_input(a: object, what: str) -> DtypeSpec:
    if isinstance(a, jax.core.Tracer):
        raise TypeError(
            f"{what}: got a JAX tracer ({a.aval}); DLPack needs a concrete array, so call it "
            f"outside jax.jit / jax.grad"
        )
    if not isinstance(a, jax.Array):
        raise TypeError(f"{what}: expected a jax.Array, got {type(a).__name__}")
    if a.is_deleted():
        raise ZeroCopyError(f"{what}: {describe_array(a)} was deleted (donated?)")
    if len(a.sharding.device_set) != 1:
        raise ZeroCopyError(
            f"{what}: {describe_array(a)} spans {len(a.sharding.device_set)} devices; DLPack "
            f"shares one buffer. Convert one shard (a.addressable_shards[i].data) at a time"
        )
    spec = spec_for_jax(a.dtype)
    check_x64(spec, what)
    return spec


def export_array(a: jax.Array, copy: bool, transport: Fp8Transport | str | None) -> torch.Tensor:
    """``to_torch(a, copy=copy, transport=transport)`` without the crossing count."""
    spec = _check_jax_input(a, "to_torch")
    start_jax_backend()
    mode = transport_for(spec, transport, "jax_to_torch")
    # the capsule, exported with Torch's current stream waiting for ``a`` (DLPack rule)
    capsule = a.__dlpack__(stream=torch_stream_for(a.__dlpack_device__()))
    if mode in (None, Fp8Transport.NATIVE):
        t = torch.utils.dlpack.from_dlpack(capsule)
    else:
        relabel(capsule, DLDataTypeCode.UINT)
        t = torch.utils.dlpack.from_dlpack(capsule).view(spec.torch)
    if t.dtype != spec.torch or (t.numel() and a.unsafe_buffer_pointer() != t.data_ptr()):
        raise ZeroCopyError(
            f"to_torch: Torch imported {describe_array(a)} as {t.dtype} at a different address "
            f"(transport {mode}); pass copy=True"
        )
    return t.clone() if copy else t
