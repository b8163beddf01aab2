"""Zero-copy DLPack conversion between Torch tensors and JAX arrays (DESIGN.md 6).

Ownership note (the rules every caller of this module relies on)
------------------------------------------------------------------
Names: the *Torch buffer* is the storage behind a ``torch.Tensor``; the *JAX view* is the
``jax.Array`` that ``to_jax`` returns over it (same data pointer). Likewise ``to_torch`` returns a
*Torch view* over a *JAX buffer*.

1. Zero-copy or refuse. ``to_jax`` / ``to_torch`` return an object with the same data pointer
   as the input, or raise ``ZeroCopyError`` naming the tensor (shape, dtype, strides, offset,
   device) and the fix. ``copy=True`` is the one explicit way to accept a copy; it always copies
   (the result never aliases the input).
2. Lifetime. The DLPack capsule holds a reference to the producer's buffer, so a JAX view keeps
   its Torch buffer allocated while the JAX view is alive (and vice versa). This does *not* cover
   asynchronous reads: JAX dispatches work asynchronously (on CPU too), so the Torch buffer must
   not be **overwritten or freed** until every JAX computation that reads it is done. A
   computation is done for Torch once one of its results has been brought back with ``to_torch``
   (which orders Torch's current stream after it, see 3) or after ``jax.block_until_ready`` on a
   result. Until then keep a Torch reference to the buffer and do not write to it.
   ``mxfp8_linear`` follows this rule: it converts its JAX results with ``to_torch`` before it
   drops its JAX views of Torch inputs.
3. CUDA ordering (producer before consumer) goes through the DLPack ``stream`` argument:
   ``to_jax`` lets ``jax.dlpack.from_dlpack`` pass JAX's stream to ``torch.Tensor.__dlpack__``,
   which makes that stream wait on an event recorded on Torch's current stream *of the tensor's
   device* (the bridge enters ``torch.cuda.device(t.device)``, so "current" means that device).
   ``to_torch`` passes Torch's current stream of the array's device to ``jax.Array.__dlpack__``,
   which makes it wait until the JAX buffer is ready. The result lives on the same device index
   as the input in both directions.
4. Mutation. JAX arrays are immutable by contract. Writing through a Torch view of a JAX buffer,
   or into a Torch buffer while a JAX view of it is alive and in use, is undefined behaviour for
   JAX. Buffers that Torch writes (FSDP buckets) are created by Torch and lent to JAX, not the
   reverse.
5. GPU memory. JAX must not preallocate most of the GPU in a process where Torch allocates too:
   importing ``bridge`` sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the caller set it
   (it only takes effect if JAX's GPU backend has not started yet, so import ``bridge`` early).

Alignment: JAX on CPU only aliases buffers aligned to 64 bytes (it copies silently otherwise);
XLA GPU kernels assume entry parameters are 16-byte aligned. The bridge checks both itself.

Cost on CUDA (host time per crossing; the H200 figures are in BENCHMARKS.md): the public
``jax.dlpack.from_dlpack`` spends most of its ~100 us in Python -- ``Tensor.__dlpack__(stream=)``
builds a ``torch.cuda.ExternalStream`` and a fresh event every call, and ``jnp.asarray`` re-wraps
the result. The bridge does the same steps with cached objects: one ``ExternalStream`` of JAX's
ready-events stream and one reusable event per device (re-recorded on Torch's current stream,
waited on by JAX's stream: ordering rule 3, unchanged), then ``__dlpack__(stream=-1)`` (no second
sync) and JAX's own capsule import with that stream. ``to_torch`` likewise imports the capsule of
``jax.Array.__dlpack__(stream=<Torch's current stream>)`` directly. Where JAX's internals differ
from the version this was written for, the public ``from_dlpack`` path is used (same semantics).

1-byte floats (float8_e4m3fn, float8_e5m2, float8_e8m0fnu) travel as their native DLPack dtype where
both libraries support it, else as uint8 bytes whose capsule is relabeled (``bridge.capsule``) for
the consumer; both transports are zero-copy. ``dlpack_support()`` reports which one is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import os
import time
from collections.abc import Iterator
from typing import NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bridge.capsule import DLDataTypeCode, relabel  # noqa: E402

try:  # JAX's capsule import, as jax.dlpack.from_dlpack calls it (fast path, see the module note)
    from jax._src import xla_bridge as _xla_bridge  # noqa: E402
    from jax._src.lib import _jax as _jaxlib  # noqa: E402
    from jax._src.lib import jaxlib_extension_version as _JAXLIB_EXT  # noqa: E402

    _IMPORT_CAPSULE = getattr(_jaxlib, "dlpack_managed_tensor_to_buffer", None)
except ImportError:  # pragma: no cover -- another JAX layout: the public path is used
    _IMPORT_CAPSULE, _JAXLIB_EXT, _xla_bridge = None, 0, None

__all__ = [
    "CrossingStats",
    "DlpackSupport",
    "Fp8Transport",
    "ZeroCopyError",
    "count_crossings",
    "dlpack_support",
    "jax_device",
    "jax_dtype_for",
    "torch_dtype_for",
    "jax_work_on",
    "required_alignment",
    "start_jax_backend",
    "to_jax",
    "to_torch",
]


@dataclasses.dataclass
class CrossingStats:
    """Bridge crossings counted by ``count_crossings`` (calls and host seconds per direction)."""

    to_jax: int = 0
    to_torch: int = 0
    to_jax_s: float = 0.0
    to_torch_s: float = 0.0

    @property
    def calls(self) -> int:
        return self.to_jax + self.to_torch

    @property
    def seconds(self) -> float:
        return self.to_jax_s + self.to_torch_s


_COUNTING: list[CrossingStats] = []


@contextlib.contextmanager
def count_crossings() -> Iterator[CrossingStats]:
    """Count every ``to_jax`` / ``to_torch`` call (and its host time) inside the block."""
    stats = CrossingStats()
    _COUNTING.append(stats)
    try:
        yield stats
    finally:
        _COUNTING.remove(stats)


def _counted(direction: str, fn, *args):
    """``fn(*args)``, its call and host time recorded under ``direction`` by ``count_crossings``."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        _record(direction, time.perf_counter() - t0)


