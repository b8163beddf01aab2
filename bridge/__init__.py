"""Bridge: zero-copy DLPack between Torch and JAX, and the MXFP8 autograd op (DESIGN.md 6).

The only library package that imports both torch and jax; it never imports ``torch_side`` (FSDP
reaches JAX through it, not the reverse). Read the ownership note at the top of
``bridge/dlpack.py`` before sharing a buffer.
"""

from bridge.capabilities import (
    DlpackSupport,
    Fp8Transport,
    dlpack_support,
    required_alignment,
)
from bridge.compile_ahead import AheadReport, compile_ahead
from bridge.crossings import CrossingStats, count_crossings
from bridge.devices import jax_device, jax_work_on, start_jax_backend
from bridge.dlpack import to_jax, to_torch
from bridge.dtypes import ZeroCopyError
from bridge.linear import MXFP8Linear, mxfp8_linear, resolve_for
from bridge.mxfp8_tensor import (
    MXFP8WeightPlanes,
    TorchMXFP8Tensor,
    to_jax_mxfp8,
    to_torch_mxfp8,
)
from bridge.shared import SharedBuffer, SharedPlane
from common.kernels import KernelConfig
from common.modes import LinearMode

__all__ = [
    "AheadReport",
    "CrossingStats",
    "DlpackSupport",
    "Fp8Transport",
    "KernelConfig",
    "LinearMode",
    "MXFP8Linear",
    "MXFP8WeightPlanes",
    "SharedBuffer",
    "SharedPlane",
    "TorchMXFP8Tensor",
    "ZeroCopyError",
    "compile_ahead",
    "count_crossings",
    "dlpack_support",
    "jax_device",
    "jax_work_on",
    "mxfp8_linear",
    "required_alignment",
    "resolve_for",
    "start_jax_backend",
    "to_jax",
    "to_jax_mxfp8",
    "to_torch",
    "to_torch_mxfp8",
]
