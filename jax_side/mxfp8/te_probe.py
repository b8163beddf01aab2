"""Facts about Transformer Engine for JAX on this process, and the rule for which TE path runs.

``probe()`` answers what the decision needs (TE importable?, TE's own MXFP8 support answer,
compute capability) and imports ``transformer_engine.jax`` only after JAX has shown a CUDA GPU:
TE-JAX does not import on a CPU-only machine. ``import_te()`` is the one place TE is imported
(once); the ``te`` backend (``te_backend``) uses it for its operations.

``te_choice(probe)`` is the one rule for the TE path (DESIGN.md 7): TE's MXFP8 CUDA custom calls
only where TE itself reports MXFP8 support on a compute capability 10.x device; TE's pure-JAX path
on every other GPU (on an H200, 9.0, the custom-call quantize returned wrong bytes without raising
and the GEMM failed in cuBLAS); a clear error where TE cannot run. Both the resolver
(``backends.decide_backend``) and the ``te`` backend itself use it, so they cannot disagree.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
from pathlib import Path
from typing import NamedTuple

import jax

__all__ = [
    "NO_TE",
    "TE_KERNEL_CC_MAJORS",
    "TEChoice",
    "TEPath",
    "TEProbe",
    "cc_text",
    "import_te",
    "is_available",
    "jax_compute_capability",
    "probe",
    "te_choice",
    "te_kernels_ok",
    "why_no_te_kernels",
]

# Compute-capability majors on which TE's MXFP8 custom calls are used (DESIGN.md 7: native MXFP8
# is 10.x). TE reports support from 9.9 upward; 12.x is left on the pure-JAX path until verified.
TE_KERNEL_CC_MAJORS = (10,)


class TEPath(enum.Enum):
    """Which part of TE-JAX the ``te`` backend runs."""

    KERNELS = "kernels"  # TE's MXFP8 CUDA custom calls (quantize, cuBLAS GEMM)
    PURE_JAX = "pure_jax"  # TE's pure-JAX quantizer and GEMM, custom calls off for those calls


class TEProbe(NamedTuple):
    """Facts about TE-JAX on this process (gathered by :func:`probe`)."""

    importable: bool
    detail: str  # the import error, or TE's own reason when it reports MXFP8 unsupported
    mxfp8_supported: bool  # TE's is_scaling_mode_supported(MXFP8_1D_SCALING)
    compute_capability: int | None  # e.g. 90, 100 (TE's encoding); None: no CUDA GPU in JAX


NO_TE = TEProbe(False, "not probed", False, None)


class TEChoice(NamedTuple):
    """The TE path that runs for a probe, and why."""

    path: TEPath
    reason: str


def cc_text(cc: int | None) -> str:
    return "no CUDA GPU" if cc is None else f"compute capability {cc // 10}.{cc % 10}"


def te_kernels_ok(probe: TEProbe) -> bool:
    """True exactly where TE's MXFP8 custom calls may run (see the module docstring)."""
    return (
        probe.importable
        and probe.mxfp8_supported
        and probe.compute_capability is not None
        and probe.compute_capability // 10 in TE_KERNEL_CC_MAJORS
    )


def why_no_te_kernels(probe: TEProbe) -> str:
    if not probe.importable:
        return f"TE-JAX is not importable ({probe.detail})"
    if probe.compute_capability is None:
        return "no CUDA GPU"
    if probe.mxfp8_supported:
        return f"TE reports MXFP8 support, but {cc_text(probe.compute_capability)} is not 10.x"
    detail = f" ({probe.detail})" if probe.detail else ""
    return f"TE reports MXFP8 unsupported on {cc_text(probe.compute_capability)}{detail}"


def te_choice(probe: TEProbe) -> TEChoice:
    """The TE path for ``probe``; RuntimeError naming the cause where TE cannot run."""
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
    if te_kernels_ok(probe):
        return TEChoice(
            TEPath.KERNELS,
            f"TE reports MXFP8 support on {cc_text(probe.compute_capability)}: TE kernels",
        )
    return TEChoice(
        TEPath.PURE_JAX,
        why_no_te_kernels(probe)
        + ": TE's pure-JAX quantizer and GEMM, custom calls off for those calls",
    )


def is_available() -> bool:
    """True when ``transformer_engine.jax`` is installed (found on disk; nothing is imported)."""
    try:
        spec = importlib.util.find_spec("transformer_engine")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(p) / "jax" / "__init__.py").is_file() for p in spec.submodule_search_locations)


def jax_compute_capability() -> int | None:
    """Compute capability of JAX's first device as TE encodes it (9.0 -> 90); None if not GPU."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    major, minor = str(getattr(device, "compute_capability", "0.0")).split(".")[:2]
    return int(major) * 10 + int(minor)


@functools.lru_cache(maxsize=1)
def probe() -> TEProbe:
    """TE facts for :func:`te_choice`. Imports TE only when JAX shows a CUDA GPU."""
    cc = jax_compute_capability()
    if not is_available():
        return TEProbe(False, "transformer_engine.jax is not installed", False, cc)
    if cc is None:
        return TEProbe(False, "not imported: JAX sees no CUDA GPU (TE-JAX needs one)", False, None)
    try:
        te = import_te()
    except Exception as e:  # noqa: BLE001 -- any import failure means "not importable"; say which
        return TEProbe(False, f"import failed: {type(e).__name__}: {e}", False, cc)
    supported, why = te.q.is_scaling_mode_supported(te.q.ScalingMode.MXFP8_1D_SCALING)
    return TEProbe(True, str(why), bool(supported), int(te.q.get_device_compute_capability(0)))


class TEModules(NamedTuple):
    version: str
    q: object  # transformer_engine.jax.quantize
    tex: object  # transformer_engine.jax.cpp_extensions
    import_warnings: tuple[str, ...]  # what TE warned while importing (kept, not shown)


@functools.lru_cache(maxsize=1)
def import_te() -> TEModules:
    """Import TE-JAX once. Its import-time warnings are about TE's own packaging (e.g. "Detected
    a PyTorch installation but could not find ... the Transformer Engine PyTorch extension",
    which this project triggers by design: torch is installed, TE's torch extension is not), so
    they are recorded in ``import_warnings`` instead of being raised into the caller."""
    import warnings
    from importlib import metadata

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import transformer_engine.jax  # noqa: F401 -- loads the framework extension
        import transformer_engine.jax.cpp_extensions as tex
        import transformer_engine.jax.quantize as q
    seen = tuple(f"{w.category.__name__}: {w.message}" for w in caught)
    return TEModules(metadata.version("transformer_engine"), q, tex, seen)
