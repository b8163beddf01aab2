"""Backend dispatch (DESIGN.md 7): which MXFP8 backend runs, and why, as a table lookup.

``decide_backend(requested, site)`` asks the entries of the backend table
(``KernelBackend.availability``); it is run here on simulated machines (``machines``: a platform
and a hand-made ``TEProbe``), so the rules hold for GPUs this CI never sees: TE's kernels only
where TE reports MXFP8 support on a 10.x device; TE's pure-JAX path when ``te`` is asked for
anywhere else on a GPU; a clear error where TE cannot run; and an automatic default that never
routes MXFP8 to an unsupported TE kernel. The one resolver around it (``resolve_kernels``:
environment, platform, GEMM) is tested in ``test_resolver.py``; a backend added from the tests
in ``test_backend_registration.py``.
"""

from __future__ import annotations

import sys

import jax
import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.environment import BACKEND as ENV_VAR
from apps.environment import kernels as environment_kernels
from common.kernels import Platform
from jax_side.mxfp8 import (
    Backend,
    BackendChoice,
    KernelConfig,
    kernel_report,
    resolve_kernels,
    te_backend,
)
from jax_side.mxfp8.backend_api import BackendUnavailable, Fit
from jax_side.mxfp8.backends import DEFAULT_PREFERENCE, backend_impl
from jax_side.mxfp8.te_probe import TEPath, TEProbe, te_availability
from tests.jax_side.mxfp8.machines import (
    B200,
    CPU_ONLY,
    H200,
    IMPORT_BROKEN,
    NOT_INSTALLED,
    RTX5090,
    decide,
    site,
    te_probe_says,
)

CPU = Platform.CPU
# (name, requested, (probe, platform), expected backend, expected TE path, words in the reason)
DECISIONS = [
    # on a GPU without TE's MXFP8 kernels the default is the project's Pallas kernels
    ("auto_h200", None, (H200,), Backend.PALLAS, None, ["unsupported", "9.0", "9.9 or higher",
                                                        "Pallas", "Triton"]),
    ("auto_b200", None, (B200,), Backend.TE, TEPath.KERNELS, ["support", "10.0", "kernels"]),
    ("auto_sm120", None, (RTX5090,), Backend.PALLAS, None, ["12.0", "not 10.x"]),
    ("auto_not_installed", None, (NOT_INSTALLED,), Backend.PALLAS, None, ["not importable"]),
    ("auto_gpu_no_cuda", None, (CPU_ONLY,), Backend.XLA, None, ["not importable", "not CUDA"]),
    ("auto_cpu", None, (CPU_ONLY, CPU), Backend.XLA, None, ["work on the CPU", "CUDA GPUs only",
                                                            "interpret mode"]),
    ("auto_cpu_work_on_b200", None, (B200, CPU), Backend.XLA, None, ["work on the CPU"]),
    ("pallas_h200", "pallas", (H200,), Backend.PALLAS, None, ["explicitly", "Triton", "9.0"]),
    ("pallas_cpu", "pallas", (CPU_ONLY, CPU), Backend.PALLAS, None, ["explicitly",
                                                                     "interpret mode"]),
    ("te_h200", "te", (H200,), Backend.TE, TEPath.PURE_JAX, ["unsupported", "pure-JAX", "off"]),
    ("te_b200", Backend.TE, (B200,), Backend.TE, TEPath.KERNELS, ["kernels"]),
    ("te_sm120", "TE", (RTX5090,), Backend.TE, TEPath.PURE_JAX, ["not 10.x", "pure-JAX"]),
    ("xla_b200", "xla", (B200,), Backend.XLA, None, ["explicitly"]),
    ("xla_cpu", Backend.XLA, (CPU_ONLY, CPU), Backend.XLA, None, ["explicitly"]),
]


@pytest.mark.parametrize(
    "requested, machine, backend, path, words",
    [d[1:] for d in DECISIONS],
    ids=[d[0] for d in DECISIONS],
)
def test_decision_table(requested, machine, backend, path, words):
    choice = decide(requested, *machine)
    assert isinstance(choice, BackendChoice)
    assert (choice.backend, choice.path) == (backend, path)
    for word in words:
        assert word in choice.reason, (word, choice.reason)


def test_the_automatic_default_is_the_first_fit_entry_of_the_preference():
    """What each entry answers decides, in DEFAULT_PREFERENCE order; the reason says why each
    earlier entry was passed over, and only the entries up to the chosen one are asked."""
    assert DEFAULT_PREFERENCE[-1] is Backend.XLA  # the reference ends it: fit everywhere
    for probe, platform in [(H200, Platform.GPU), (B200, Platform.GPU), (B200, CPU)]:
        choice = decide(None, probe, platform)
        assert choice.consulted == DEFAULT_PREFERENCE[: len(choice.consulted)]
        assert choice.backend is choice.consulted[-1]
        with te_probe_says(probe):
            fits = [backend_impl(b).availability(site(probe, platform)).fit
                    for b in choice.consulted]
        assert fits[-1] is Fit.DEFAULT and Fit.DEFAULT not in fits[:-1]
        for passed in choice.consulted[:-1]:
            assert f"{passed.value} " in choice.reason


