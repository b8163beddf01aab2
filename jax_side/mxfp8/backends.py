"""The backend table (``Backend`` -> its ``KernelBackend``) and the backend decision, a lookup.

- ``xla``: the project's pure-JAX implementation; bit-exact to the contract on every platform.
- ``pallas``: the project's fused Pallas kernels (``pallas_backend``), byte-identical to ``xla``;
  compiled through Triton on a CUDA GPU, run in (slow) interpret mode elsewhere.
- ``te``: Transformer Engine for JAX (``te_backend``), only where it is importable (GPU machines
  with the ``[te]`` extra). Its own entry decides which TE path runs (``te_probe.te_availability``):
  TE's MXFP8 CUDA custom calls only where TE itself reports MXFP8 support on a compute capability
  10.x device, TE's own pure-JAX quantizer and GEMM everywhere else.
- any backend added with :func:`register_backend` (docs/extending.md), e.g. by a test.

:func:`decide_backend` names no backend: a requested backend is looked up and asked
(``KernelBackend.availability``, the one declared question: can it run this work, how, or why
not); the automatic default is the first entry of :data:`DEFAULT_PREFERENCE` that says it is fit
for it (``Fit.DEFAULT``) -- TE's kernels where supported, else ``pallas`` on a CUDA GPU, else
``xla`` -- passing over a backend that runs its own GEMM when a GEMM implementation was chosen.
The reason says what each passed-over entry answered. The platform of the work is read by
``kernels.resolve_kernels`` (the one resolver), not here.

The table imports each built-in backend module on first use (TE-JAX is heavy and GPU-only;
Pallas is not needed on the reference path), inside one small loader per backend, so the import
graph (tests/test_architecture.py) sees every edge and no backend imports this module back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

from common.kernels import Backend
from jax_side.mxfp8.backend_api import Availability, Fit, KernelBackend, Site

__all__ = [
    "DEFAULT_PREFERENCE",
    "REFERENCE",
    "Backend",
    "BackendChoice",
    "backend_impl",
    "decide_backend",
    "register_backend",
    "registered",
    "registry_version",
    "unregister_backend",
]

# The reference: runs everywhere with every operation; it runs the slices of a backend without
# them, and CPU work in a process whose JAX default device is a GPU (kernels.resolve_kernels).
REFERENCE = Backend.XLA


class BackendChoice(NamedTuple):
    backend: Backend
    reason: str
    path: enum.Enum | None  # which of its paths runs (TE: te_probe.TEPath); None for one-path
    consulted: tuple[Backend, ...]  # the entries whose availability was asked, in order


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
_version = 0  # bumped by every (un)registration: resolutions cached before it are stale


def register_backend(name: str, load: Callable[[], KernelBackend]) -> Backend:
    """Add a backend: ``name`` becomes a ``Backend`` (``KernelConfig(backend=name)``,
    ``MXFP8_BACKEND=name``) whose implementation ``load()`` returns on first use, a
    ``KernelBackend`` whose ``name`` is ``name``. Returns the new ``Backend``. It is never an
    automatic default unless listed in ``DEFAULT_PREFERENCE``. ``load`` must succeed also where
    the backend cannot run (``kernel_report`` loads every entry): import what only runs on some
    machines inside the operations, and say where it cannot run in ``availability``, as ``te``
    does."""
    if not callable(load):
        raise TypeError(
            f"register_backend({name!r}, load): load must be a function returning the "
            f"KernelBackend (e.g. lambda: MyBackend()), got {type(load).__name__}"
        )
    global _version
    backend = Backend.register(name)
    _TABLE[backend] = load
    _version += 1
    return backend


def unregister_backend(backend: Backend | str) -> None:
    """Remove a backend added by :func:`register_backend` (the built-ins stay)."""
    global _version
    backend = Backend.parse(backend)
    Backend.unregister(backend)  # refuses the built-ins
    del _TABLE[backend]
    _version += 1


# A backend added to the project registers here, after the built-ins: one line,
# ``MINE = register_backend("mine", _mine)``, with a loader like ``_pallas`` (docs/extending.md).

# The automatic default: the first of these whose entry is fit for it on the work's site.
DEFAULT_PREFERENCE: tuple[Backend, ...] = (Backend.TE, Backend.PALLAS, Backend.XLA)


def registered() -> tuple[Backend, ...]:
    """Every backend of the table: the built-ins, then the registered ones in order."""
    return tuple(_TABLE)


def registry_version() -> int:
    """Changes whenever a backend is registered or unregistered (a cache key)."""
    return _version


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
    if impl.name != backend.value:
        raise ValueError(
            f"MXFP8 backend {backend.value!r}: its loader returned {type(impl).__name__} named "
            f"{impl.name!r}; set the class's name = {backend.value!r}"
        )
    return impl


def decide_backend(
    requested: Backend | str | None, site: Site, *, gemm_chosen: bool = False
) -> BackendChoice:
    """The backend that runs for ``requested`` on ``site``; raises ``BackendUnavailable`` naming
    the backend, the platform and why where a requested backend cannot run.

    ``requested`` None is the automatic default (module docstring); ``gemm_chosen`` (the caller
    chose a GEMM implementation) keeps it off a backend that runs its own GEMM.
    """
    if requested is not None:
        backend = Backend.parse(requested)
        found = backend_impl(backend).availability(site).require(backend, site.platform)
        return BackendChoice(backend, f"requested explicitly; {found.reason}", found.path,
                             (backend,))
    passed: list[str] = []
    for i, backend in enumerate(DEFAULT_PREFERENCE):
        impl = backend_impl(backend)
        found = impl.availability(site)
        why_not = _why_not_default(backend, found, gemm_chosen and impl.capabilities.own_gemm)
        if why_not is None:
            note = f" ({'; '.join(passed)})" if passed else ""
            return BackendChoice(backend, f"automatic default: {found.reason}{note}", found.path,
                                 DEFAULT_PREFERENCE[: i + 1])
        passed.append(why_not)
    raise RuntimeError(
        f"no MXFP8 backend of DEFAULT_PREFERENCE is fit for work on {site.platform.value}: "
        f"{'; '.join(passed)}. End DEFAULT_PREFERENCE with the reference, {REFERENCE.value!r}"
    )


def _why_not_default(backend: Backend, found: Availability, gemm_ignored: bool) -> str | None:
    """Why the automatic default passes over ``backend``; None where it takes it."""
    name = backend.value
    if found.fit is Fit.UNUSABLE:
        return f"{name} cannot run: {found.reason}"
    if found.fit is Fit.ON_REQUEST:
        return f"{name} only when asked for: {found.reason}"
    if gemm_ignored:
        return f"{name} not used: a GEMM implementation was chosen, and {name} runs its own GEMM"
    return None
