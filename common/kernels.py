"""``KernelConfig``: which kernels run the MXFP8 numerics, chosen once and passed down.

A frozen, hashable value that the user hands to the linear op, the Torch and Flax models,
``fully_shard`` and training; every JAX program that quantizes or multiplies receives it as a
static argument, so one process can run two configurations side by side (e.g. a test comparing a
fast GEMM with the exact one). ``None`` fields mean "the default for the device the work runs on",
resolved and reported by ``jax_side.mxfp8.kernels.resolve_kernels`` (DESIGN.md 7), the one
function that reads the defaults. The applications fill such ``None`` fields from the environment
variables ``MXFP8_BACKEND`` and ``MXFP8_GEMM`` first (``apps.environment.kernels``).

- ``backend`` (``Backend``): who quantizes. ``xla``: the project's pure-JAX reference, bit-exact
  on every platform. ``pallas``: the project's fused GPU kernel, byte-identical to ``xla``.
  ``te``: Transformer Engine for JAX (GPU machines with the ``[te]`` extra), which also runs its
  own GEMM. Or a backend registered at run time (``jax_side.mxfp8.backends.register_backend``,
  which names it here through ``Backend.register``).
- ``gemm`` (``GemmImpl``): how the ``xla``/``pallas`` backends multiply MXFP8 operands.
  ``dequant_dot``: exact dequantize to fp32 and an fp32 dot at HIGHEST precision (the reference,
  bit-reproducible, the CPU default). ``dequant_bf16_dot``: dequantize to bf16 (exact: an E4M3
  element times its E8M0 scale is a bf16 value wherever it is finite and above bf16's subnormal
  floor) and a bf16 tensor-core dot with fp32 accumulation; differs from the reference only in
  how the fp32 sum is accumulated. ``scaled_matmul``: ``jax.nn.scaled_matmul`` (GPU only).
  ``fp8_blocked``: Hopper's FP8 tensor cores on operands re-blocked to 1x128 blocks and 128x128
  tiles (DESIGN.md 11; ``jax_side.mxfp8.reblock``): cuBLASLt's block-scaled FP8 GEMM on a
  compute capability 9.x GPU (an XLA FFI call built on first use, ``jax_side.mxfp8.cublaslt``),
  the exact fp32 dot of the same re-blocked values on the CPU; close to, not equal to, the MXFP8
  values. ``fp8_blocked_pallas``: the same with a Pallas (Triton) kernel instead of cuBLASLt.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from common.enums import Parseable

__all__ = ["Backend", "GemmImpl", "KernelConfig", "Platform"]


_REGISTERED: dict[str, Backend] = {}  # name -> registered Backend, in registration order


class Backend(Parseable, enum.Enum, what="MXFP8 backend", aliases=_REGISTERED,
              hint=" (or None for the automatic default)"):
    """An MXFP8 backend's name: the built-in members below, or a name registered at run time.

    ``Backend.register("mine")`` makes ``Backend("mine")`` / ``Backend.parse("mine")`` one more
    ``Backend`` (same type, hashable, compared by identity, pickled by its name), so
    ``KernelConfig(backend="mine")`` and ``MXFP8_BACKEND=mine`` take it; it is made through
    ``enum``'s documented ``_missing_`` hook and is not listed by iterating ``Backend`` (the
    built-ins; ``Backend.known()`` lists both). ``jax_side.mxfp8.backends.register_backend``
    calls it, with the backend's implementation; tests register and unregister fakes this way.
    """

    XLA = "xla"
    PALLAS = "pallas"
    TE = "te"

    @classmethod
    def _missing_(cls, value: object) -> Backend | None:
        return _REGISTERED.get(value) if isinstance(value, str) else None

    @classmethod
    def known(cls) -> tuple[Backend, ...]:
        """The built-in members, then the registered names in registration order."""
        return (*cls, *_REGISTERED.values())

    @classmethod
    def register(cls, name: str) -> Backend:
        """A new ``Backend`` named ``name`` (lower case letters, digits, ``_``; not taken)."""
        if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            raise ValueError(
                f"Backend.register: name {name!r} must be lower case letters, digits and '_', "
                "starting with a letter, e.g. 'mykernels' (it is what MXFP8_BACKEND= takes)"
            )
        if name in [b.value for b in cls.known()]:
            raise ValueError(
                f"Backend.register: MXFP8 backend {name!r} exists already; unregister it first "
                "or pick another name"
            )
        member = object.__new__(cls)  # a pseudo-member, as enum.Flag makes its combinations
        member._name_, member._value_ = name.upper(), name
        _REGISTERED[name] = member
        return member

    @classmethod
    def unregister(cls, backend: Backend) -> None:
        """Forget a registered name (the built-in members stay)."""
        if _REGISTERED.get(backend.value) is not backend:
            raise ValueError(
                f"Backend.unregister: {backend!r} is not a registered name (registered: "
                f"{sorted(_REGISTERED)}); the built-in members cannot be removed"
            )
        del _REGISTERED[backend.value]


class Platform(Parseable, enum.StrEnum, what="platform",
               hint=" (or None for JAX's default device)"):
    """Where the work runs: the device kind its tensors live on. A ``StrEnum``, so it equals
    its value (``Platform.CPU == "cpu"``), as the plain strings it replaces did."""

    CPU = "cpu"
    GPU = "gpu"


class GemmImpl(Parseable, enum.Enum, what="matmul impl", hint=" (or None for the default)"):
    DEQUANT_DOT = "dequant_dot"
    DEQUANT_BF16_DOT = "dequant_bf16_dot"
    SCALED_MATMUL = "scaled_matmul"
    FP8_BLOCKED = "fp8_blocked"
    FP8_BLOCKED_PALLAS = "fp8_blocked_pallas"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """See the module docstring. Strings are accepted and parsed: ``KernelConfig("xla")``."""

    backend: Backend | None = None
    gemm: GemmImpl | None = None

    def __post_init__(self) -> None:
        if self.backend is not None:
            object.__setattr__(self, "backend", Backend.parse(self.backend))
        if self.gemm is not None:
            object.__setattr__(self, "gemm", GemmImpl.parse(self.gemm))
        if self.backend is Backend.TE and self.gemm is not None:
            raise ValueError(
                f"KernelConfig(backend='te', gemm={self.gemm.value!r}): the te backend runs "
                "Transformer Engine's own GEMM; drop gemm, or pick backend='xla' or 'pallas' to "
                "choose a GEMM implementation"
            )

    @classmethod
    def reference(cls) -> KernelConfig:
        """The exact, bit-reproducible configuration: ``xla`` quantize, fp32 dequantize + dot."""
        return cls(Backend.XLA, GemmImpl.DEQUANT_DOT)