def test_a_chosen_gemm_passes_over_a_backend_with_its_own_gemm():
    choice = decide(None, B200, gemm_chosen=True)
    assert choice.backend is Backend.PALLAS
    assert "te not used: a GEMM implementation was chosen, and te runs its own GEMM" in (
        choice.reason
    )


@pytest.mark.parametrize("probe", [NOT_INSTALLED, CPU_ONLY, IMPORT_BROKEN], ids=str)
def test_te_request_without_importable_te_is_a_clear_error(probe):
    with pytest.raises(RuntimeError, match=r"'te' was requested.*pip install \.\[te\].*'xla'"):
        decide("te", probe)


def test_te_request_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA GPU.*backend='xla'"):
        decide("te", TEProbe(True, "", False, None))


def test_te_request_for_cpu_work_names_the_backend_the_platform_and_why():
    with pytest.raises(BackendUnavailable, match=r"'te' was requested for work on cpu, but it "
                                                 r"cannot run here: .*CUDA GPUs only.*'xla'"):
        decide("te", B200, CPU)


def test_unknown_backend_names_the_choices():
    match = r"unknown MXFP8 backend 'cuda'.*\['xla', 'pallas', 'te'\]"
    with pytest.raises(ValueError, match=match):
        decide("cuda", B200)


@given(
    importable=st.booleans(),
    supported=st.booleans(),
    cc=st.one_of(st.none(), st.sampled_from([70, 80, 86, 89, 90, 99, 100, 103, 110, 120, 121])),
)
def test_automatic_default_never_picks_an_unsupported_te_kernel(importable, supported, cc):
    choice = decide(None, TEProbe(importable, "", supported, cc))
    if choice.backend is Backend.TE:
        assert choice.path is TEPath.KERNELS
        assert importable and supported and cc is not None and cc // 10 == 10
    else:
        assert choice.path is None
    assert choice.reason.startswith("automatic default")


@given(importable=st.booleans(), supported=st.booleans(),
       cc=st.one_of(st.none(), st.integers(50, 130)))
def test_te_path_is_kernels_only_where_te_reports_support_on_10x(importable, supported, cc):
    probe = TEProbe(importable, "", supported, cc)
    try:
        choice = decide("te", probe)
    except RuntimeError:
        assert not importable or cc is None
        return
    assert choice.backend is Backend.TE
    assert (choice.path is TEPath.KERNELS) == (supported and cc // 10 == 10)
    assert te_availability(probe).path is choice.path  # the one rule, as the adapter runs it


# ---- the same rules on this process, through the public entry points

cpu_only = pytest.mark.skipif(
    jax.devices()[0].platform != "cpu", reason="states what a CPU-only process does"
)


@cpu_only
def test_this_cpu_process_defaults_to_xla_without_importing_te(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    resolved = resolve_kernels(None)
    assert resolved.backend is Backend.XLA and resolved.path is None
    assert "transformer_engine" not in sys.modules
    assert te_backend.probe().importable is False


@cpu_only
def test_this_cpu_process_refuses_te_with_the_reason(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(RuntimeError, match="'te' was requested"):
        resolve_kernels(KernelConfig("te"))


def test_an_application_environment_variable_overrides_the_default(monkeypatch):
    """MXFP8_BACKEND, read by the applications (apps.environment.kernels), fills a None backend;
    the library itself reads no environment."""
    monkeypatch.setenv(ENV_VAR, "xla")
    resolved = resolve_kernels(environment_kernels(None))
    assert resolved.backend is Backend.XLA
    assert resolved.reason.startswith("backend xla: requested explicitly")
    monkeypatch.setenv(ENV_VAR, "te")
    if te_backend.probe().importable:
        assert resolve_kernels(environment_kernels(None), "gpu").backend is Backend.TE
    else:
        with pytest.raises(RuntimeError, match="'te' was requested"):
            resolve_kernels(environment_kernels(None))


def test_report_says_what_runs_and_why(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    report = kernel_report()
    resolved = resolve_kernels(None)
    assert report["backend"] == resolved.backend.value and report["kernels"] == resolved.reason
    assert report["gemm"] == resolved.gemm.value and report["slices"] == resolved.slices.value
    on_gpu = report["jax_platform"] == "gpu"
    if on_gpu:
        probe = te_backend.probe()
        assert report["te_importable"] == str(probe.importable)
        assert report["compute_capability"].startswith("compute capability")
    explicit = kernel_report(KernelConfig("xla"))
    assert explicit["kernels"].startswith("backend xla: requested explicitly")
    assert explicit["origin"] == "config" and explicit["execution"] == "compiled"
    assert explicit["te_importable"] == "not probed"
