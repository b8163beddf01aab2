"""Kernel backend choice for ``jax_side.mxfp8`` (DESIGN.md 7): explicit, reported, never silent.

- ``xla``: the project's pure-JAX implementation; bit-exact to the contract on every platform.
- ``te``: Transformer Engine for JAX, only where it is importable (GPU machines with the ``[te]``
  extra). Its MXFP8 custom calls are only valid on compute capability >= 10; elsewhere the adapter
  must not route MXFP8 to them (see ``te_backend``).

``backend=None`` resolves to the automatic default, which is ``xla`` unless the environment
variable ``MXFP8_BACKEND`` names another; ``backend_report()`` says what was chosen and why.
"""

from __future__ import annotations

import enum
import os
from typing import NamedTuple

__all__ = ["Backend", "BackendChoice", "backend_report", "resolve_backend"]

ENV_VAR = "MXFP8_BACKEND"


class Backend(enum.Enum):
    XLA = "xla"
    TE = "te"

    @classmethod
    def parse(cls, value: Backend | str) -> Backend:
        if isinstance(value, Backend):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown MXFP8 backend {value!r}: expected one of "
                f"{[b.value for b in cls]} (or None for the automatic default)"
            ) from None


class BackendChoice(NamedTuple):
    backend: Backend
    reason: str


def resolve_backend(backend: Backend | str | None = None) -> BackendChoice:
    """Resolve a requested backend to the one that runs, with the reason. Raises if unusable."""
    if backend is None:
        env = os.environ.get(ENV_VAR)
        if env:
            choice = resolve_backend(env)
            return BackendChoice(choice.backend, f"{ENV_VAR}={env!r}; {choice.reason}")
        return BackendChoice(
            Backend.XLA, "automatic default: project pure-JAX path (bit-exact on every device)"
        )
    requested = Backend.parse(backend)
    if requested is Backend.XLA:
        return BackendChoice(Backend.XLA, "requested explicitly")
    from jax_side.mxfp8 import te_backend

    te_backend.require_available()
    return BackendChoice(Backend.TE, "requested explicitly; " + te_backend.describe())


def backend_report(backend: Backend | str | None = None) -> dict[str, str]:
    """What ``backend`` resolves to on this process, and why (for logs, notebooks, reports)."""
    import jax

    choice = resolve_backend(backend)
    devices = jax.devices()
    return {
        "backend": choice.backend.value,
        "reason": choice.reason,
        "jax_platform": devices[0].platform,
        "jax_device": str(devices[0]),
    }
