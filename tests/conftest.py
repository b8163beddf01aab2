"""Test configuration shared by every test module.

- JAX runs strict: dtype promotion "strict" (no silent widening in numerics code), four
  simulated CPU devices so sharding code paths are exercised without a GPU, and XLA rounds bf16
  at every op (``--xla_allow_excess_precision=false``).
- ``@pytest.mark.gpu`` tests are skipped, with the reason, where no CUDA device is visible.
- Hypothesis: no per-example deadline (XLA compiles on first call), a bounded example count.
- ``single_rank_world``: a one-rank gloo group in this process (tests of collective code).
- One persistent JAX compilation cache per test run, shared by every test process (the
  pytest-xdist workers) and, through ``children_share_jax_cache``, by the processes a test
  starts: a program compiled anywhere in the run is loaded, not compiled again, by every other
  process (the suite spends most of its time compiling). It lives in the system temp directory,
  named by the run's id, and is removed when the run ends. ``tests.compiles`` counts a program
  loaded from it as it counts a compiled one (JAX reports both as a backend compile).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# bf16 values are rounded at every op, not only at program boundaries: the unit programs and the
# whole-model Flax twin then give the same bits (bridge/units.py, "Exactness").
if "xla_allow_excess_precision" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_allow_excess_precision=false"
# JAX must not grab most of the GPU in a process where Torch allocates too (DESIGN.md 6).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile(
    "default",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=600)
# The GPU pass (scripts/gpu/jax_side.sh) re-runs the CPU properties on CUDA within a few minutes.
settings.register_profile("quick", deadline=None, max_examples=15)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _cuda_available() -> bool:
    # Through the bridge: starting JAX's GPU backend can leave another GPU current for Torch
    # (bridge.start_jax_backend says what was seen); this keeps Torch's "cuda" on cuda:0.
    from bridge import start_jax_backend

    try:
        return any(d.platform == "gpu" for d in start_jax_backend())
    except RuntimeError:
        return False


def _run_cache_dir(config) -> Path:
    """The run's compilation cache directory: named by pytest-xdist's test-run id, which the
    controller sets here before it starts the workers (they receive it), or by a fresh id in a
    run without workers."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        uid = workerinput["testrunuid"]
    else:
        uid = getattr(config.option, "testrunuid", None) or uuid.uuid4().hex
        if hasattr(config.option, "testrunuid"):
            config.option.testrunuid = uid  # the workers' id (pytest-xdist reads it later)
    return Path(tempfile.gettempdir()) / f"mxfp8-fsdp-tests-{uid}" / "jax_cache"


def pytest_configure(config):
    cache = _run_cache_dir(config)
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    config.stash[_CACHE_KEY] = cache
    # before any test module is imported: JAX decides at its first compile whether to use it
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and _CACHE_KEY in config.stash:  # the run's owner
        shutil.rmtree(config.stash[_CACHE_KEY].parent, ignore_errors=True)


_CACHE_KEY = pytest.StashKey[Path]()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu); none is visible to JAX here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def single_rank_world():
    """An in-process gloo group of one rank, for collective code that needs no second process
    (no spawn: milliseconds); destroyed after the module, so later modules see no group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def _session_jax_cache(pytestconfig):
    return pytestconfig.stash[_CACHE_KEY]


def jax_cache_env(path) -> dict[str, str]:
    """The environment that points JAX in a child process at the persistent cache ``path``,
    every program cached (JAX reads these variables when it starts): a later process loads the
    programs an earlier one compiled."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(path),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.fixture
def children_share_jax_cache(monkeypatch, _session_jax_cache):
    """Processes this test starts (spawned ranks, notebook kernels) share one persistent JAX
    compilation cache for the session: a later world loads the executables an earlier one
    compiled instead of compiling them again (CI time; the programs are the same). This
    process's JAX is configured already and stays as it is."""
    for name, value in jax_cache_env(_session_jax_cache).items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def ranks_in_threads(monkeypatch):
    """``torch_side.launch.run_local_ranks`` on CPU runs its ranks as threads of this process
    (``tests.torch_side.threaded_world.run_ranks``: PyTorch's threaded process group, one
    rank per thread) instead of spawned processes, for an app whose ranks need no process of
    their own (no signal handlers, no per-process environment): no interpreter, Torch and JAX
    start per rank, and the ranks share this process's compiled programs. Returns the list of
    launches it ran (world sizes), so a test can assert it went through."""
    import torch_side.launch as launch
    from tests.torch_side.threaded_world import run_ranks

    real = launch.run_local_ranks
    launches: list[int] = []

    def in_threads(fn, world_size, args=(), *, device="cpu", **kw):
        if str(getattr(device, "value", device)) != "cpu":
            return real(fn, world_size, args, device=device, **kw)
        launches.append(world_size)
        return run_ranks(fn, world_size, args)

    monkeypatch.setattr(launch, "run_local_ranks", in_threads)
    import apps.parity.sharded as sharded

    monkeypatch.setattr(sharded, "run_local_ranks", in_threads)
    return launches
