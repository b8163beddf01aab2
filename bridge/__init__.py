"""Bridge: zero-copy DLPack between Torch and JAX, and the MXFP8 autograd op (DESIGN.md 6).

The only package that imports both torch and jax. Read the ownership note at the top of
``bridge/dlpack.py`` before sharing a buffer.
"""

from bridge.dlpack import (
    DlpackSupport,
    Fp8Transport,
    ZeroCopyError,
    dlpack_support,
    required_alignment,
    to_jax,
    to_torch,
)

__all__ = [
    "DlpackSupport",
    "Fp8Transport",
    "ZeroCopyError",
    "dlpack_support",
    "required_alignment",
    "to_jax",
    "to_torch",
]
