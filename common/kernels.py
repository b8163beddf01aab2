"""``KernelConfig``: which kernels run the MXFP8 numerics, chosen once and passed down.

A frozen, hashable value that the user hands to the linear op, the Torch and Flax models,
``fully_shard`` and training; every JAX program that quantizes or multiplies receives it as a
static argument, so one process can run two configurations side by side (e.g. a test comparing a
fast GEMM with the exact one). ``None`` fields mean "the default for the device the work runs on",
resolved and reported by ``jax_side.mxfp8.kernels.resolve_kernels`` (DESIGN.md 7), the one
function that reads the defaults and the environment variables ``MXFP8_BACKEND`` and
``MXFP8_GEMM`` (which override only such ``None`` fields).

- ``backend`` (``Backend``): who quantizes. ``xla``: the project's pure-JAX reference, bit-exact
  on every platform. ``pallas``: the project's fused GPU kernel, byte-identical to ``xla``.
  ``te``: Transformer Engine for JAX (GPU machines with the ``[te]`` extra), which also runs its
  own GEMM.
- ``gemm`` (``GemmImpl``): how the ``xla``/``pallas`` backends multiply MXFP8 operands.
  ``dequant_dot``: exact dequantize to fp32 and an fp32 dot at HIGHEST precision (the reference,
  bit-reproducible, the CPU default). ``dequant_bf16_dot``: dequantize to bf16 (exact: an E4M3
  element times its E8M0 scale is a bf16 value wherever it is finite and above bf16's subnormal
  floor) and a bf16 tensor-core dot with fp32 accumulation; differs from the reference only in
  how the fp32 sum is accumulated. ``scaled_matmul``: ``jax.nn.scaled_matmul`` (GPU only).
"""

from __future__ import annotations

import dataclasses
import enum

from common.enums import parse_enum

__all__ = ["Backend", "GemmImpl", "KernelConfig", "Platform"]


class Backend(enum.Enum):
    XLA = "xla"
    PALLAS = "pallas"
    TE = "te"

    @classmethod
    def parse(cls, value: Backend | str) -> Backend:
        return parse_enum(
            cls, value, what="MXFP8 backend", hint=" (or None for the automatic default)"
        )


class Platform(enum.StrEnum):
    """Where the work runs: the device kind its tensors live on. A ``StrEnum``, so it equals
    its value (``Platform.CPU == "cpu"``), as the plain strings it replaces did."""

    CPU = "cpu"
    GPU = "gpu"

    @classmethod
    def parse(cls, value: Platform | str) -> Platform:
        return parse_enum(cls, value, what="platform", hint=" (or None for JAX's default device)")


class GemmImpl(enum.Enum):
    DEQUANT_DOT = "dequant_dot"
    DEQUANT_BF16_DOT = "dequant_bf16_dot"
    SCALED_MATMUL = "scaled_matmul"

    @classmethod
    def parse(cls, value: GemmImpl | str) -> GemmImpl:
        return parse_enum(cls, value, what="matmul impl", hint=" (or None for the default)")


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
