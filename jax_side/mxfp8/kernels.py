"""Resolve a ``KernelConfig`` to the kernels that run on a device, with the reason (DESIGN.md 7).

``resolve_kernels(config, platform)`` fills each ``None`` field of the frozen
``common.kernels.KernelConfig``: first from its environment-variable override (``MXFP8_BACKEND``,
``MXFP8_GEMM``), else from the default for the platform in ``DEVICE_DEFAULTS``. Explicit fields
are kept (and validated: a GEMM that needs a GPU is refused on the CPU). The result,
``ResolvedKernels``, is hashable and is what the jitted linear programs take as a static argument.
``kernel_report`` says what runs and why, for logs, notebooks and benchmark records.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

from common.kernels import Backend, GemmImpl, KernelConfig
from jax_side.mxfp8.backends import backend_report, default_platform, resolve_backend

__all__ = [
    "DEVICE_DEFAULTS",
    "GEMM_ENV_VAR",
    "ResolvedKernels",
    "default_platform",
    "kernel_report",
    "resolve_kernels",
]

GEMM_ENV_VAR = "MXFP8_GEMM"

# One default per device kind. The quantize backend of a None field comes from
# ``backends.resolve_backend(None)`` on a GPU (TE's kernels where supported, else ``pallas``) and
# is ``xla`` for work on the CPU.
DEVICE_DEFAULTS: dict[str, GemmImpl] = {
    "cpu": GemmImpl.DEQUANT_DOT,
    "gpu": GemmImpl.DEQUANT_BF16_DOT,  # tensor cores; accumulation order differs (gemm.py)
}
_GPU_ONLY_GEMMS = (GemmImpl.SCALED_MATMUL,)


class ResolvedKernels(NamedTuple):
    """What runs: the quantize backend and (for xla-style backends) the GEMM implementation."""

    backend: Backend
    gemm: GemmImpl | None  # None iff backend is TE (TE runs its own GEMM)
    platform: str  # "cpu" or "gpu"
    reason: str


def _check_platform(platform: str) -> str:
    if platform not in DEVICE_DEFAULTS:
        raise ValueError(
            f"resolve_kernels: platform {platform!r} is not one of {list(DEVICE_DEFAULTS)}"
        )
    return platform


def resolve_kernels(
    config: KernelConfig | None = None, platform: str | None = None
) -> ResolvedKernels:
    """Fill the ``None`` fields of ``config`` for ``platform`` (default: JAX's default device)."""
    config = KernelConfig() if config is None else config
    if not isinstance(config, KernelConfig):
        raise TypeError(
            f"expected a common.kernels.KernelConfig, got {type(config).__name__}; e.g. "
            f"KernelConfig(backend='xla', gemm='dequant_dot')"
        )
    platform = _check_platform(platform or default_platform())
    env = (os.environ.get("MXFP8_BACKEND", ""), os.environ.get(GEMM_ENV_VAR, ""))
    return _resolve(config, platform, env, default_platform())


@functools.lru_cache(maxsize=64)
def _resolve(
    config: KernelConfig, platform: str, env: tuple[str, str], jax_default: str
) -> ResolvedKernels:
    if config.backend is None and not env[0] and platform == "cpu":
        # Work on CPU tensors (also in a process whose JAX default device is a GPU, e.g. the
        # parity report with --device cpu on the GPU machine) runs the reference kernels.
        choice = resolve_backend(Backend.XLA)
        choice = choice._replace(reason="automatic default for work on the CPU")
    else:
        choice = resolve_backend(config.backend)
    if platform == "cpu" and choice.backend is not Backend.XLA and jax_default != "cpu":
        raise ValueError(
            f"backend {choice.backend.value!r} was asked for work on CPU tensors in a process "
            f"whose JAX default device is {jax_default!r}: its kernels (and Pallas's "
            "interpret-or-compile choice) follow the default device, so they would be compiled "
            "for the wrong device. Use backend='xla' (or leave it None) for CPU work here, run "
            "it under `with jax.default_device(jax.devices('cpu')[0])`, or put the tensors on "
            "the GPU"
        )
    reasons = [f"backend {choice.backend.value}: {choice.reason}"]
    if choice.backend is Backend.TE:
        return ResolvedKernels(Backend.TE, None, platform, "; ".join(reasons + ["TE's GEMM"]))
    gemm = config.gemm
    if gemm is not None:
        reasons.append(f"gemm {gemm.value}: requested explicitly")
    elif env[1]:
        gemm = GemmImpl.parse(env[1])
        reasons.append(f"gemm {gemm.value}: {GEMM_ENV_VAR}={env[1]!r}")
    else:
        gemm = DEVICE_DEFAULTS[platform]
        reasons.append(f"gemm {gemm.value}: default on {platform}")
    if gemm in _GPU_ONLY_GEMMS and platform != "gpu":
        raise ValueError(
            f"gemm {gemm.value!r} needs a GPU (jax.nn.scaled_matmul has no CPU lowering); this "
            f"work runs on {platform}: use gemm='dequant_dot' (or leave it None)"
        )
    return ResolvedKernels(choice.backend, gemm, platform, "; ".join(reasons))


def kernel_report(config: KernelConfig | None = None, platform: str | None = None) -> dict:
    """What ``config`` resolves to on ``platform``, and why (``backend_report`` plus the GEMM)."""
    resolved = resolve_kernels(config, platform)
    report = backend_report(resolved.backend if config is not None and config.backend else None)
    report.update(
        gemm="te" if resolved.gemm is None else resolved.gemm.value,
        kernels=resolved.reason,
        platform=resolved.platform,
    )
    return report
