"""Rank functions for ``test_launch.py``: module-level (picklable) and stdlib-only at import, so a
spawned rank imports no more than the launcher's own torch.distributed."""

from __future__ import annotations

import os
import time
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
