"""The declared interface of an MXFP8 kernel backend (DESIGN.md 7): operations, capabilities and
availability.

Every backend (``xla_backend``, ``pallas_backend``, ``te_backend``, or one registered with
``backends.register_backend``) defines one :class:`KernelBackend` object; ``backends.backend_impl``
maps a ``common.kernels.Backend`` to it, and ``kernels.resolve_kernels`` decides which backend runs
which operation. The public
functions (``quantize``, ``matmul``, the slice building blocks) validate their input and call
these operations, so every argument here is already checked: a 2-D (M, K) bf16/fp32 ``x`` with
M, K multiples of 32, flat slices inside their tensor, scale bytes of the layout's shapes.

Capabilities (:class:`Capabilities`) are facts, not options: the platforms a backend runs on and
how (compiled, or interpreted: the kernel code evaluated by XLA, slow, for tests), whether it has
the slice building blocks of distributed quantization, and whether it runs its own GEMM (then
``KernelConfig.gemm`` does not apply). An operation a backend lacks raises
:class:`UnsupportedOperation` naming the backend, the operation and who has it.

Availability (:class:`Availability`, the answer of ``KernelBackend.availability(site)``) is the
one question the resolver asks a backend: can it run work on this :class:`Site` (the platform
of the work, the CUDA GPU if any), how, and whether the automatic default may pick it
(:class:`Fit`); if not, why, in a sentence, and what to do instead. The default answer reads
``Capabilities.runs_on``; a backend whose answer depends on more (TE: its own probe) says so
itself. The resolver never names a backend to decide this (``backends.decide_backend``).
"""

from __future__ import annotations

import abc
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from common.formats import ALL_PLANES
from common.gemm_roles import GemmRole
from common.kernels import Backend, GemmImpl, Platform
from jax_side.mxfp8.tensor import BlockAmax, MXFP8Tensor, Plane, SliceCast

__all__ = [
    "Availability",
    "BackendUnavailable",
    "Capabilities",
    "Execution",
    "Fit",
    "KernelBackend",
    "Site",
    "UnsupportedOperation",
    "cc_text",
    "cuda_compute_capability",
    "default_platform",
    "site_for",
]


class Execution(enum.Enum):
    """How a backend's kernels run on a platform."""

    COMPILED = "compiled"
    INTERPRETED = "interpreted"  # Pallas interpret mode: the kernel code evaluated by XLA (slow)


class Capabilities(NamedTuple):
    """What a backend can do (see the module docstring)."""

    runs_on: tuple[tuple[Platform, Execution], ...]  # the platforms it runs on, and how
    slices: bool  # has partial_block_amax / scales_from_amax / cast_slice
    own_gemm: bool  # runs its own GEMM: KernelConfig.gemm does not apply

    def execution(self, platform: Platform) -> Execution | None:
        """How the kernels run on ``platform``; None where they cannot run at all."""
        return dict(self.runs_on).get(platform)


class UnsupportedOperation(ValueError):
    """An operation asked of a backend that does not have it (a capability it lacks)."""


class BackendUnavailable(RuntimeError):
    """A backend asked for where it cannot run (its ``Availability`` says why)."""


class Site(NamedTuple):
    """Where the work runs: what a backend's availability depends on, besides its own probes."""

    platform: Platform  # the device kind the work's tensors live on
    compute_capability: int | None  # GPU work: the CUDA GPU's, as TE encodes it (9.0 -> 90)


class Fit(enum.Enum):
    """How a backend fits work on a site."""

    DEFAULT = "default"  # it runs, and the automatic default may pick it
    ON_REQUEST = "on_request"  # it runs when asked for by name (slow, or off the contract path)
    UNUSABLE = "unusable"  # it cannot run here


_EVERYWHERE = "use backend='xla', which runs everywhere"


class Availability(NamedTuple):
    """A backend's answer for a site (module docstring); made by the three constructors below."""

    fit: Fit
    reason: str  # how it runs there, or why it cannot (a sentence, no advice)
    fix: str  # what to do instead where it cannot run ("" where it can)
    path: enum.Enum | None  # which of its paths runs, for a backend with several (TE's TEPath)

    @classmethod
    def default(cls, reason: str, path: enum.Enum | None = None) -> Availability:
        return cls(Fit.DEFAULT, reason, "", path)

    @classmethod
    def on_request(cls, reason: str, path: enum.Enum | None = None) -> Availability:
        return cls(Fit.ON_REQUEST, reason, "", path)

    @classmethod
    def unusable(cls, reason: str, fix: str = _EVERYWHERE) -> Availability:
        return cls(Fit.UNUSABLE, reason, fix, None)

    def require(self, backend: Backend, platform: Platform) -> Availability:
        """This answer, or ``BackendUnavailable`` naming the backend, the platform and why."""
        if self.fit is Fit.UNUSABLE:
            raise BackendUnavailable(
                f"MXFP8 backend {backend.value!r} was requested for work on {platform.value}, "
                f"but it cannot run here: {self.reason}. {self.fix}"
            )
        return self


