"""The one kernel resolver (DESIGN.md 7): a ``KernelConfig`` -> the kernels that run, and why.

``resolve_kernels(config, platform)`` is the only place that reads the automatic defaults and the
environment overrides. Each ``None`` field of the frozen ``common.kernels.KernelConfig`` is
filled first from its environment variable (``MXFP8_BACKEND``, ``MXFP8_GEMM``), else from the
default for the platform the work runs on:

- backend: ``xla`` for work on the CPU; on a GPU, TE's kernels where TE reports MXFP8 support on
  a compute capability 10.x device, else ``pallas`` (``backends.decide_backend``); never TE when
  a GEMM implementation was chosen (TE runs its own GEMM);
- gemm: ``DEVICE_DEFAULTS`` (exact ``dequant_dot`` on the CPU, ``dequant_bf16_dot`` on a GPU).

Explicit fields are kept and validated (a GEMM that needs a GPU is refused on the CPU; TE, which
needs a CUDA GPU, raises where it cannot run). The result, ``ResolvedKernels``, names what runs
for every operation -- whole-tensor quantize, the slice building blocks (a backend without them,
``te``, hands them to ``xla``, the reference its edge blocks are spliced from), and the GEMM --
and is hashable: the jitted linear programs take it as a static argument, and every public
function (``quantize``, ``matmul``, the slice functions) runs exactly what it names.
``kernel_report`` says the same, with the reasons, for logs, notebooks and benchmark records.
"""

from __future__ import annotations

import enum
import functools
import os
from typing import NamedTuple

from common.kernels import Backend, GemmImpl, KernelConfig, Platform
from jax_side.mxfp8 import te_probe
from jax_side.mxfp8.backend_api import default_platform
from jax_side.mxfp8.backends import BackendChoice, backend_impl, decide_backend
from jax_side.mxfp8.te_probe import NO_TE, TEPath, TEProbe

__all__ = [
    "BACKEND_ENV_VAR",
    "DEVICE_DEFAULTS",
    "GEMM_ENV_VAR",
    "Origin",
    "ResolvedKernels",
    "default_platform",
    "kernel_report",
    "resolve_call",
    "resolve_kernels",
]

BACKEND_ENV_VAR = "MXFP8_BACKEND"
GEMM_ENV_VAR = "MXFP8_GEMM"

# The GEMM of a None field, per platform the work runs on.
DEVICE_DEFAULTS: dict[Platform, GemmImpl] = {
    Platform.CPU: GemmImpl.DEQUANT_DOT,
    Platform.GPU: GemmImpl.DEQUANT_BF16_DOT,  # tensor cores; accumulation order differs
}
_GPU_ONLY_GEMMS = (GemmImpl.SCALED_MATMUL,)


class Origin(enum.Enum):
    """Where the backend choice came from."""

    CONFIG = "config"  # KernelConfig.backend
    ENVIRONMENT = "environment"  # MXFP8_BACKEND
    AUTOMATIC = "automatic"  # the default for the platform


class ResolvedKernels(NamedTuple):
    """What runs, per operation, for work on ``platform``."""

    backend: Backend  # whole-tensor quantize
    gemm: GemmImpl | None  # None iff backend is TE (TE runs its own GEMM)
    platform: Platform
    reason: str
    slices: Backend  # partial_block_amax / scales_from_amax / cast_slice
    origin: Origin
    te_path: TEPath | None = None  # set iff backend is TE


class _Env(NamedTuple):
    backend: str  # MXFP8_BACKEND, "" if unset
    gemm: str  # MXFP8_GEMM, "" if unset


