"""Facts about Transformer Engine for JAX on this process, and the rule for which TE path runs.

``probe()`` answers what the rule needs (TE importable?, TE's own MXFP8 support answer, compute
capability) and imports ``transformer_engine.jax`` only after JAX has shown a CUDA GPU: TE-JAX
does not import on a CPU-only machine. ``import_te()`` is the one place TE is imported (once);
the ``te`` backend (``te_backend``) uses it for its operations.

``te_availability(probe)`` is the one rule for TE on a GPU (DESIGN.md 7), a pure function of the
probe so that it is tested on CPU with hand-made probes: TE's MXFP8 CUDA custom calls
(``TEPath.KERNELS``, fit for the automatic default) only where TE itself reports MXFP8 support on
a compute capability 10.x device; TE's pure-JAX path (``TEPath.PURE_JAX``, only when asked for)
on every other GPU (on an H200, 9.0, the custom-call quantize returned wrong bytes without
raising and the GEMM failed in cuBLAS); unusable, with the cause and the fix, where TE cannot run.
The ``te`` backend answers the resolver with it (``TEBackend.availability``) and runs the path it
names, so the two cannot disagree.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from jax_side.mxfp8.backend_api import Availability, cc_text, cuda_compute_capability

__all__ = [
    "TE_KERNEL_CC_MAJORS",
    "TEPath",
    "TEProbe",
    "import_te",
    "is_available",
    "probe",
    "te_availability",
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


def te_availability(probe: TEProbe) -> Availability:
    """TE on a GPU for ``probe``: its path and why, or why it cannot run (module docstring)."""
    if not probe.importable:
        return Availability.unusable(
            "Transformer Engine for JAX (transformer_engine.jax) is not importable here "
            f"({probe.detail})",
            "Install it on a GPU machine with `pip install .[te]` (see docs/te_backend.md), or "
            "use backend='xla' (the default), the project's bit-exact pure-JAX path",
        )
    if probe.compute_capability is None:
        return Availability.unusable(
            "JAX sees no CUDA GPU, and TE-JAX runs on NVIDIA GPUs only",
            "Use backend='xla' (the default) on this platform",
        )
    if te_kernels_ok(probe):
        return Availability.default(
            f"TE reports MXFP8 support on {cc_text(probe.compute_capability)}: TE kernels",
            TEPath.KERNELS,
        )
    return Availability.on_request(
        why_no_te_kernels(probe)
        + ": TE's pure-JAX quantizer and GEMM, custom calls off for those calls",
        TEPath.PURE_JAX,
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


@functools.lru_cache(maxsize=1)
def probe() -> TEProbe:
    """TE facts for :func:`te_availability`. Imports TE only when JAX shows a CUDA GPU."""
    cc = cuda_compute_capability()
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
    q: ModuleType  # transformer_engine.jax.quantize
    tex: ModuleType  # transformer_engine.jax.cpp_extensions
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
