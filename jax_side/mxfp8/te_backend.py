"""Adapter boundary to Transformer Engine for JAX (the ``te`` backend).

This module is imported only when the ``te`` backend is requested. TE-JAX is an optional
dependency (``pip install .[te]`` on a GPU machine); it does not import on a CPU-only machine.
"""

from __future__ import annotations

import importlib.util

__all__ = ["describe", "is_available", "require_available"]


def is_available() -> bool:
    """True when ``transformer_engine.jax`` can be found (it is not imported here)."""
    try:
        return importlib.util.find_spec("transformer_engine.jax") is not None
    except (ImportError, ValueError):
        return False


def require_available() -> None:
    if not is_available():
        raise RuntimeError(
            "MXFP8 backend 'te' was requested but Transformer Engine for JAX "
            "(transformer_engine.jax) is not installed. Install it on a GPU machine with "
            "`pip install .[te]` (see docs/te_backend.md), or use backend='xla' (the default), "
            "the project's bit-exact pure-JAX path"
        )
    raise NotImplementedError(
        "MXFP8 backend 'te': transformer_engine.jax is installed, but this version of the "
        "project does not route MXFP8 to it yet; use backend='xla'"
    )


def describe() -> str:
    return "Transformer Engine for JAX"


def quantize(x, *, rowwise: bool, colwise: bool):
    require_available()