def cc_text(cc: int | None) -> str:
    return "no CUDA GPU" if cc is None else f"compute capability {cc // 10}.{cc % 10}"


def cuda_compute_capability() -> int | None:
    """Compute capability of JAX's first device as TE encodes it (9.0 -> 90); None if not GPU."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    major, minor = str(getattr(device, "compute_capability", "0.0")).split(".")[:2]
    return int(major) * 10 + int(minor)


def site_for(platform: Platform) -> Site:
    """The site of work on ``platform`` in this process."""
    return Site(platform, cuda_compute_capability() if platform is Platform.GPU else None)


def default_platform() -> Platform:
    """The platform new JAX work lands on: ``jax.default_device`` if set (e.g. ``with
    jax.default_device(jax.devices("cpu")[0])`` on a GPU machine), else JAX's first device."""
    dev = jax.config.jax_default_device
    if dev is None:
        name = jax.devices()[0].platform
    else:
        name = jax.devices(dev)[0].platform if isinstance(dev, str) else dev.platform
    return Platform.GPU if name == "gpu" else Platform.CPU


def _cut(buf: jax.Array, offset: int, n: int, read_as: jnp.dtype | None) -> jax.Array:
    """``buf[offset : offset + n]``, converted to ``read_as`` (None: as it is)."""
    piece = lax.slice(buf, (offset,), (offset + n,))
    return piece if read_as is None else piece.astype(read_as)


