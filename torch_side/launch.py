"""Run one function on N local ranks (spawned processes, one process group) and collect results.

``run_local_ranks(fn, world_size, args)`` spawns ``world_size`` processes ("spawn" start method:
no forked JAX or CUDA state), joins them into one ``torch.distributed`` group on 127.0.0.1 (gloo
on CPU, NCCL on CUDA), calls ``fn(*args)`` on every rank and returns the per-rank return values
(rank order). ``fn`` must be importable (a module-level function) and its result picklable.

Failure and hangs are bounded, never silent:

- the first rank that raises stops the launch at once: the others are terminated and
  :class:`RankFailed` carries that rank's traceback and which ranks were still running;
- every collective has the process group's timeout (``collective_timeout``, default 300 s), and
  the whole launch has ``timeout`` (default none): past it, :class:`RanksStalled` names the ranks
  that had not finished, and all are terminated;
- when the launch stops (a failure, a stall, SIGTERM or SIGINT to the launcher) the ranks still
  running get SIGTERM, then SIGKILL 30 s later (``_GRACE_S``): a rank that turns SIGTERM into an
  exception (``apps.training.interrupts``) unwinds and releases what it holds in between;
- ranks die with their launcher (Linux ``PR_SET_PDEATHSIG``), and the launcher removes its
  temporary files on every exit path (SIGTERM included). A rank asks for the signal first thing,
  before it imports torch or the job (``_rank_start``: the process object it unpickles names only
  this stdlib-only module; the job travels as bytes, unpickled after), then checks that its
  parent is still the launcher: a launcher killed while the rank was starting Python is noticed
  and the rank exits, instead of running the whole job as an orphan. The kernel sends the signal
  when the *thread* that spawned the rank ends; ``run_local_ranks`` spawns and waits for its
  ranks in the same thread, so that is the end of the launch;
- a world size the machine cannot hold is refused up front: each CPU rank needs about
  ``rank_memory_bytes`` of RAM (a JAX + Torch process, ~600 MB), checked against MemAvailable.

The per-rank bootstrap, ``bootstrap_rank(RankSetup(...), collective_timeout, ...)``, is the one
way a rank of this project starts, here and under torchrun (``mxfp8-train``): first the
environment, before the rank imports JAX or starts CUDA (``rank_environment``: the variables
JAX, CUDA and NCCL read from the environment only) -- one simulated XLA host device, JAX's
preallocation off, on CUDA ``CUDA_VISIBLE_DEVICES=<the rank's GPU>`` so that Torch's ``cuda:0``
and JAX's only GPU are the same device (DESIGN.md 6: each rank's JAX work stays on that rank's
device) and NVLink multicast off; then Torch's threads and device, and the process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import enum
import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "LaunchDevice",
    "LaunchError",
    "RankFailed",
    "RankSetup",
    "RanksStalled",
    "bootstrap_rank",
    "check_capacity",
    "rank_environment",
    "run_local_ranks",
]

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
RANK_MEMORY_BYTES = 700 * 2**20  # a CPU rank with torch + jax imported and a small model
_POLL_S = 0.05
_GRACE_S = 30.0  # from SIGTERM to SIGKILL when the launch stops its ranks


class LaunchDevice(enum.Enum):
    CPU = "cpu"  # gloo
    CUDA = "cuda"  # nccl, one GPU per rank


class LaunchError(RuntimeError):
    """A local multi-rank launch did not complete."""


class RankFailed(LaunchError):
    def __init__(self, rank: int, world_size: int, detail: str, running: list[int]):
        self.rank, self.detail, self.running = rank, detail, running
        still = (
            f"; ranks still running then (terminated): {running} -- when the error is a "
            f"collective timeout, those are the ranks that stalled"
            if running else ""
        )
        super().__init__(f"rank {rank}/{world_size} failed{still}:\n{detail}")


class RanksStalled(LaunchError):
    def __init__(self, stalled: list[int], world_size: int, timeout: float):
        self.stalled = stalled
        done = sorted(set(range(world_size)) - set(stalled))
        super().__init__(
            f"ranks {stalled} of {world_size} did not finish within {timeout:g} s (stalled, "
            f"terminated); finished: {done}. Raise timeout= if the work is just slow"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ORPHANED_EXIT = 3  # a rank whose launcher died before it could ask to die with it


def _die_with_parent(launcher_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies; exit at once if
    the launcher is already gone (the request came too late: no signal will ever come)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: ranks still end with the launch's terminate() calls
        return
    if os.getppid() != launcher_pid:  # reparented: the launcher died while we were starting
        os._exit(_ORPHANED_EXIT)


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_capacity(world_size: int, rank_memory_bytes: int = RANK_MEMORY_BYTES) -> None:
    """Refuse a CPU world that cannot fit in this machine's available memory."""
    available = _mem_available()
    need = world_size * rank_memory_bytes
    if available is not None and need > available:
        fits = max(1, available // rank_memory_bytes)
        raise ValueError(
            f"run_local_ranks: {world_size} ranks need about {need / 2**30:.1f} GiB "
            f"({rank_memory_bytes / 2**20:.0f} MiB each) but only {available / 2**30:.1f} GiB "
            f"is available; use at most {fits} ranks here, or pass rank_memory_bytes= if your "
            f"ranks are smaller"
        )


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """Where one rank runs: its device kind, on CUDA the one GPU it sees as ``cuda:0`` (its
    ``CUDA_VISIBLE_DEVICES`` entry), on the CPU Torch's intra-op threads."""

    device: LaunchDevice
    gpu: str | None = None
    threads: int = 1


def rank_environment(setup: RankSetup) -> None:
    """The rank's environment, set before anything imports JAX (it reads JAX_PLATFORMS when
    imported) or CUDA starts: JAX, CUDA and NCCL read these from the environment only."""
    # one simulated host device per rank; the user's other XLA flags reach the rank unchanged
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=1"])
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if setup.device is LaunchDevice.CUDA:
        if setup.gpu is None:
            raise ValueError("RankSetup: a CUDA rank needs its gpu (a CUDA_VISIBLE_DEVICES entry)")
        os.environ["CUDA_VISIBLE_DEVICES"] = setup.gpu
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def bootstrap_rank(setup: RankSetup, collective_timeout: float, **group: Any) -> None:
    """A rank's start (module note): ``rank_environment``, Torch's threads (CPU) or device
    (CUDA: ``cuda:0``), then the process group -- gloo on the CPU, NCCL on the rank's GPU -- with
    ``collective_timeout`` seconds per collective. ``group``: ``init_process_group``'s
    ``init_method``, ``rank``, ``world_size`` (none under torchrun: its environment has them)."""
    rank_environment(setup)
    import torch
    import torch.distributed as dist

    cuda = setup.device is LaunchDevice.CUDA
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(setup.threads)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        timeout=datetime.timedelta(seconds=collective_timeout),
        **({"device_id": torch.device("cuda", 0)} if cuda else {}),
        **group,
    )


