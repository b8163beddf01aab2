"""The one kernel resolver (DESIGN.md 7): a ``KernelConfig`` -> the kernels that run, and why.

``resolve_kernels(config, platform)`` is the only place that reads the automatic defaults. Each
``None`` field of the frozen ``common.kernels.KernelConfig`` is filled from the default for the
platform the work runs on (the library reads no environment: the applications fill a config's
``None`` fields from ``MXFP8_BACKEND`` / ``MXFP8_GEMM`` first, ``apps.environment.kernels``):

- backend: the first entry of ``backends.DEFAULT_PREFERENCE`` that says it is fit for the work
  (``backends.decide_backend``, a table lookup): ``xla`` for work on the CPU; on a GPU, TE's
  kernels where TE reports MXFP8 support on a compute capability 10.x device, else ``pallas``;
  never a backend that runs its own GEMM (TE) when a GEMM implementation was chosen;
- gemm: ``DEVICE_DEFAULTS`` (exact ``dequant_dot`` on the CPU, ``dequant_bf16_dot`` on a GPU).

Explicit fields are kept and validated (a GEMM that needs a GPU is refused on the CPU; a backend
that says it cannot run the work -- TE without a CUDA GPU -- raises with its reason). The result,
``ResolvedKernels``, names what runs for every operation -- whole-tensor quantize, the slice
building blocks (a backend without them, ``te``, hands them to the reference ``xla``, which its
edge blocks are spliced from), and the GEMM --
and is hashable: the jitted linear programs take it as a static argument, and every public
function (``quantize``, ``matmul``, the slice functions) runs exactly what it names.
``kernel_report`` says the same, with the reasons, for logs, notebooks and benchmark records.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, NamedTuple

import jax

from common.kernels import Backend, GemmImpl, KernelConfig, Platform
from jax_side.mxfp8.backend_api import default_platform, site_for
from jax_side.mxfp8.backends import (
    REFERENCE,
    BackendChoice,
    backend_impl,
    decide_backend,
    registered,
    registry_version,
)

__all__ = [
    "DEVICE_DEFAULTS",
    "Origin",
    "ResolvedKernels",
    "default_platform",
    "kernel_report",
    "placement",
    "resolve_call",
    "resolve_kernels",
]


# The GEMM of a None field, per platform the work runs on.
DEVICE_DEFAULTS: dict[Platform, GemmImpl] = {
    Platform.CPU: GemmImpl.DEQUANT_DOT,
    Platform.GPU: GemmImpl.DEQUANT_BF16_DOT,  # tensor cores; accumulation order differs
}
_GPU_ONLY_GEMMS = (GemmImpl.SCALED_MATMUL,)


class Origin(enum.Enum):
    """Where the backend choice came from."""

    CONFIG = "config"  # KernelConfig.backend
    AUTOMATIC = "automatic"  # the default for the platform


class ResolvedKernels(NamedTuple):
    """What runs, per operation, for work on ``platform``."""

    backend: Backend  # whole-tensor quantize
    gemm: GemmImpl | None  # None iff the backend runs its own GEMM (TE)
    platform: Platform
    reason: str
    slices: Backend  # partial_block_amax / scales_from_amax / cast_slice
    origin: Origin
    path: enum.Enum | None = None  # the backend's path where it has several (TE: te_probe.TEPath)
    consulted: tuple[Backend, ...] = ()  # the backends whose availability was asked



def resolve_kernels(
    config: KernelConfig | ResolvedKernels | None = None, platform: Platform | str | None = None
) -> ResolvedKernels:
    """Fill the ``None`` fields of ``config`` for ``platform`` (default: JAX's default device).

    The one function that reads the defaults (module docstring). An already resolved
    ``ResolvedKernels`` is returned as it is.
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
    return _resolve(config, platform, jax_default, registry_version())


def placement(*operands: Any) -> Platform | None:
    """``Platform.CPU`` when the concrete JAX arrays among ``operands`` (pytrees) all lie on the
    CPU: work that runs there whatever JAX's default device is. None -- JAX's default device --
    otherwise: no concrete arrays (numpy inputs, values traced inside ``jit``), arrays on a GPU
    (the default device's choice, as before: under ``jax.default_device(cpu)`` the kernels'
    interpret-or-compile choice follows it), or arrays on several platforms."""
    platforms: set[str] = set()
    for leaf in jax.tree.leaves(operands):
        if not isinstance(leaf, jax.Array):
            continue
        try:
            platforms |= {d.platform for d in leaf.devices()}
        except jax.errors.ConcretizationTypeError:  # a traced value: JAX's default device
            continue
    return Platform.CPU if platforms == {"cpu"} else None


def resolve_call(
    what: str,
    kernels: KernelConfig | ResolvedKernels | None,
    backend: Backend | str | None = None,
    gemm: GemmImpl | str | None = None,
    *,
    operands: tuple = (),
) -> ResolvedKernels:
    """The kernels of one public call: ``kernels=``, or the shorthand keywords ``backend=`` /
    ``impl=`` (the same as ``kernels=KernelConfig(backend, gemm)``), never both; resolved for the
    platform the call's ``operands`` live on (``placement``): CPU arrays in a process whose JAX
    default device is a GPU get the CPU's kernels, as the bridge's calls on CPU tensors do."""
    if backend is not None or gemm is not None:
        if kernels is not None:
            raise TypeError(
                f"{what}: pass either kernels=KernelConfig(...) or the shorthand backend=/impl=, "
                f"not both (got kernels={kernels!r}, backend={backend!r}, impl={gemm!r})"
            )
        kernels = KernelConfig(None if backend is None else Backend.parse(backend),
                               None if gemm is None else GemmImpl.parse(gemm))
    return resolve_kernels(kernels, placement(*operands))


def _choose_backend(
    config: KernelConfig, platform: Platform, gemm_chosen: bool
) -> tuple[BackendChoice, Origin]:
    site = site_for(platform)
    if config.backend is not None:
        return decide_backend(config.backend, site), Origin.CONFIG
    # Work on CPU tensors (also in a process whose JAX default device is a GPU, e.g. the parity
    # report with --device cpu on the GPU machine) gets the reference: only it is fit there.
    return decide_backend(None, site, gemm_chosen=gemm_chosen), Origin.AUTOMATIC


def _check_device(backend: Backend, platform: Platform, jax_default: Platform) -> None:
    if platform is Platform.CPU and backend is not REFERENCE and jax_default is not Platform.CPU:
        raise ValueError(
            f"backend {backend.value!r} was asked for work on CPU tensors in a process "
            f"whose JAX default device is {jax_default.value!r}: its kernels (and Pallas's "
            "interpret-or-compile choice) follow the default device, so they would be compiled "
            "for the wrong device. Use backend='xla' (or leave it None) for CPU work here, run "
            "it under `with jax.default_device(jax.devices('cpu')[0])`, or put the tensors on "
            "the GPU"
        )


def _gemm(config: KernelConfig, platform: Platform) -> tuple[GemmImpl, str]:
    if config.gemm is not None:
        gemm, why = config.gemm, "requested explicitly"
    else:
        gemm, why = DEVICE_DEFAULTS[platform], f"default on {platform.value}"
    if gemm in _GPU_ONLY_GEMMS and platform is not Platform.GPU:
        raise ValueError(
            f"gemm {gemm.value!r} needs a GPU (jax.nn.scaled_matmul has no CPU lowering); this "
            f"work runs on {platform.value}: use gemm='dequant_dot' (or leave it None)"
        )
    if gemm in _REBLOCKED_GEMMS:
        why += "; " + _reblocked_why(gemm, platform)
    return gemm, f"gemm {gemm.value}: {why}"


_REBLOCKED_GEMMS = (GemmImpl.FP8_BLOCKED, GemmImpl.FP8_BLOCKED_PALLAS)


def _reblocked_why(gemm: GemmImpl, platform: Platform) -> str:
    """What runs the re-blocked FP8 GEMM on ``platform`` (DESIGN.md 11); refuses where its
    kernel cannot run, with the reason."""
    if platform is not Platform.GPU:
        return "re-blocked operands, emulated by an exact fp32 dot on the CPU"
    if gemm is GemmImpl.FP8_BLOCKED_PALLAS:
        return "re-blocked operands, Pallas (Triton) FP8 kernel"
    from jax_side.mxfp8 import cublaslt

    st = cublaslt.status()
    if not st.ok:
        raise ValueError(f"gemm 'fp8_blocked' cannot run here: {st.reason}; use "
                         f"gemm='fp8_blocked_pallas' or the default")
    return f"re-blocked operands, {st.reason}"


@functools.lru_cache(maxsize=64)
def _resolve(
    config: KernelConfig, platform: Platform, jax_default: Platform, _version: int
) -> ResolvedKernels:
    # _version: backends.registry_version(), so that a (un)registration is never answered from
    # the cache
    choice, origin = _choose_backend(config, platform, config.gemm is not None)
    _check_device(choice.backend, platform, jax_default)
    name = choice.backend.value
    caps = backend_impl(choice.backend).capabilities
    reasons = [f"backend {name}: {choice.reason}"]
    slices = choice.backend
    if not caps.slices:
        slices = REFERENCE
        reasons.append(
            f"slices {REFERENCE.value}: {name} has no slice building blocks (it quantizes whole "
            f"tensors only); {REFERENCE.value} is the reference"
        )
    if caps.own_gemm:
        if config.gemm is not None:
            raise ValueError(
                f"backend {name!r} runs its own GEMM, but the KernelConfig asks for "
                f"gemm={config.gemm.value!r}; drop the gemm"
            )
        reasons.append(f"gemm: {name}'s own")
        gemm = None
    else:
        gemm, why = _gemm(config, platform)
        reasons.append(why)
    return ResolvedKernels(
        choice.backend, gemm, platform, "; ".join(reasons), slices, origin, choice.path,
        choice.consulted,
    )


def kernel_report(
    config: KernelConfig | ResolvedKernels | None = None, platform: Platform | str | None = None
) -> dict[str, str]:
    """What ``config`` resolves to for work on ``platform``, and why: exactly what the public
    functions run with the same ``config`` (for logs, notebooks, benchmark records). Each
    backend of the table adds its own facts (``KernelBackend.facts``: TE its probe, where the
    resolver asked it)."""
    import jax

    resolved = resolve_kernels(config, platform)
    jax_default = default_platform()
    execution = backend_impl(resolved.backend).capabilities.execution(jax_default)
    site = site_for(resolved.platform)
    facts: dict[str, str] = {}
    for backend in registered():
        facts |= backend_impl(backend).facts(site, asked=backend in resolved.consulted)
    device = jax.devices()[0]
    return {
        "backend": resolved.backend.value,
        "slices": resolved.slices.value,
        "gemm": resolved.backend.value if resolved.gemm is None else resolved.gemm.value,
        "path": "" if resolved.path is None else resolved.path.value,
        "execution": "" if execution is None else execution.value,
        "platform": resolved.platform.value,
        "origin": resolved.origin.value,
        "kernels": resolved.reason,
        **facts,
        "jax_platform": device.platform,
        "jax_device": str(device),
    }
