"""Bridge: zero-copy DLPack between Torch and JAX, and the MXFP8 autograd op (DESIGN.md 6).

The only library package that imports both torch and jax; it never imports ``torch_side`` (FSDP
reaches JAX through it, not the reverse). Read the ownership note at the top of
``bridge/dlpack.py`` before sharing a buffer.
"""

import os

# Ownership rule 5 (bridge/dlpack.py): before any bridge module can start JAX's GPU backend.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from bridge.capabilities import (  # noqa: E402
    DlpackSupport,
    Fp8Transport,
    dlpack_support,
    required_alignment,
)
from bridge.compile_ahead import AheadReport, compile_ahead  # noqa: E402
from bridge.crossings import CrossingStats, count_crossings  # noqa: E402
from bridge.devices import jax_device, jax_work_on, start_jax_backend  # noqa: E402
from bridge.dlpack import to_jax, to_torch  # noqa: E402
from bridge.dtypes import ZeroCopyError  # noqa: E402
from bridge.linear import MXFP8Linear, mxfp8_linear, resolve_for  # noqa: E402
from bridge.mxfp8_tensor import (  # noqa: E402
    MXFP8WeightPlanes,
    TorchMXFP8Tensor,
    to_jax_mxfp8,
    to_torch_mxfp8,
)
from bridge.shared import SharedBuffer, SharedPlane  # noqa: E402
from common.kernels import KernelConfig  # noqa: E402
from common.modes import LinearMode  # noqa: E402

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
