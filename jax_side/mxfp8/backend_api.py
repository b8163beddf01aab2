"""The declared interface of an MXFP8 kernel backend (DESIGN.md 7): operations and capabilities.

Every backend (``xla_backend``, ``pallas_backend``, ``te_backend``) defines one
:class:`KernelBackend` object; ``backends.backend_impl`` maps the ``common.kernels.Backend`` enum
to it, and ``kernels.resolve_kernels`` decides which backend runs which operation. The public
functions (``quantize``, ``matmul``, the slice building blocks) validate their input and call
these operations, so every argument here is already checked: a 2-D (M, K) bf16/fp32 ``x`` with
M, K multiples of 32, flat slices inside their tensor, scale bytes of the layout's shapes.

Capabilities (:class:`Capabilities`) are facts, not options: the platforms a backend runs on and
how (compiled, or interpreted: the kernel code evaluated by XLA, slow, for tests), whether it has
the slice building blocks of distributed quantization, and whether it runs its own GEMM (then
``KernelConfig.gemm`` does not apply). An operation a backend lacks raises
:class:`UnsupportedOperation` naming the backend, the operation and who has it.
"""

from __future__ import annotations

import abc
import enum
from typing import NamedTuple

import jax

from common.gemm_roles import GemmRole
from common.kernels import Backend, GemmImpl, Platform
from jax_side.mxfp8.tensor import BlockAmax, MXFP8Tensor, Plane, SliceCast

__all__ = [
    "Capabilities",
    "Execution",
    "KernelBackend",
    "UnsupportedOperation",
    "default_platform",
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


def default_platform() -> Platform:
    """The platform new JAX work lands on: ``jax.default_device`` if set (e.g. ``with
    jax.default_device(jax.devices("cpu")[0])`` on a GPU machine), else JAX's first device."""
    dev = jax.config.jax_default_device
    if dev is None:
        name = jax.devices()[0].platform
    else:
        name = jax.devices(dev)[0].platform if isinstance(dev, str) else dev.platform
    return Platform.GPU if name == "gpu" else Platform.CPU


class KernelBackend(abc.ABC):
    """One MXFP8 kernel backend: its enum member, its capabilities and its operations.

    Shapes and dtypes (DESIGN.md 4): ``quantize`` gives rowwise planes of 1x32 blocks along K
    (data (M, K) e4m3, scales (M, K/32) e8m0) and colwise planes of 32x1 blocks along M (data
    (M, K) not transposed, scales (M/32, K)); a plane not asked for is None. The slice operations
    take a flat 1-D slice holding elements ``[start, start + n)`` of the row-major (M, K) tensor.
    """

    backend: Backend
    capabilities: Capabilities

    def unsupported(self, operation: str, instead: str) -> UnsupportedOperation:
        """The error for an operation this backend lacks; ``instead`` says what to use."""
        return UnsupportedOperation(
            f"MXFP8 backend {self.backend.value!r} has no {operation} ({instead}); its "
            f"capabilities: {self.capabilities}"
        )

    def check_platform(self, platform: Platform) -> Execution:
        """How this backend runs on ``platform``; UnsupportedOperation where it cannot."""
        execution = self.capabilities.execution(platform)
        if execution is None:
            where = [p.value for p, _ in self.capabilities.runs_on]
            raise UnsupportedOperation(
                f"MXFP8 backend {self.backend.value!r} does not run on {platform.value} (it runs "
                f"on {where}); use backend='xla', which runs everywhere"
            )
        return execution

    @abc.abstractmethod
    def quantize(self, x: jax.Array, *, planes: tuple[Plane, ...]) -> MXFP8Tensor:
        """The asked planes (non-empty, ``Plane`` order) of a validated (M, K) bf16/fp32 x."""

    @abc.abstractmethod
    def partial_block_amax(self, flat, shape: tuple[int, int], start: int,
                           planes: tuple[Plane, ...]) -> BlockAmax:
        """fp32 block amax of a validated slice, full scale shapes (zeros elsewhere)."""

    @abc.abstractmethod
    def scales_from_amax(self, amax: jax.Array) -> jax.Array:
        """float8_e8m0fnu scales (same shape) of validated fp32 amax."""

    @abc.abstractmethod
    def cast_slice(self, flat, shape: tuple[int, int], start: int, row_b, col_b) -> SliceCast:
        """e4m3 of a validated slice with given uint8 scale bytes (either may be None)."""

    @abc.abstractmethod
    def matmul(self, a: MXFP8Tensor, b: MXFP8Tensor, role: GemmRole,
               gemm: GemmImpl | None) -> jax.Array:
        """fp32 GEMM of one role (``common.gemm_roles``) of validated operands. ``gemm`` is the
        implementation to run, None exactly for a backend with ``own_gemm``."""
