"""Simulated machines for the backend decision and the resolver, so that their rules are tested
on this CPU-only CI for GPUs it never sees.

A machine is a platform for the work and a hand-made ``TEProbe`` (TE importable?, TE's own MXFP8
answer, compute capability). :func:`decide` runs the real decision (``backends.decide_backend``,
every real entry answering ``availability``) with TE's probe replaced; :func:`simulated_gpu`
makes the whole resolver (``resolve_kernels``, ``kernel_report``) see a GPU process with that
probe.
"""

from __future__ import annotations

import contextlib
from unittest import mock

from common.kernels import Backend, Platform
from jax_side.mxfp8 import kernels, te_probe
from jax_side.mxfp8.backend_api import Site
from jax_side.mxfp8.backends import BackendChoice, decide_backend
from jax_side.mxfp8.te_probe import TEProbe

H200 = TEProbe(True, "Device compute capability 9.9 or higher required for MXFP8 execution.",
               False, 90)
B200 = TEProbe(True, "", True, 100)
RTX5090 = TEProbe(True, "", True, 120)  # TE reports support from 9.9 on; 12.x is unverified
NOT_INSTALLED = TEProbe(False, "transformer_engine.jax is not installed", False, 90)
CPU_ONLY = TEProbe(False, "not imported: JAX sees no CUDA GPU (TE-JAX needs one)", False, None)
IMPORT_BROKEN = TEProbe(False, "import failed: OSError: libcuda.so.1", False, 100)


def site(probe: TEProbe, platform: Platform = Platform.GPU) -> Site:
    """Work on ``platform`` of the machine ``probe`` describes (its CUDA GPU for GPU work)."""
    return Site(platform, probe.compute_capability if platform is Platform.GPU else None)


@contextlib.contextmanager
def te_probe_says(probe: TEProbe):
    """TE's probe answers ``probe`` inside the block (TE's entry reads ``te_probe.probe``)."""
    with mock.patch.object(te_probe, "probe", lambda: probe):
        yield


def decide(
    requested: Backend | str | None,
    probe: TEProbe,
    platform: Platform = Platform.GPU,
    *,
    gemm_chosen: bool = False,
) -> BackendChoice:
    """The real decision on the simulated machine."""
    with te_probe_says(probe):
        return decide_backend(requested, site(probe, platform), gemm_chosen=gemm_chosen)


@contextlib.contextmanager
def simulated_gpu(probe: TEProbe):
    """Inside the block, the resolver sees a process whose JAX default device is the GPU that
    ``probe`` describes (its cache is cleared on entry and exit)."""
    kernels._resolve.cache_clear()
    try:
        with (
            mock.patch.object(kernels, "default_platform", lambda: Platform.GPU),
            mock.patch.object(kernels, "site_for", lambda platform: site(probe, platform)),
            te_probe_says(probe),
        ):
            yield
    finally:
        kernels._resolve.cache_clear()
