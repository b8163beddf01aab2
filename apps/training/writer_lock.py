"""The one-writer lock of a checkpoint directory (DESIGN.md 10: a second writer is refused).

A run that saves into ``--save-dir`` creates ``<save_dir>/writer.lock`` with ``O_CREAT | O_EXCL``
(atomic: of two runs starting together exactly one succeeds) and holds it for its whole life; the
file holds the run id, host, pid and start time (JSON) and is removed when the run ends, normally
or by an exception. A run that finds the file refuses to start, naming the holder.

A **stale** lock (its host is this one and its pid is not running: the run was killed before it
could clean up) is reported as stale, not taken over: two runs taking over one stale lock at once
could both succeed, so the user deletes the file after checking that no run writes there.
A pid that is running is taken as the holder even if the number was reused (refusing is safe).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

from torch_side.sharded_files import CheckpointError

__all__ = ["LOCK", "WriterLock"]

LOCK = "writer.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _holder(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


class WriterLock:
    """``<save_dir>/writer.lock`` held by this process for ``run_id`` (see the module note)."""

    def __init__(self, path: Path, run_id: str):
        self.path, self.run_id = path, run_id

    @classmethod
    def acquire(cls, save_dir: str | os.PathLike, run_id: str) -> WriterLock:
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        path = save_dir / LOCK
        record = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            raise CheckpointError(_refusal(save_dir, path)) from None
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        return cls(path, run_id)

    def held(self) -> bool:
        """Whether the lock file is still this run's (nobody deleted and retook it)."""
        holder = _holder(self.path)
        return holder is not None and holder.get("run_id") == self.run_id

    def release(self) -> None:
        """Remove the lock file if it is still ours."""
        if self.held():
            self.path.unlink(missing_ok=True)


def _refusal(save_dir: Path, path: Path) -> str:
    holder = _holder(path)
    head = (f"--save-dir {save_dir} is locked by another run: {path} exists, so a second run "
            f"saving there would replace that run's checkpoints")
    if holder is None:
        return (f"{head}; its holder cannot be read. If no run is saving into {save_dir}, "
                f"delete {path} and start again; otherwise use another --save-dir")
    who = (f"run {holder.get('run_id')} (pid {holder.get('pid')} on host {holder.get('host')}, "
           f"since {holder.get('started')})")
    pid = holder.get("pid")
    if (holder.get("host") == socket.gethostname() and type(pid) is int
            and not _pid_alive(pid)):
        return (f"{head}. The lock is STALE: it was taken by {who}, and no process {pid} is "
                f"running on this host (that run was killed before it could release it). "
                f"Delete {path} and start again (after checking no other run saves there)")
    return (f"{head}; it is held by {who}. Wait for that run to end, or use another "
            f"--save-dir (to resume from its checkpoints, pass --resume {save_dir} with a new "
            f"--save-dir); if that run is gone, delete {path}")
