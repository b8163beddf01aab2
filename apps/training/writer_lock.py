"""The one-writer lock of a checkpoint directory (DESIGN.md 10: a second writer is refused).

A run that saves into ``--save-dir`` holds ``<save_dir>/writer.lock`` for its whole life: the file
holds the run id, host, pid and start time (JSON), and the run keeps it open with an exclusive
``flock``. The kernel drops that lock when the process ends in any way, SIGKILL included, so
whether a holder is still there is decided by the lock, not by reading the file:

- the ``flock`` is held by another process: that run is alive; refused, naming it;
- the ``flock`` is free and the file names a run on **this host** whose pid is not running, or
  names nothing (a run killed before it wrote its record): the holder is provably gone, and the
  new run takes the lock over (``WriterLock.taken_over`` says from whom) -- so the same command
  resumes after a crash or ``kill -9`` without a hand edit;
- the ``flock`` is free but the file names a live pid on this host (a run of an earlier version,
  which did not take the ``flock``) or a run on **another host** (a shared file system, where
  neither its pid nor, on some file systems, its ``flock`` can be checked from here): refused,
  saying how to check and what to delete.

Two runs starting together cannot both win: the ``flock`` is taken before anything else, and a
file unlinked by a releasing holder between another run's ``open`` and its ``flock`` is noticed
(the path no longer names the locked file) and opened afresh. A run that ends normally, by an
exception or by SIGTERM / SIGINT (``apps.training.interrupts``) removes the file; ``writer.lock``
itself is never followed if it is a symlink.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import stat
from pathlib import Path

from torch_side.checkpoint.sharded_files import CheckpointError

__all__ = ["LOCK", "WriterLock"]

LOCK = "writer.lock"
_MAX_RECORD = 4096  # bytes of the holder's record that are read


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _record(fd: int) -> dict | None:
    try:
        holder = json.loads(os.pread(fd, _MAX_RECORD, 0))
    except (OSError, ValueError, RecursionError):
        return None
    return holder if isinstance(holder, dict) else None


def _provably_gone(holder: dict | None) -> bool:
    """With the flock free: may this record's run be taken over? (module note)"""
    if holder is None:
        return True  # killed before it wrote its record (the flock says it is not running)
    pid = holder.get("pid")
    return (holder.get("host") == socket.gethostname() and type(pid) is int
            and not _pid_alive(pid))


def _open(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     0o644)
    except OSError as e:
        what = "a symbolic link" if e.errno == errno.ELOOP else f"not usable ({e})"
        raise CheckpointError(f"{path} is {what}; refused as a writer lock. Remove it if no run "
                              f"saves into {path.parent}, or use another --save-dir") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file; refused as a writer lock. Remove "
                              f"it, or use another --save-dir")
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


class WriterLock:
    """``<save_dir>/writer.lock`` held by this process for ``run_id`` (see the module note)."""

    def __init__(self, path: Path, run_id: str, fd: int, taken_over: dict | None):
        self.path, self.run_id = path, run_id
        self._fd: int | None = fd
        self.taken_over = taken_over  # the record of the gone holder this lock replaced, if any

    @classmethod
    def acquire(cls, save_dir: str | os.PathLike, run_id: str) -> WriterLock:
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        path = save_dir / LOCK
        for _ in range(8):  # another holder may release (unlink) it between our open and flock
            fd = _open(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _record(fd)
                os.close(fd)
                raise CheckpointError(_refusal(save_dir, path, holder, locked=True)) from None
            if not _same_file(fd, path):
                os.close(fd)
                continue
            holder = _record(fd)
            if not _provably_gone(holder):
                os.close(fd)
                raise CheckpointError(_refusal(save_dir, path, holder, locked=False))
            return cls._take(path, run_id, fd, holder)
        raise CheckpointError(f"{path} kept being replaced while this run tried to take it; "
                              f"another run is starting there: use another --save-dir")

    @classmethod
    def _take(cls, path: Path, run_id: str, fd: int, gone: dict | None) -> WriterLock:
        record = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        data = json.dumps(record).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        return cls(path, run_id, fd, gone)

    def held(self) -> bool:
        """Whether ``writer.lock`` is still this run's (nobody deleted and retook it)."""
        if self._fd is None or not _same_file(self._fd, self.path):
            return False
        holder = _record(self._fd)
        return holder is not None and holder.get("run_id") == self.run_id

    def release(self) -> None:
        """Remove the lock file if it is still ours, then drop the flock (in that order: a run
        waiting to take it then finds no file, or a new one)."""
        if self._fd is None:
            return
        try:
            if self.held():
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def _refusal(save_dir: Path, path: Path, holder: dict | None, *, locked: bool) -> str:
    head = (f"--save-dir {save_dir} is locked by another run: {path} is held, so a second run "
            f"saving there would replace that run's checkpoints")
    if holder is None:
        who = "a run that has not written its record yet"
    else:
        who = (f"run {holder.get('run_id')} (pid {holder.get('pid')} on host "
               f"{holder.get('host')}, since {holder.get('started')})")
    if locked:
        return (f"{head}; it is held by {who}, which is running. Wait for that run to end, or "
                f"use another --save-dir (to resume from its checkpoints, pass --resume "
                f"{save_dir} with a new --save-dir)")
    pid = None if holder is None else holder.get("pid")
    here = holder is not None and holder.get("host") == socket.gethostname()
    why = (f"process {pid} is running on this host (a run of an earlier version, "
           f"or a reused pid)" if here else
           "it was taken on another host, where this run cannot check that it is gone")
    return (f"{head}; it names {who} and {why}. If no run saves into {save_dir}, delete {path} "
            f"and start again; otherwise use another --save-dir")
