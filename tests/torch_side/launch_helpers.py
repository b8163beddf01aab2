"""Rank functions for ``test_launch.py``: module-level (picklable) and stdlib-only at import, so a
spawned rank imports no more than the launcher's own torch.distributed."""

from __future__ import annotations

import os
import signal
import time
import types
from multiprocessing.context import SpawnProcess
from pathlib import Path


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def all_reduce_unless_stalled(stalled_rank: int, sleep_s: float) -> float | None:
    """Every rank but ``stalled_rank`` joins an all-reduce; that one sleeps instead."""
    import torch
    import torch.distributed as dist

    if _rank() == stalled_rank:
        time.sleep(sleep_s)
        return None
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def return_unless_stalled(stalled_rank: int, sleep_s: float) -> int:
    if _rank() == stalled_rank:
        time.sleep(sleep_s)
    return _rank()


def fail_on(failing_rank: int) -> int:
    if _rank() == failing_rank:
        raise ValueError(f"boom from rank {failing_rank}")
    return _rank()


def record_pid_and_sleep(pid_dir: str, sleep_s: float) -> None:
    Path(pid_dir, f"rank{_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(sleep_s)




class _DieAfterTheLastStart(SpawnProcess):
    """A rank process whose launcher SIGKILLs itself once ``world_size`` ranks are started,
    after writing their pids to ``pid_file`` (module-level: spawn pickles the process object)."""

    pid_file = ""
    world_size = 2
    started: list[int] = []  # noqa: RUF012 -- the launcher's own record, never pickled

    def start(self):
        super().start()
        self.started.append(self.pid)
        if len(self.started) == self.world_size:
            Path(self.pid_file).write_text(" ".join(map(str, self.started)))
            os.kill(os.getpid(), signal.SIGKILL)


def launch_then_die_at_once(pid_file: str, pid_dir: str) -> None:
    """A launcher that SIGKILLs itself the moment its 2 ranks are spawned (they are still
    starting Python), after writing their pids to ``pid_file``. Its ranks would record their
    pids in ``pid_dir`` and sleep for 120 s, if they ever ran."""
    from torch_side import launch

    _DieAfterTheLastStart.pid_file = pid_file
    launch.mp.get_context = lambda method: types.SimpleNamespace(Process=_DieAfterTheLastStart)
    launch.run_local_ranks(record_pid_and_sleep, 2, (pid_dir, 120.0))
