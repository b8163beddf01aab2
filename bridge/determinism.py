"""Bit-reproducible runs: the switches that make Torch and XLA pick the same kernels every launch.

A training run on the GPU is the same bits from launch to launch only if every kernel on both
sides is run-to-run deterministic *and* every kernel choice is the same in every launch:

- **XLA (JAX)**: GEMM autotuning times candidate kernels at compile time and keeps the fastest;
  on a shared, noisy GPU another launch may pick another kernel, whose fp32 accumulation order
  differs (launches that compiled afresh differed from step 1). ``--xla_gpu_autotune_level=0``
  turns autotuning off (XLA's heuristic choice, the same every launch);
  ``--xla_gpu_deterministic_ops=true`` forbids kernels that are not run-to-run deterministic
  (atomics in scatter and reductions).
- **Torch**: ``torch.use_deterministic_algorithms(True)`` (deterministic embedding backward and
  attention backward, or an error naming the op that has none), cuDNN without benchmarking, and
  ``CUBLAS_WORKSPACE_CONFIG`` as cuBLAS requires for reproducible GEMMs.

XLA reads its flags once, when JAX first starts a backend, so :func:`make_deterministic` must run
before the first JAX computation in the process (``mxfp8-train`` calls it first thing on every
rank); afterwards it checks that the running backend was started with the flags and raises if not.
A flag the user set explicitly in ``XLA_FLAGS`` (for example ``--xla_gpu_autotune_level=4``) is
kept, and :func:`make_deterministic` reports it as overridden. The cost on the H200 is in
BENCHMARKS.md ("Reproducible GPU runs"). CPU runs are deterministic either way (XLA:CPU does
not autotune and Torch's CPU kernels used here have no atomics); the switches cost nothing there.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

__all__ = [
    "CUBLAS_WORKSPACE",
    "XLA_DETERMINISTIC_FLAGS",
    "DeterminismReport",
    "make_deterministic",
    "merge_xla_flags",
    "xla_deterministic_ops",
]

XLA_DETERMINISTIC_FLAGS: tuple[str, ...] = (
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_autotune_level=0",
)
CUBLAS_WORKSPACE = ":4096:8"


class DeterminismReport(NamedTuple):
    xla_flags: str  # XLA_FLAGS as the process has it now
    overridden: tuple[str, ...]  # our flags the user had set to another value (theirs kept)
    torch_deterministic: bool


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merge_xla_flags(existing: str, flags: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """``existing`` (an ``XLA_FLAGS`` value) with each of ``flags`` appended unless a flag of
    that name is already set; returns the merged value and the names the user had set."""
    parts = existing.split()
    have = {_flag_name(p) for p in parts}
    overridden = tuple(_flag_name(f) for f in flags if _flag_name(f) in have
                       and f not in parts)
    merged = parts + [f for f in flags if _flag_name(f) not in have]
    return " ".join(merged), overridden


def _jax_backend_started() -> bool:
    """Whether JAX has already created a backend (after which XLA_FLAGS is not read again)."""
    try:
        from jax._src import xla_bridge  # private: no public query exists
    except ImportError:  # pragma: no cover -- a jax without the module: assume not started
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else False


def _jax_uses_gpu() -> bool:
    import jax

    return jax.default_backend() != "cpu"


def make_deterministic() -> DeterminismReport:
    """Switch this process to reproducible kernels on both sides (see the module note).

    Call before the first JAX computation. Raises ``RuntimeError`` if JAX already started a GPU
    backend without the XLA flags (they can no longer take effect); on a CPU backend the flags
    (GPU-only) do not matter and the environment is only updated for child processes."""
    current = os.environ.get("XLA_FLAGS", "")
    merged, overridden = merge_xla_flags(current, XLA_DETERMINISTIC_FLAGS)
    if merged != current:
        if _jax_backend_started() and _jax_uses_gpu():
            raise RuntimeError(
                "make_deterministic: JAX already started its backend, so XLA_FLAGS can no longer "
                f"change; call make_deterministic() before the first JAX computation, or start "
                f"the process with XLA_FLAGS='{merged}'"
            )
        os.environ["XLA_FLAGS"] = merged
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return DeterminismReport(os.environ["XLA_FLAGS"], overridden, True)


def xla_deterministic_ops() -> bool:
    """Whether this process's ``XLA_FLAGS`` turn on ``--xla_gpu_deterministic_ops`` (set by
    :func:`make_deterministic` or by the user; XLA reads the flags once, at backend start, and
    a later change takes no effect, so the environment is the flag's record here).

    ``bridge.units`` asks it: on XLA:GPU with deterministic ops, a unit program of several
    blocks (``jax_side.unit_program.SpanFn``) fails to execute its backward (jax 0.11.2 on an
    H200: ``IndexError: absl::container_internal::raw_hash_map<>::at`` at the first backward,
    BENCHMARKS.md "Reliability round 3"), so there the span's blocks run their own programs --
    the same bits, since a span has the bits of one program per block."""
    value = None
    for part in os.environ.get("XLA_FLAGS", "").split():
        name, _, v = part.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            value = v.lower() in ("", "true", "1")
    return bool(value)