class KernelBackend(abc.ABC):
    """One MXFP8 kernel backend: its name, capabilities, availability and operations.

    Shapes and dtypes (DESIGN.md 4): ``quantize`` gives rowwise planes of 1x32 blocks along K
    (data (M, K) e4m3, scales (M, K/32) e8m0) and colwise planes of 32x1 blocks along M (data
    (M, K) not transposed, scales (M/32, K)); a plane not asked for is None. The slice operations
    take a flat 1-D slice holding elements ``[start, start + n)`` of the row-major (M, K) tensor.
    """

    name: str  # its ``Backend``'s value: a built-in's, or the name it is registered under
    capabilities: Capabilities

    @property
    def backend(self) -> Backend:
        return Backend.parse(self.name)

    def availability(self, site: Site) -> Availability:
        """Whether this backend can run work on ``site``, how, or why not (module docstring).
        This default reads ``capabilities.runs_on``: compiled there is fit for the automatic
        default, interpreted only on request, absent unusable."""
        execution = self.capabilities.execution(site.platform)
        work = f"work on the {site.platform.name}"
        if execution is None:
            where = [p.value for p, _ in self.capabilities.runs_on]
            return Availability.unusable(f"it runs on {where} only, and this is {work}")
        if execution is Execution.INTERPRETED:
            return Availability.on_request(f"interpreted for {work} (slow)")
        return Availability.default(f"compiled for {work}")

    def facts(self, site: Site, asked: bool) -> dict[str, str]:
        """What this backend adds to ``kernel_report``: facts it gathered to answer
        ``availability(site)`` (``asked``: the resolver asked it), placeholders otherwise."""
        return {}

    def unsupported(self, operation: str, instead: str) -> UnsupportedOperation:
        """The error for an operation this backend lacks; ``instead`` says what to use."""
        return UnsupportedOperation(
            f"MXFP8 backend {self.name!r} has no {operation} ({instead}); its "
            f"capabilities: {self.capabilities}"
        )

    @abc.abstractmethod
    def quantize(self, x: jax.Array, *, planes: tuple[Plane, ...]) -> MXFP8Tensor:
        """The asked planes (non-empty, ``Plane`` order) of a validated (M, K) bf16/fp32 x."""

    @abc.abstractmethod
    def partial_block_amax(self, flat: jax.Array, shape: tuple[int, int], start: int,
                           planes: tuple[Plane, ...]) -> BlockAmax:
        """fp32 block amax of a validated slice, full scale shapes (zeros elsewhere)."""

    @abc.abstractmethod
    def scales_from_amax(self, amax: jax.Array) -> jax.Array:
        """float8_e8m0fnu scales (same shape) of validated fp32 amax."""

    @abc.abstractmethod
    def cast_slice(self, flat: jax.Array, shape: tuple[int, int], start: int,
                   row_b: jax.Array | None, col_b: jax.Array | None) -> SliceCast:
        """e4m3 of a validated slice with given uint8 scale bytes (either may be None)."""

    def partial_block_amax_at(self, buf: jax.Array, offset: int, n: int,
                              shape: tuple[int, int], start: int, planes: tuple[Plane, ...],
                              *, read_as: jnp.dtype | None = None) -> BlockAmax:
        """``partial_block_amax`` of the validated slice ``buf[offset : offset + n]``, its values
        converted to ``read_as`` first (bf16 or fp32; None: ``buf``'s own dtype). This default
        cuts the slice out and converts it (XLA fuses both and its fusions read the buffer in
        place; a custom call's operand is a buffer of its own, so a kernel gets a copy); a
        backend whose kernels can read the buffer where the slice lies overrides it
        (``pallas``), with the same result."""
        return self.partial_block_amax(_cut(buf, offset, n, read_as), shape, start, planes)

    def cast_slice_at(self, buf: jax.Array, offset: int, n: int, shape: tuple[int, int],
                      start: int, row_b: jax.Array | None, col_b: jax.Array | None,
                      *, read_as: jnp.dtype | None = None) -> SliceCast:
        """``cast_slice`` of the validated slice ``buf[offset : offset + n]`` (as
        ``partial_block_amax_at``)."""
        return self.cast_slice(_cut(buf, offset, n, read_as), shape, start, row_b, col_b)

    def cast_slice_into(self, out: jax.Array, ats: tuple[int, int], buf: jax.Array,
                        offset: int, n: int, shape: tuple[int, int], start: int,
                        row_b: jax.Array, col_b: jax.Array, *,
                        read_as: jnp.dtype | None = None) -> jax.Array:
        """The validated 1-D uint8 ``out`` with ``cast_slice_at``'s rowwise bytes at
        ``out[ats[0]:]`` and its columnwise at ``out[ats[1]:]`` (n each). This default casts,
        then updates ``out`` in place (XLA's ``dynamic_update_slice``: a copy of each plane when
        the cast is a custom call); a backend whose kernel can write into ``out`` overrides it
        (``pallas``), with the same bytes."""
        cast = self.cast_slice_at(buf, offset, n, shape, start, row_b, col_b, read_as=read_as)
        for at, codes in zip(ats, (cast.rowwise, cast.colwise), strict=True):
            assert codes is not None
            out = lax.dynamic_update_slice(
                out, lax.bitcast_convert_type(codes, jnp.uint8).reshape(-1), (at,))
        return out

    def quantize_slice_into(self, out: jax.Array, ats: tuple[int, int], buf: jax.Array,
                            offset: int, n: int, shape: tuple[int, int], start: int, *,
                            read_as: jnp.dtype | None = None) -> tuple[jax.Array, BlockAmax]:
        """(``cast_slice_into``'s ``out``, the slice's ``partial_block_amax_at``) with the scales
        made from that amax alone: the bytes where no other rank's part raises a block's amax
        (the caller knows; every block whole in the slice, or one rank). This default runs the
        two passes (amax, then the cast: the slice read twice); a backend whose kernel makes both
        from one read overrides it (``pallas``), with the same bytes."""
        amax = self.partial_block_amax_at(buf, offset, n, shape, start, ALL_PLANES,
                                          read_as=read_as)
        rs, cs = (lax.bitcast_convert_type(self.scales_from_amax(a), jnp.uint8)
                  for a in (amax.rowwise, amax.colwise))
        return self.cast_slice_into(out, ats, buf, offset, n, shape, start, rs, cs,
                                    read_as=read_as), amax

    @abc.abstractmethod
    def matmul(self, a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole,
               gemm: GemmImpl | None) -> jax.Array:
        """fp32 GEMM of one role (``common.gemm_roles``) of validated operands. ``gemm`` is the
        implementation to run, None exactly for a backend with ``own_gemm``."""

    def matmul_rounded(self, a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole,
                       gemm: GemmImpl | None, out_dtype: jnp.dtype) -> jax.Array:
        """``matmul`` rounded once to ``out_dtype`` (float32 or bfloat16). A backend whose kernel
        can write bf16 itself overrides this (the ``fp8_blocked`` GEMM does: no fp32 pass over
        its output); the result must equal ``matmul(...).astype(out_dtype)``."""
        return self.matmul(a, b, role, gemm).astype(out_dtype)