def _record(direction: str, seconds: float) -> None:
    for stats in _COUNTING:
        setattr(stats, direction, getattr(stats, direction) + 1)
        setattr(stats, direction + "_s", getattr(stats, direction + "_s") + seconds)


class ZeroCopyError(BufferError):
    """The bridge cannot share this buffer without a copy (and no copy was requested)."""


class Fp8Transport(enum.Enum):
    """How a 1-byte float crosses DLPack: as itself, or as uint8 bytes relabeled for the consumer.

    Both are zero-copy (``bridge.capsule``); NATIVE needs both libraries to know the float8 code.
    """

    NATIVE = "native"
    UINT8 = "uint8"


class _DtypeSpec(NamedTuple):
    torch: torch.dtype
    jax: np.dtype
    byte_code: DLDataTypeCode | None  # DLPack code of a 1-byte float (uint8 transport), else None
    needs_x64: bool


def _spec(td, jd, code=None, x64=False) -> _DtypeSpec:
    return _DtypeSpec(td, np.dtype(jd), code, x64)


_SPECS: tuple[_DtypeSpec, ...] = (
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
_BY_TORCH = {s.torch: s for s in _SPECS}
_BY_JAX = {s.jax: s for s in _SPECS}
_BYTE_FLOATS = tuple(s for s in _SPECS if s.byte_code is not None)
_ALIGNMENT = {"cpu": 64, "cuda": 16}


def required_alignment(device_type: str) -> int:
    """Byte alignment a Torch buffer needs to be aliased by JAX on this device type."""
    return _ALIGNMENT[device_type]


def jax_dtype_for(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype a Torch dtype maps to (the table the bridge converts with)."""
    return _spec_for_torch(dtype).jax


def torch_dtype_for(dtype) -> torch.dtype:
    """The Torch dtype a JAX dtype maps to (the same table)."""
    return _spec_for_jax(dtype).torch


def _supported_list() -> str:
    return ", ".join(str(s.torch).removeprefix("torch.") for s in _SPECS)


def _x64_enabled() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def _check_x64(spec: _DtypeSpec, what: str) -> None:
    if spec.needs_x64 and not _x64_enabled():
        raise ZeroCopyError(
            f"{what}: dtype {spec.torch} needs jax_enable_x64 (JAX would silently narrow it to "
            f"32 bits, a copy); enable it with jax.config.update('jax_enable_x64', True) or "
            f"cast to a 32-bit dtype first"
        )


def _spec_for_torch(dtype: torch.dtype) -> _DtypeSpec:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ZeroCopyError(
            f"bridge: torch dtype {dtype} is not supported; supported: {_supported_list()}"
        ) from None


def _spec_for_jax(dtype) -> _DtypeSpec:
    try:
        return _BY_JAX[np.dtype(dtype)]
    except KeyError:
        raise ZeroCopyError(
            f"bridge: JAX dtype {dtype} is not supported; supported: {_supported_list()}"
        ) from None


# --------------------------------------------------------------------------- transport detection


class DlpackSupport(NamedTuple):
    """Transport per 1-byte float dtype and direction, detected once per process (on CPU)."""

    torch_to_jax: dict[torch.dtype, Fp8Transport]
    jax_to_torch: dict[torch.dtype, Fp8Transport]
    notes: dict[str, str]  # why a native path was not taken, per "<direction> <dtype>"


def _probe_torch_to_jax(spec: _DtypeSpec) -> str | None:
    t = torch.zeros(64, dtype=spec.torch)
    try:
        a = jax.dlpack.from_dlpack(t, copy=False)
    except Exception as e:  # noqa: BLE001 -- any failure means "not native"; the reason is kept
        return f"{type(e).__name__}: {e}"
    if a.dtype != spec.jax or a.unsafe_buffer_pointer() != t.data_ptr():
        return f"imported as {a.dtype} at a different address"
    return None


def _probe_jax_to_torch(spec: _DtypeSpec) -> str | None:
    a = jax.device_put(np.zeros(64, spec.jax), jax.devices("cpu")[0])
    try:
        t = torch.from_dlpack(a)
    except Exception as e:  # noqa: BLE001 -- any failure means "not native"; the reason is kept
        return f"{type(e).__name__}: {e}"
    if t.dtype != spec.torch or a.unsafe_buffer_pointer() != t.data_ptr():
        return f"imported as {t.dtype} at a different address"
    return None


_JAX_STARTED = False


def start_jax_backend() -> list:
    """Start JAX's backend (once) without moving Torch's current CUDA device; JAX's devices.

    Seen on a 2-GPU H200 host (torch 2.11, jax 0.11.2): starting JAX's GPU backend left the CUDA
    runtime's current device at the last GPU it set up, so afterwards ``device="cuda"`` meant
    cuda:1 for Torch and ``Tensor.__dlpack__`` refused cuda:0 tensors ("Can't export tensors on a
    different CUDA device index"). The bridge starts JAX through here before its first transfer;
    a process that touches JAX before Torch allocates should call it too.
    """
    global _JAX_STARTED
    if not _JAX_STARTED:
        prev = torch.cuda.current_device() if torch.cuda.is_available() else None
        jax.devices()
        if prev is not None and torch.cuda.current_device() != prev:
            torch.cuda.set_device(prev)
        _JAX_STARTED = True
    return jax.devices()


@functools.cache
def dlpack_support() -> DlpackSupport:
    """Detect (once; on first use, not at import, so importing never starts a JAX backend)."""
    start_jax_backend()
    t2j, j2t, notes = {}, {}, {}
    for spec in _BYTE_FLOATS:
        for table, probe, direction in (
            (t2j, _probe_torch_to_jax, "torch->jax"),
            (j2t, _probe_jax_to_torch, "jax->torch"),
        ):
            why = probe(spec)
            table[spec.torch] = Fp8Transport.NATIVE if why is None else Fp8Transport.UINT8
            if why is not None:
                notes[f"{direction} {spec.torch}"] = why
    return DlpackSupport(t2j, j2t, notes)


def _transport(spec, requested, table_name: str) -> Fp8Transport | None:
    if spec.byte_code is None:
        return None
    if requested is not None:
        return Fp8Transport(requested)
    return getattr(dlpack_support(), table_name)[spec.torch]


# --------------------------------------------------------------------------- torch -> jax


def describe_tensor(t: torch.Tensor) -> str:
    align = _ALIGNMENT.get(t.device.type)
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
    align = _ALIGNMENT[t.device.type]
    if t.data_ptr() % align:
        raise ZeroCopyError(
            f"to_jax: {describe_tensor(t)} starts {t.data_ptr() % align} bytes past a "
            f"{align}-byte boundary; JAX on {t.device.type} only aliases {align}-byte aligned "
            f"buffers (on CPU it would copy silently). Pass copy=True to accept a copy, or "
            f"allocate the buffer so that each shared view starts at an aligned offset"
        )


def _check_torch_input(t, what: str) -> _DtypeSpec:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in _ALIGNMENT:
        raise ZeroCopyError(f"{what}: {describe_tensor(t)} is on an unsupported device type")
    spec = _spec_for_torch(t.dtype)
    _check_x64(spec, what)
    return spec


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """Same memory, row-major strides (Torch lets size-1 dims carry any stride)."""
    strides, acc = [], 1
    for d in reversed(t.shape):
        strides.append(acc)
        acc *= max(d, 1)
    strides = tuple(reversed(strides))
    return t if t.stride() == strides else t.as_strided(t.shape, strides)


class _TorchExport:
    """What ``jax.dlpack.from_dlpack`` reads: ``t.__dlpack__`` called with t's device current
    (JAX calls it after its own device work, which can leave another GPU current), and for the
    uint8 transport the capsule relabeled to the 1-byte float ``code``."""

    def __init__(self, t: torch.Tensor, code: DLDataTypeCode | None = None):
        self._t, self._code = t, code

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()

    def __dlpack__(self, *, stream=None, **_unused):
        with _device_ctx(self._t.device):
            capsule = self._t.__dlpack__(stream=stream)  # legacy capsule: fixed struct layout
        if self._code is not None:
            relabel(capsule, self._code)
        return capsule


def _device_ctx(device: torch.device):
    """Make ``device`` current, so Torch's "current stream" in ``__dlpack__`` is that device's."""
    if device.type != "cuda" or torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def jax_device(device: torch.device | str) -> jax.Device:
    """The JAX device that holds what ``to_jax`` imports from Torch tensors on ``device``."""
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


def jax_work_on(device: torch.device | str):
    """Context manager: new JAX work (and the kernels ``resolve_kernels`` picks) goes to the JAX
    twin of Torch ``device``. Needed for Flax/JAX code on CPU tensors in a GPU process."""
    return jax.default_device(jax_device(device))


class _CudaSync(NamedTuple):
    """Cached per (Torch device, JAX device): JAX's ready-events stream and one reusable event."""

    jax_device: object
    stream_ptr: int
    stream: torch.cuda.ExternalStream
    event: torch.cuda.Event


@functools.cache
def _cuda_sync(index: int) -> _CudaSync | None:
    """None where the fast path does not apply (no matching JAX GPU, or other JAX internals)."""
    if _IMPORT_CAPSULE is None:
        return None
    try:
        backend = _xla_bridge.get_backend("cuda")
        jdev = backend.device_from_local_hardware_id(index)
        ptr = jdev.get_stream_for_external_ready_events()
    except Exception:  # noqa: BLE001 -- any failure: use the public path
        return None
    if not ptr:
        return None
    with torch.cuda.device(index):
        return _CudaSync(jdev, ptr, torch.cuda.ExternalStream(ptr), torch.cuda.Event())


def _fast_cuda_import(t: torch.Tensor, code: DLDataTypeCode | None):
    """``to_jax`` of a checked, canonical CUDA tensor with cached stream objects; None if the
    fast path is unavailable here."""
    sync = _cuda_sync(t.device.index)
    if sync is None:
        return None
    with _device_ctx(t.device):
        sync.event.record(torch.cuda.current_stream(t.device))  # producer: Torch's stream
        sync.stream.wait_event(sync.event)  # consumer: JAX's stream waits (DLPack rule)
        capsule = (t if code is None else t.view(torch.uint8)).__dlpack__(stream=-1)
    if code is not None:
        relabel(capsule, code)
    if _JAXLIB_EXT >= 467:
        return _IMPORT_CAPSULE(capsule, sync.jax_device, sync.stream_ptr, False, 2)  # kDLCUDA
    return _IMPORT_CAPSULE(capsule, sync.jax_device, sync.stream_ptr, False)


def to_jax(
    t: torch.Tensor, *, copy: bool = False, transport: Fp8Transport | str | None = None
) -> jax.Array:
    """A ``jax.Array`` over the same memory as ``t`` (same data pointer), on t's device.

    Any shape; dtypes from the bridge's table (float32, bfloat16, float16, uint8, int8, int32, bool,
    float8_e4m3fn, float8_e5m2, float8_e8m0fnu; float64/int64 with jax_enable_x64). Refuses
    (``ZeroCopyError``) non-contiguous, misaligned or grad-requiring tensors unless ``copy=True``.
    ``transport`` forces how 1-byte floats travel (default: ``dlpack_support()``). Read the
    ownership note at the top of this module before overwriting or freeing ``t``.
    """
    if not _COUNTING:
        return _to_jax(t, copy, transport)
    return _counted("to_jax", _to_jax, t, copy, transport)


def _to_jax(t, copy, transport) -> jax.Array:
    spec = _check_torch_input(t, "to_jax")
    start_jax_backend()
    if copy:
        t = t.detach().clone(memory_format=torch.contiguous_format)
    _check_shareable(t)
    t = _canonical(t)
    mode = _transport(spec, transport, "torch_to_jax")
    code = None if mode in (None, Fp8Transport.NATIVE) else spec.byte_code
    a = _fast_cuda_import(t, code) if t.device.type == "cuda" else None
    if a is None:
        src = _TorchExport(t) if code is None else _TorchExport(t.view(torch.uint8), code)
        with _device_ctx(t.device):
            a = jax.dlpack.from_dlpack(src, copy=False)
    if a.dtype != spec.jax or (t.numel() and a.unsafe_buffer_pointer() != t.data_ptr()):
        raise ZeroCopyError(
            f"to_jax: JAX imported {describe_tensor(t)} as {a.dtype} at a different address "
            f"(transport {mode}); this JAX/Torch pair does not alias it. Pass copy=True"
        )
    return a


# --------------------------------------------------------------------------- jax -> torch


def _describe_array(a: jax.Array) -> str:
    return f"jax.Array(shape={a.shape}, dtype={a.dtype}, sharding={a.sharding})"


def _check_jax_input(a, what: str) -> _DtypeSpec:
    if isinstance(a, jax.core.Tracer):
        raise TypeError(
            f"{what}: got a JAX tracer ({a.aval}); DLPack needs a concrete array, so call it "
            f"outside jax.jit / jax.grad"
        )
    if not isinstance(a, jax.Array):
        raise TypeError(f"{what}: expected a jax.Array, got {type(a).__name__}")
    if a.is_deleted():
        raise ZeroCopyError(f"{what}: {_describe_array(a)} was deleted (donated?)")
    if len(a.sharding.device_set) != 1:
        raise ZeroCopyError(
            f"{what}: {_describe_array(a)} spans {len(a.sharding.device_set)} devices; DLPack "
            f"shares one buffer. Convert one shard (a.addressable_shards[i].data) at a time"
        )
    spec = _spec_for_jax(a.dtype)
    _check_x64(spec, what)
    return spec


def _torch_stream_for(dl_device) -> int | None:
    kind, index = dl_device
    if int(kind) != 2:  # kDLCUDA
        return None
    s = torch.cuda.current_stream(index).cuda_stream
    return 1 if s == 0 else s  # DLPack: 1 = legacy default stream, 0 is disallowed


def to_torch(
    a: jax.Array, *, copy: bool = False, transport: Fp8Transport | str | None = None
) -> torch.Tensor:
    """A ``torch.Tensor`` over the same memory as the single-device array ``a``.

    Same dtype table as ``to_jax``. The tensor is contiguous, on a's device, and Torch's current
    stream waits for ``a`` to be ready. ``copy=True`` returns a Torch-owned copy instead.
    """
    if not _COUNTING:
        return _to_torch(a, copy, transport)
    return _counted("to_torch", _to_torch, a, copy, transport)


def _to_torch(a, copy, transport) -> torch.Tensor:
    spec = _check_jax_input(a, "to_torch")
    start_jax_backend()
    mode = _transport(spec, transport, "jax_to_torch")
    # the capsule, exported with Torch's current stream waiting for ``a`` (DLPack rule)
    capsule = a.__dlpack__(stream=_torch_stream_for(a.__dlpack_device__()))
    if mode in (None, Fp8Transport.NATIVE):
        t = torch.utils.dlpack.from_dlpack(capsule)
    else:
        relabel(capsule, DLDataTypeCode.UINT)
        t = torch.utils.dlpack.from_dlpack(capsule).view(spec.torch)
    if t.dtype != spec.torch or (t.numel() and a.unsafe_buffer_pointer() != t.data_ptr()):
        raise ZeroCopyError(
            f"to_torch: Torch imported {_describe_array(a)} as {t.dtype} at a different address "
            f"(transport {mode}); pass copy=True"
        )
    return t.clone() if copy else t