def resolve_kernels(
    config: KernelConfig | ResolvedKernels | None = None, platform: Platform | str | None = None
) -> ResolvedKernels:
    """Fill the ``None`` fields of ``config`` for ``platform`` (default: JAX's default device).

    The one function that reads the defaults and the environment (module docstring). An already
    resolved ``ResolvedKernels`` is returned as it is.
    """
    if isinstance(config, ResolvedKernels):
        if platform is not None and Platform.parse(platform) is not config.platform:
            raise ValueError(
                f"resolve_kernels: kernels resolved for {config.platform.value} work were passed "
                f"for work on {Platform.parse(platform).value}; pass the KernelConfig instead"
            )
        return config
    config = KernelConfig() if config is None else config
    if not isinstance(config, KernelConfig):
        raise TypeError(
            f"expected a common.kernels.KernelConfig, got {type(config).__name__}; e.g. "
            f"KernelConfig(backend='xla', gemm='dequant_dot')"
        )
    jax_default = default_platform()
    platform = jax_default if platform is None else Platform.parse(platform)
    env = _Env(os.environ.get(BACKEND_ENV_VAR, ""), os.environ.get(GEMM_ENV_VAR, ""))
    return _resolve(config, platform, env, jax_default)


def resolve_call(
    what: str,
    kernels: KernelConfig | ResolvedKernels | None,
    backend: Backend | str | None = None,
    gemm: GemmImpl | str | None = None,
) -> ResolvedKernels:
    """The kernels of one public call: ``kernels=``, or the shorthand keywords ``backend=`` /
    ``impl=`` (the same as ``kernels=KernelConfig(backend, gemm)``), never both."""
    if backend is not None or gemm is not None:
        if kernels is not None:
            raise TypeError(
                f"{what}: pass either kernels=KernelConfig(...) or the shorthand backend=/impl=, "
                f"not both (got kernels={kernels!r}, backend={backend!r}, impl={gemm!r})"
            )
        kernels = KernelConfig(backend, gemm)
    return resolve_kernels(kernels)


def _probe_for(requested: Backend | None, platform: Platform) -> TEProbe:
    """Probe TE only when it can matter: 'te' requested, or the automatic default on a GPU."""
    if requested is Backend.XLA or (requested is None and platform is Platform.CPU):
        return NO_TE
    if requested is Backend.PALLAS:  # where it runs, without importing TE
        return NO_TE._replace(compute_capability=te_probe.jax_compute_capability())
    return te_probe.probe()  # imports TE lazily, and only on a GPU


def _choose_backend(
    config: KernelConfig, platform: Platform, env: _Env, te_allowed: bool
) -> tuple[BackendChoice, Origin]:
    if config.backend is not None:
        return decide_backend(config.backend, _probe_for(config.backend, platform)), Origin.CONFIG
    if env.backend:
        requested = Backend.parse(env.backend)
        choice = decide_backend(requested, _probe_for(requested, platform))
        reason = f"{BACKEND_ENV_VAR}={env.backend!r}; {choice.reason}"
        return choice._replace(reason=reason), Origin.ENVIRONMENT
    if platform is Platform.CPU:
        # Work on CPU tensors (also in a process whose JAX default device is a GPU, e.g. the
        # parity report with --device cpu on the GPU machine) runs the reference kernels.
        return BackendChoice(Backend.XLA, "automatic default for work on the CPU"), Origin.AUTOMATIC
    probe = _probe_for(None, platform)
    return decide_backend(None, probe, te_allowed=te_allowed), Origin.AUTOMATIC


def _check_device(backend: Backend, platform: Platform, jax_default: Platform) -> None:
    if platform is Platform.CPU and backend is not Backend.XLA and jax_default is not Platform.CPU:
        raise ValueError(
            f"backend {backend.value!r} was asked for work on CPU tensors in a process "
            f"whose JAX default device is {jax_default.value!r}: its kernels (and Pallas's "
            "interpret-or-compile choice) follow the default device, so they would be compiled "
            "for the wrong device. Use backend='xla' (or leave it None) for CPU work here, run "
            "it under `with jax.default_device(jax.devices('cpu')[0])`, or put the tensors on "
            "the GPU"
        )
    backend_impl(backend).check_platform(platform)