def _rank_start(rank: int, launcher_pid: int, out_dir: str, device: str, world_size: int,
                port: int, collective_timeout: float, job: bytes) -> None:
    """A rank's first code: die with the launcher, start the rank (``bootstrap_rank``), then
    unpickle the job (which may import JAX and the caller's modules: seconds) and run it."""
    _die_with_parent(launcher_pid)
    out = Path(out_dir)
    try:
        kind = LaunchDevice(device)
        setup = RankSetup(kind, str(rank) if kind is LaunchDevice.CUDA else None)
        bootstrap_rank(setup, collective_timeout, init_method=f"tcp://127.0.0.1:{port}",
                       rank=rank, world_size=world_size)
        fn, args = pickle.loads(job)
        result = fn(*args)
        tmp = out / f"rank{rank}.pkl.tmp"
        tmp.write_bytes(pickle.dumps(result))
        tmp.rename(out / f"rank{rank}.pkl")
        import torch.distributed as dist

        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- reported to the launcher, which fails the launch
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)  # no destroy: the group may be broken; the launcher terminates the others


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _sigterm_as_exit():
    """While launching, SIGTERM unwinds (so temporary files go) instead of killing outright."""
    try:
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(procs: Sequence[BaseProcess]) -> None:
    """SIGTERM to every rank still running, SIGKILL to those still running ``_GRACE_S`` later
    (a rank that unwinds on SIGTERM, as mxfp8-train's do, gets that long to clean up)."""
    procs = [p for p in procs if p.pid is not None]  # a failed start left the rest unstarted
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _watch(procs: Sequence[BaseProcess], out: Path, world_size: int,
           timeout: float | None) -> None:
    start = time.monotonic()
    while True:
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0):
                err = out / f"rank{r}.err"
                detail = err.read_text() if err.exists() else f"exit code {p.exitcode}"
                running = [i for i, q in enumerate(procs) if i != r and q.exitcode is None]
                raise RankFailed(r, world_size, detail, running)
        if all(p.exitcode == 0 for p in procs):
            return
        if timeout is not None and time.monotonic() - start > timeout:
            stalled = [r for r, p in enumerate(procs) if p.exitcode is None]
            raise RanksStalled(stalled, world_size, timeout)
        time.sleep(_POLL_S)


def run_local_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    device: LaunchDevice | str = LaunchDevice.CPU,
    timeout: float | None = None,
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    rank_memory_bytes: int = RANK_MEMORY_BYTES,
) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``, each rank in its own process.

    timeout: seconds for the whole launch (None: no limit beyond the collectives' own);
    collective_timeout: the process group's timeout for every collective. Raises
    ``RankFailed`` / ``RanksStalled`` (both ``LaunchError``) as described in the module note.
    """
    device = LaunchDevice(device) if not isinstance(device, LaunchDevice) else device
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_local_ranks: world_size must be an int >= 1, got {world_size!r}")
    if not collective_timeout > 0 or (timeout is not None and not timeout > 0):
        raise ValueError(
            f"run_local_ranks: timeouts must be > 0 seconds, got timeout={timeout!r}, "
            f"collective_timeout={collective_timeout!r}"
        )
    if device is LaunchDevice.CUDA:
        import torch

        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"run_local_ranks: world_size={world_size} CUDA ranks need {world_size} GPUs, "
                f"{torch.cuda.device_count()} visible; use fewer ranks or device='cpu'"
            )
    else:
        check_capacity(world_size, rank_memory_bytes)
    ctx = mp.get_context("spawn")
    port = _free_port()
    with _sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="run_local_ranks_") as out_dir:
        # The job as bytes: unpickling the process object then imports this module only, so
        # the rank reaches _die_with_parent before any heavy import (see the module note).
        job = bytes(ForkingPickler.dumps((fn, args)))
        procs = [
            ctx.Process(target=_rank_start, daemon=False, args=(
                r, os.getpid(), out_dir, device.value, world_size, port, collective_timeout, job))
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            _watch(procs, Path(out_dir), world_size, timeout)
            return [
                pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes())
                for r in range(world_size)
            ]
        finally:
            _terminate(procs)
