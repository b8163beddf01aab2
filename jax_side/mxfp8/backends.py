"""Kernel backend choice for ``jax_side.mxfp8`` (DESIGN.md 7): explicit, reported, never silent.

- ``xla``: the project's pure-JAX implementation; bit-exact to the contract on every platform.
- ``pallas``: the project's fused Pallas kernels (``pallas_backend``), byte-identical to ``xla``;
  compiled through Triton on a CUDA GPU, run in (slow) interpret mode elsewhere.
- ``te``: Transformer Engine for JAX (``te_backend``), only where it is importable (GPU machines
  with the ``[te]`` extra). It runs one of two TE paths (:class:`TEPath`): TE's MXFP8 CUDA custom
  calls where TE itself reports MXFP8 support on a compute capability 10.x device, and TE's own
  pure-JAX quantizer and GEMM (custom calls off for exactly those primitives, for the duration of
  the call) everywhere else. On an H200 (9.0) TE's custom-call quantize returned wrong bytes
  without raising and its GEMM failed in cuBLAS, so nothing here ever routes there.

The decision is a pure function, :func:`decide_backend`, of the request and a :class:`TEProbe`
(TE importable?, TE's own MXFP8 support answer, compute capability), so it is tested on CPU
without TE. ``backend=None`` resolves to the automatic default: the environment variable
``MXFP8_BACKEND`` if set, else TE's kernels where they are supported, else ``pallas`` on a CUDA
GPU, else ``xla``. It never picks TE's pure-JAX path (slower than ``xla`` and not the contract
on its own).
``backend_report()`` says what was chosen and why.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NamedTuple

from common.kernels import Backend
from jax_side.mxfp8 import te_probe
from jax_side.mxfp8.te_probe import NO_TE, TEPath, TEProbe

__all__ = [
    "default_platform",
    "Backend",
    "BackendChoice",
    "TEPath",
    "TEProbe",
    "backend_module",
    "backend_report",
    "decide_backend",
    "resolve_backend",
]

ENV_VAR = "MXFP8_BACKEND"

# Compute-capability majors on which TE's MXFP8 custom calls are used (DESIGN.md 7: native MXFP8
# is 10.x). TE reports support from 9.9 upward; 12.x is left on the pure-JAX path until verified.
TE_KERNEL_CC_MAJORS = (10,)


class BackendChoice(NamedTuple):
    backend: Backend
    reason: str
    te_path: TEPath | None = None  # set iff backend is TE


def _cc_text(cc: int | None) -> str:
    return "no CUDA GPU" if cc is None else f"compute capability {cc // 10}.{cc % 10}"


def _kernels_ok(probe: TEProbe) -> bool:
    return (
        probe.importable
        and probe.mxfp8_supported
        and probe.compute_capability is not None
        and probe.compute_capability // 10 in TE_KERNEL_CC_MAJORS
    )


def _why_no_kernels(probe: TEProbe) -> str:
    if not probe.importable:
        return f"TE-JAX is not importable ({probe.detail})"
    if probe.compute_capability is None:
        return "no CUDA GPU"
    if probe.mxfp8_supported:
        return f"TE reports MXFP8 support, but {_cc_text(probe.compute_capability)} is not 10.x"
    detail = f" ({probe.detail})" if probe.detail else ""
    return f"TE reports MXFP8 unsupported on {_cc_text(probe.compute_capability)}{detail}"


def _te_path_reason(probe: TEProbe) -> str:
    if _kernels_ok(probe):
        return f"TE reports MXFP8 support on {_cc_text(probe.compute_capability)}: TE kernels"
    return (
        _why_no_kernels(probe)
        + ": TE's pure-JAX quantizer and GEMM, custom calls off for those calls"
    )


def decide_backend(requested: Backend | str | None, probe: TEProbe) -> BackendChoice:
    """The backend that runs for ``requested`` given ``probe``; pure, raises if unusable.

    requested None is the automatic default (the environment variable is handled by
    :func:`resolve_backend`, not here).
    """
    if requested is None:
        if _kernels_ok(probe):
            return BackendChoice(
                Backend.TE, "automatic default; " + _te_path_reason(probe), TEPath.KERNELS
            )
        if probe.compute_capability is not None:
            return BackendChoice(
                Backend.PALLAS,
                f"automatic default on a CUDA GPU: the project's Pallas kernels compiled with "
                f"Triton ({_why_no_kernels(probe)}; TE kernels not used)",
            )
        return BackendChoice(
            Backend.XLA,
            f"automatic default: project pure-JAX path ({_why_no_kernels(probe)}; "
            "TE kernels not used)",
        )
    requested = Backend.parse(requested)
    if requested is Backend.XLA:
        return BackendChoice(Backend.XLA, "requested explicitly")
    if requested is Backend.PALLAS:
        where = (
            f"compiled with Triton on {_cc_text(probe.compute_capability)}"
            if probe.compute_capability is not None
            else "interpret mode (no CUDA GPU in JAX): the kernel code evaluated by XLA, slow"
        )
        return BackendChoice(Backend.PALLAS, f"requested explicitly; {where}")
    if not probe.importable:
        raise RuntimeError(
            "MXFP8 backend 'te' was requested but Transformer Engine for JAX "
            f"(transformer_engine.jax) is not importable here ({probe.detail}). Install it on a "
            "GPU machine with `pip install .[te]` (see docs/te_backend.md), or use backend='xla' "
            "(the default), the project's bit-exact pure-JAX path"
        )
    if probe.compute_capability is None:
        raise RuntimeError(
            "MXFP8 backend 'te' was requested but JAX sees no CUDA GPU; TE-JAX runs on NVIDIA "
            "GPUs only. Use backend='xla' (the default) on this platform"
        )
    path = TEPath.KERNELS if _kernels_ok(probe) else TEPath.PURE_JAX
    return BackendChoice(Backend.TE, "requested explicitly; " + _te_path_reason(probe), path)


def _probe_for(requested: Backend | str | None) -> TEProbe:
    """Probe TE only when it can matter: 'te' requested, or the automatic default on a GPU."""
    if requested is not None:
        requested = Backend.parse(requested)
        if requested is Backend.XLA:
            return NO_TE
        if requested is Backend.PALLAS:  # where it runs, without importing TE
            return NO_TE._replace(compute_capability=te_probe.jax_compute_capability())
    return te_probe.probe()  # imports TE lazily, and only on a GPU


def default_platform() -> str:
    """The platform ("cpu" or "gpu") new JAX work lands on: ``jax.default_device`` if set (e.g.
    ``with jax.default_device(jax.devices("cpu")[0])`` on a GPU machine), else JAX's first
    device."""
    import jax

    dev = jax.config.jax_default_device
    if dev is None:
        return jax.devices()[0].platform
    return jax.devices(dev)[0].platform if isinstance(dev, str) else dev.platform


def resolve_backend(backend: Backend | str | None = None) -> BackendChoice:
    """Resolve a requested backend to the one that runs, with the reason. Raises if unusable."""
    if backend is None:
        env = os.environ.get(ENV_VAR)
        if env:
            choice = resolve_backend(env)
            return choice._replace(reason=f"{ENV_VAR}={env!r}; {choice.reason}")
    return decide_backend(backend, _probe_for(backend))


def backend_report(backend: Backend | str | None = None) -> dict[str, str]:
    """What ``backend`` resolves to on this process, and why (for logs, notebooks, reports)."""
    import jax

    choice = resolve_backend(backend)
    devices = jax.devices()
    probed = backend is None or Backend.parse(backend) is Backend.TE
    probe = _probe_for(None) if probed else None
    return {
        "backend": choice.backend.value,
        "reason": choice.reason,
        "te_path": "" if choice.te_path is None else choice.te_path.value,
        "te_importable": "not probed" if probe is None else str(probe.importable),
        "te_detail": "" if probe is None else probe.detail,
        "te_mxfp8_supported": "not probed" if probe is None else str(probe.mxfp8_supported),
        "compute_capability": (
            "not probed" if probe is None else _cc_text(probe.compute_capability)
        ),
        "jax_platform": devices[0].platform,
        "jax_device": str(devices[0]),
    }


# Backend -> the module that implements it. Imported on first use (TE-JAX is heavy and GPU-only),
# and named here rather than imported so that no backend module imports the dispatcher back.
_MODULES: dict[Backend, str] = {
    Backend.XLA: "jax_side.mxfp8.xla_backend",
    Backend.PALLAS: "jax_side.mxfp8.pallas_backend",
    Backend.TE: "jax_side.mxfp8.te_backend",
}


def backend_module(backend: Backend) -> ModuleType:
    """The module implementing ``backend`` (see ``_MODULES``)."""
    try:
        name = _MODULES[backend]
    except KeyError:
        raise ValueError(
            f"MXFP8 backend {backend.value!r} has no implementation in this build; expected one "
            f"of {[b.value for b in _MODULES]}"
        ) from None
    return importlib.import_module(name)