def _gemm(config: KernelConfig, platform: Platform, env: _Env) -> tuple[GemmImpl, str]:
    if config.gemm is not None:
        gemm, why = config.gemm, "requested explicitly"
    elif env.gemm:
        gemm, why = GemmImpl.parse(env.gemm), f"{GEMM_ENV_VAR}={env.gemm!r}"
    else:
        gemm, why = DEVICE_DEFAULTS[platform], f"default on {platform.value}"
    if gemm in _GPU_ONLY_GEMMS and platform is not Platform.GPU:
        raise ValueError(
            f"gemm {gemm.value!r} needs a GPU (jax.nn.scaled_matmul has no CPU lowering); this "
            f"work runs on {platform.value}: use gemm='dequant_dot' (or leave it None)"
        )
    return gemm, f"gemm {gemm.value}: {why}"


@functools.lru_cache(maxsize=64)
def _resolve(
    config: KernelConfig, platform: Platform, env: _Env, jax_default: Platform
) -> ResolvedKernels:
    gemm_chosen = config.gemm is not None or bool(env.gemm)
    choice, origin = _choose_backend(config, platform, env, te_allowed=not gemm_chosen)
    _check_device(choice.backend, platform, jax_default)
    caps = backend_impl(choice.backend).capabilities
    reasons = [f"backend {choice.backend.value}: {choice.reason}"]
    slices = choice.backend
    if not caps.slices:
        slices = Backend.XLA
        reasons.append(
            f"slices xla: {choice.backend.value} has no slice building blocks (it quantizes whole "
            "tensors only); xla is the reference"
        )
    if caps.own_gemm:
        if config.gemm is not None:  # only reachable with MXFP8_BACKEND=te
            raise ValueError(
                f"{BACKEND_ENV_VAR}={env.backend!r} picks the {choice.backend.value} backend, "
                f"which runs its own GEMM, but the KernelConfig asks for gemm="
                f"{config.gemm.value!r}; unset {BACKEND_ENV_VAR} or drop the gemm"
            )
        ignored = f" ({GEMM_ENV_VAR}={env.gemm!r} does not apply)" if env.gemm else ""
        reasons.append(f"gemm: {choice.backend.value}'s own{ignored}")
        gemm = None
    else:
        gemm, why = _gemm(config, platform, env)
        reasons.append(why)
    return ResolvedKernels(
        choice.backend, gemm, platform, "; ".join(reasons), slices, origin, choice.te_path
    )


def kernel_report(
    config: KernelConfig | ResolvedKernels | None = None, platform: Platform | str | None = None
) -> dict[str, str]:
    """What ``config`` resolves to for work on ``platform``, and why: exactly what the public
    functions run with the same ``config`` (for logs, notebooks, benchmark records)."""
    import jax

    resolved = resolve_kernels(config, platform)
    jax_default = default_platform()
    execution = backend_impl(resolved.backend).capabilities.execution(jax_default)
    probed = resolved.backend is Backend.TE or (
        resolved.origin is Origin.AUTOMATIC and resolved.platform is Platform.GPU
    )
    probe = te_probe.probe() if probed else None
    device = jax.devices()[0]
    return {
        "backend": resolved.backend.value,
        "slices": resolved.slices.value,
        "gemm": "te" if resolved.gemm is None else resolved.gemm.value,
        "te_path": "" if resolved.te_path is None else resolved.te_path.value,
        "execution": "" if execution is None else execution.value,
        "platform": resolved.platform.value,
        "origin": resolved.origin.value,
        "kernels": resolved.reason,
        "te_importable": "not probed" if probe is None else str(probe.importable),
        "te_detail": "" if probe is None else probe.detail,
        "te_mxfp8_supported": "not probed" if probe is None else str(probe.mxfp8_supported),
        "compute_capability": (
            "not probed" if probe is None else te_probe.cc_text(probe.compute_capability)
        ),
        "jax_platform": device.platform,
        "jax_device": str(device),
    }
