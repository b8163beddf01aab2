"""``apps.training.writer_lock``: one writer per checkpoint directory; a holder that is provably
gone (its flock released, its pid dead on this host) is taken over, one that may be alive is
named; the lock file is never followed through a symlink."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from apps.training.writer_lock import LOCK, WriterLock
from torch_side.checkpoint.sharded_files import CheckpointError

_HOLD = """
import sys, time
from apps.training.writer_lock import WriterLock
lock = WriterLock.acquire(sys.argv[1], "holder-run")
print("held", flush=True)
time.sleep(600)
"""


def _holder(save_dir):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(save_dir)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_refused_and_a_killed_one_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(CheckpointError, match=rf"held by run holder-run \(pid {proc.pid} "
                                                  rf".*which is running"):
            WriterLock.acquire(tmp_path, "second")
    finally:
        proc.send_signal(signal.SIGKILL)  # no cleanup at all: the file stays
        proc.wait()
        proc.stdout.close()
    assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "holder-run"
    lock = WriterLock.acquire(tmp_path, "second")
    assert lock.taken_over["run_id"] == "holder-run" and lock.held()
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_a_record_whose_pid_runs_here_but_holds_no_flock_is_refused(tmp_path):
    """E.g. a run of an earlier version (no flock), or a reused pid: refusing is safe."""
    (tmp_path / LOCK).write_text(json.dumps({"run_id": "old", "host": socket.gethostname(),
                                              "pid": os.getpid(), "started": "earlier"}))
    with pytest.raises(CheckpointError, match=rf"names run old \(pid {os.getpid()}.*is running "
                                              rf"on this host.*delete {tmp_path / LOCK}"):
        WriterLock.acquire(tmp_path, "new")
    assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "old"


def test_a_record_of_another_host_is_refused(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"run_id": "far", "host": "elsewhere", "pid": 1}))
    with pytest.raises(CheckpointError, match="taken on another host, where this run cannot "
                                              "check that it is gone"):
        WriterLock.acquire(tmp_path, "new")


def test_an_empty_lock_file_nobody_holds_is_taken_over(tmp_path):
    (tmp_path / LOCK).write_text("")  # a run killed between creating and writing it
    lock = WriterLock.acquire(tmp_path, "new")
    assert lock.taken_over is None and lock.held()
    lock.release()


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / LOCK).symlink_to(victim)
    with pytest.raises(CheckpointError, match="is a symbolic link; refused as a writer lock"):
        WriterLock.acquire(tmp_path, "new")
    assert victim.read_text() == "precious"


def test_of_runs_starting_together_exactly_one_wins(tmp_path):
    won, refused, go = [], [], threading.Event()

    def start(i):
        go.wait()
        try:
            won.append(WriterLock.acquire(tmp_path, f"run{i}"))
        except CheckpointError:
            refused.append(i)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    go.set()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7
    assert json.loads((tmp_path / LOCK).read_text())["run_id"] == won[0].run_id
    won[0].release()


def test_a_lock_deleted_and_retaken_is_no_longer_held(tmp_path):
    lock = WriterLock.acquire(tmp_path, "first")
    (tmp_path / LOCK).unlink()
    other = WriterLock.acquire(tmp_path, "second")  # a new file: its own flock
    assert not lock.held() and other.held()
    lock.release()  # not ours any more: left alone
    assert json.loads((tmp_path / LOCK).read_text())["run_id"] == "second"
    other.release()
