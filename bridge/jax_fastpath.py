"""The CUDA fast path of ``to_jax``: JAX's private capsule import (``jax._src``), isolated here.

Cost on CUDA (host time per crossing; the H200 figures are in BENCHMARKS.md): the public
``jax.dlpack.from_dlpack`` spends most of its ~100 us in Python -- ``Tensor.__dlpack__(stream=)``
builds a ``torch.cuda.ExternalStream`` and a fresh event every call, and ``jnp.asarray`` re-wraps
the result. ``import_cuda`` does the same steps with cached objects: one ``ExternalStream`` of
JAX's ready-events stream and one reusable event per device (re-recorded on Torch's current
stream, waited on by JAX's stream: ordering rule 3 of the ownership note in ``bridge/dlpack.py``,
unchanged), then ``__dlpack__(stream=-1)`` (no second sync) and JAX's own capsule import with that
stream. Same semantics as the public path: same buffer, same dtype, same ordering.

Every use of ``jax._src`` by the transfers is here (tests/test_architecture.py lists the modules
allowed to use it). Where those internals are missing or differ from the version this was written
for, the bridge falls back to the public path and never fails because of them:

- missing at import (a module, ``dlpack_managed_tensor_to_buffer`` or ``get_backend`` absent):
  the fast path is off for the process;
- a device JAX's backend cannot name (no CUDA backend, no ready-events stream): that device uses
  the public path;
- changed behaviour (the import raises, or returns something other than a view of the tensor):
  that call falls back, and the fast path is off for the rest of the process.

``status()`` says whether the fast path is on and, if not, why; ``reset()`` looks the internals up
again (after JAX was patched, as the tests do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import torch

from bridge.capsule import DLDataTypeCode, relabel
from bridge.devices import device_ctx

__all__ = ["FastPathStatus", "import_cuda", "reset", "status"]

_KDLCUDA = 2


class Internals(NamedTuple):
    """The private JAX callables the fast path needs."""

    get_backend: Callable  # jax._src.xla_bridge.get_backend
    import_capsule: Callable  # jax._src.lib._jax.dlpack_managed_tensor_to_buffer
    takes_device_type: bool  # jaxlib extension >= 467 also takes the DLPack device type


class FastPathStatus(NamedTuple):
    enabled: bool
    reason: str  # why it is off ("" when on)


class _CudaSync(NamedTuple):
    """Cached per device: JAX's device, its ready-events stream and one reusable event."""

    jax_device: object
    stream_ptr: int
    stream: torch.cuda.ExternalStream
    event: torch.cuda.Event


@dataclasses.dataclass
class _State:
    internals: Internals | None
    reason: str
    syncs: dict[int, _CudaSync | None] = dataclasses.field(default_factory=dict)


def resolve_internals() -> Internals | str:
    """The private callables, or a sentence saying which one this JAX does not have."""
    try:
        from jax._src import xla_bridge
        from jax._src.lib import _jax, jaxlib_extension_version
    except ImportError as e:
        return f"JAX's private modules are not importable here ({e})"
    import_capsule = getattr(_jax, "dlpack_managed_tensor_to_buffer", None)
    get_backend = getattr(xla_bridge, "get_backend", None)
    for name, fn in (("jax._src.lib._jax.dlpack_managed_tensor_to_buffer", import_capsule),
                     ("jax._src.xla_bridge.get_backend", get_backend)):
        if not callable(fn):
            return f"{name} is missing in jax {jax.__version__}"
    assert get_backend is not None and import_capsule is not None  # both callable: checked above
    return Internals(get_backend, import_capsule, int(jaxlib_extension_version) >= 467)


def _fresh_state() -> _State:
    found = resolve_internals()
    if isinstance(found, str):
        return _State(None, found)
    return _State(found, "")


_STATE = _fresh_state()


def reset() -> FastPathStatus:
    """Look the internals up again and forget the per-device caches."""
    global _STATE
    _STATE = _fresh_state()
    return status()


def status() -> FastPathStatus:
    return FastPathStatus(_STATE.internals is not None, _STATE.reason)


def _disable(reason: str) -> None:
    _STATE.internals, _STATE.reason = None, reason


def _cuda_sync(internals: Internals, index: int) -> _CudaSync | None:
    """None where JAX's backend has no usable twin of cuda:index (that device: public path)."""
    if index in _STATE.syncs:
        return _STATE.syncs[index]
    sync = None
    try:
        jdev = internals.get_backend("cuda").device_from_local_hardware_id(index)
        ptr = jdev.get_stream_for_external_ready_events()
    except Exception:  # noqa: BLE001 -- no CUDA backend, or other internals: the public path
        ptr = None
    if ptr:
        with torch.cuda.device(index):
            sync = _CudaSync(jdev, ptr, torch.cuda.ExternalStream(ptr), torch.cuda.Event())
    _STATE.syncs[index] = sync
    return sync


def import_cuda(t: torch.Tensor, code: DLDataTypeCode | None) -> jax.Array | None:
    """``to_jax`` of a checked, canonical CUDA tensor (its bytes relabeled to ``code`` when that
    is given: the uint8 transport); None where the fast path does not apply (then the caller takes
    the public path)."""
    internals = _STATE.internals
    if internals is None:
        return None
    sync = _cuda_sync(internals, t.device.index)
    if sync is None:
        return None
    with device_ctx(t.device):
        sync.event.record(torch.cuda.current_stream(t.device))  # producer: Torch's stream
        sync.stream.wait_event(sync.event)  # consumer: JAX's stream waits (DLPack rule)
        capsule = (t if code is None else t.view(torch.uint8)).__dlpack__(stream=-1)
    if code is not None:
        relabel(capsule, code)
    args = (capsule, sync.jax_device, sync.stream_ptr, False)
    try:
        a = internals.import_capsule(*args, _KDLCUDA) if internals.takes_device_type else (
            internals.import_capsule(*args)
        )
    except Exception as e:  # noqa: BLE001 -- changed internals: the public path from now on
        _disable(f"the private capsule import failed ({type(e).__name__}: {e})")
        return None
    if not _is_view_of(a, t):
        _disable(f"the private capsule import returned a {type(a).__name__} that is not a view of "
                 f"the tensor (shape, address)")
        return None
    return a


def _is_view_of(a: object, t: torch.Tensor) -> bool:
    if not isinstance(a, jax.Array) or tuple(a.shape) != tuple(t.shape):
        return False
    return t.numel() == 0 or a.unsafe_buffer_pointer() == t.data_ptr()
