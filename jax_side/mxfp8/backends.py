"""The backend table (``Backend`` -> its ``KernelBackend``) and the pure backend decision.

- ``xla``: the project's pure-JAX implementation; bit-exact to the contract on every platform.
- ``pallas``: the project's fused Pallas kernels (``pallas_backend``), byte-identical to ``xla``;
  compiled through Triton on a CUDA GPU, run in (slow) interpret mode elsewhere.
- ``te``: Transformer Engine for JAX (``te_backend``), only where it is importable (GPU machines
  with the ``[te]`` extra). It runs one of two TE paths (``te_probe.TEPath``), chosen by the one
  rule ``te_probe.te_choice``: TE's MXFP8 CUDA custom calls only where TE itself reports MXFP8
  support on a compute capability 10.x device, TE's own pure-JAX quantizer and GEMM everywhere
  else. Nothing here ever routes MXFP8 to TE's custom calls below 10.x.

:func:`decide_backend` is a pure function of the request and a ``TEProbe`` (TE importable?, TE's
own MXFP8 support answer, compute capability), so its rules are tested on CPU without TE. The
automatic default (``requested=None``) is TE's kernels where they are supported, else ``pallas``
on a CUDA GPU, else ``xla``; it never picks TE's pure-JAX path (slower than ``xla`` and not the
contract on its own). The environment and the platform of the work are read by
``kernels.resolve_kernels`` (the one resolver), not here.

The table imports each backend module on first use (TE-JAX is heavy and GPU-only; Pallas is not
needed on the reference path), inside one small loader per backend, so the import graph
(tests/test_architecture.py) sees every edge and no backend imports this module back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from common.kernels import Backend
from jax_side.mxfp8.backend_api import KernelBackend, default_platform
from jax_side.mxfp8.te_probe import (
    TEPath,
    TEProbe,
    cc_text,
    te_choice,
    te_kernels_ok,
    why_no_te_kernels,
)

__all__ = [
    "Backend",
    "BackendChoice",
    "TEPath",
    "TEProbe",
    "backend_impl",
    "decide_backend",
    "default_platform",
]


class BackendChoice(NamedTuple):
    backend: Backend
    reason: str
    te_path: TEPath | None = None  # set iff backend is TE


def _automatic(probe: TEProbe, te_allowed: bool) -> BackendChoice:
    why_not = why_no_te_kernels(probe)
    if te_kernels_ok(probe):
        if te_allowed:
            reason = te_choice(probe).reason
            return BackendChoice(Backend.TE, "automatic default; " + reason, TEPath.KERNELS)
        why_not = "a GEMM implementation was chosen, and TE runs its own GEMM"
    if probe.compute_capability is not None:
        return BackendChoice(
            Backend.PALLAS,
            f"automatic default on a CUDA GPU: the project's Pallas kernels compiled with "
            f"Triton ({why_not}; TE kernels not used)",
        )
    return BackendChoice(
        Backend.XLA, f"automatic default: project pure-JAX path ({why_not}; TE kernels not used)"
    )


def decide_backend(
    requested: Backend | str | None, probe: TEProbe, *, te_allowed: bool = True
) -> BackendChoice:
    """The backend that runs for ``requested`` given ``probe``; pure, raises if unusable.

    requested None is the automatic default; ``te_allowed=False`` keeps it off ``te`` (the caller
    chose a GEMM implementation, which TE's own GEMM would ignore).
    """
    if requested is None:
        return _automatic(probe, te_allowed)
    requested = Backend.parse(requested)
    if requested is Backend.XLA:
        return BackendChoice(Backend.XLA, "requested explicitly")
    if requested is Backend.PALLAS:
        where = (
            f"compiled with Triton on {cc_text(probe.compute_capability)}"
            if probe.compute_capability is not None
            else "interpret mode (no CUDA GPU in JAX): the kernel code evaluated by XLA, slow"
        )
        return BackendChoice(Backend.PALLAS, f"requested explicitly; {where}")
    choice = te_choice(probe)  # raises where TE cannot run
    return BackendChoice(Backend.TE, "requested explicitly; " + choice.reason, choice.path)


def _xla() -> KernelBackend:
    from jax_side.mxfp8.xla_backend import BACKEND

    return BACKEND


def _pallas() -> KernelBackend:
    from jax_side.mxfp8.pallas_backend import BACKEND

    return BACKEND


def _te() -> KernelBackend:
    from jax_side.mxfp8.te_backend import BACKEND

    return BACKEND


# Backend -> loader of the object implementing it (backend_api.KernelBackend).
_TABLE: dict[Backend, Callable[[], KernelBackend]] = {
    Backend.XLA: _xla,
    Backend.PALLAS: _pallas,
    Backend.TE: _te,
}


def backend_impl(backend: Backend | str) -> KernelBackend:
    """The ``KernelBackend`` implementing ``backend`` (see ``_TABLE``)."""
    backend = Backend.parse(backend)
    try:
        loader = _TABLE[backend]
    except KeyError:
        raise ValueError(
            f"MXFP8 backend {backend.value!r} has no implementation in this build; expected one "
            f"of {[b.value for b in _TABLE]}"
        ) from None
    impl = loader()
    assert impl.backend is backend, (impl.backend, backend)
    return impl
