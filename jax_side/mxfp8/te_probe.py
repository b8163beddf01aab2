"""Facts about Transformer Engine for JAX on this process, gathered without side effects.

``probe()`` answers what ``backends.decide_backend`` needs (TE importable?, TE's own MXFP8
support answer, compute capability) and imports ``transformer_engine.jax`` only after JAX has
shown a CUDA GPU: TE-JAX does not import on a CPU-only machine. ``import_te()`` is the one place
TE is imported (once); the ``te`` backend (``te_backend``) uses it for its operations.
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
    "TEPath",
    "TEProbe",
    "import_te",
    "is_available",
    "jax_compute_capability",
    "probe",
]


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
    """TE facts for ``backends.decide_backend``. Imports TE only when JAX shows a CUDA GPU."""
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
