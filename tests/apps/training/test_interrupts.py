"""Interrupted runs (``apps.training.interrupts``): SIGTERM and SIGINT unwind a run, releasing the
writer lock and abandoning a save in progress, so the same command resumes into its own
directory; after SIGKILL the next run takes the lock over. The end-to-end runs are slow: each
starts ``mxfp8-train`` (or ``torchrun``), waits for its first checkpoint, signals it, checks
what it left, and resumes from it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.training.interrupts import Interrupted, unwinding

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_becomes_an_exception_once_and_the_handlers_come_back(signum, status):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(Interrupted) as info, unwinding():
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises here
        finally:
            os.kill(os.getpid(), signum)  # a second signal while unwinding: ignored
            time.sleep(0.05)
    assert info.value.signum == signum and info.value.exit_status == status
    assert {s: signal.getsignal(s) for s in before} == before


# ---- end to end: each signal, what the run leaves, and the resume --------------------------

_SMALL = ["--micro-batches", "1", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
          "--no-progress", "--save-every", "1"]
_TRAIN = ["--nproc", "1", *_SMALL]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One private compilation cache for this module's launches (the first one compiles)."""
    path = tmp_path_factory.mktemp("interrupt_cache")
    path.chmod(0o700)
    return path


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "MXFP8_JAX_CACHE": str(cache),
            "PYTHONUNBUFFERED": "1"}


def _start(cmd: list[str], save: Path, cache: Path) -> subprocess.Popen:
    """Start a long run saving every step into ``save``; return once its first checkpoint is
    complete (``latest`` exists)."""
    proc = subprocess.Popen(cmd + ["--steps", "100000", "--save-dir", str(save)], cwd=ROOT,
                            env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (save / "latest").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"no checkpoint appeared (exit {proc.returncode}):\n{err[-3000:]}")
        time.sleep(0.2)
    return proc


def _left(save: Path) -> list[str]:
    return sorted(p.name for p in save.iterdir() if not p.name.startswith("step_"))


def _resume(save: Path, cache: Path) -> subprocess.CompletedProcess:
    """The same command with --resume: two steps past the last checkpoint."""
    step = int((save / "latest").read_text().strip().split("_")[1])
    done = subprocess.run(
        [sys.executable, "-m", "apps.training", *_TRAIN, "--steps", str(step + 2), "--resume",
         str(save), "--save-dir", str(save), "--metrics", str(save.parent / "resumed.jsonl")],
        cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(x) for x in (save.parent / "resumed.jsonl").read_text().splitlines()]
    assert records[0]["resumed_from"] == step
    assert [r["step"] for r in records if r["kind"] == "step"] == [step, step + 1]
    assert _left(save) == ["latest"]  # lock released, nothing half-written
    return done


def _interrupt(proc: subprocess.Popen, signum: int, *, group: bool = False) -> tuple[int, str]:
    (os.killpg if group else os.kill)(proc.pid, signum)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_sigterm_or_ctrl_c_releases_the_lock_and_the_same_command_resumes(tmp_path, cache, how):
    """SIGTERM to the launcher (it stops its ranks, which unwind), or Ctrl-C (SIGINT to the
    launcher and every rank, as a terminal sends it): exit 143 / 130 with a message, no
    writer.lock, no staging directory, ``latest`` naming a complete checkpoint."""
    save = tmp_path / "ck"
    proc = _start([sys.executable, "-m", "apps.training", *_TRAIN], save, cache)
    signum = signal.SIGTERM if how == "sigterm" else signal.SIGINT
    status, err = _interrupt(proc, signum, group=how == "ctrl-c")
    assert status == 128 + signum, err[-3000:]
    assert f"interrupted by {signal.Signals(signum).name}" in err, err[-3000:]
    assert f"the same command with --resume {save} continues" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert _left(save) == ["latest"]
    _resume(save, cache)


@pytest.mark.slow
def test_after_sigkill_the_next_run_takes_the_lock_over(tmp_path, cache):
    """SIGKILL to the launcher: its ranks die with it (no cleanup at all), writer.lock stays;
    the same command resumes, taking the lock over (its holder is provably gone)."""
    save = tmp_path / "ck"
    proc = _start([sys.executable, "-m", "apps.training", *_TRAIN], save, cache)
    status, _ = _interrupt(proc, signal.SIGKILL)
    assert status == -signal.SIGKILL
    assert "writer.lock" in _left(save)
    done = _resume(save, cache)
    assert "taken over from run" in done.stderr and "no longer running" in done.stderr


@pytest.mark.slow
def test_a_preemption_sigterm_to_torchrun_releases_the_lock(tmp_path, cache):
    """SIGTERM to torchrun (how schedulers preempt a job): torchrun passes it to its workers,
    which unwind; the lock is released and the run resumes."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun is installed with torch"
    save = tmp_path / "ck"
    proc = _start([torchrun, "--standalone", "--nproc_per_node", "1", "-m", "apps.training",
                   *_SMALL], save, cache)
    status, err = _interrupt(proc, signal.SIGTERM)
    assert status != 0
    assert "interrupted by SIGTERM" in err, err[-3000:]
    if "forcefully exiting via" in err:
        # torchrun waits 30 s for its workers, then SIGKILLs them (as a scheduler does after
        # its grace period): on a loaded machine the unwinding may not finish in time; the
        # lock of the killed worker is then taken over by the resume, as after any SIGKILL
        left = _left(save)
        done = _resume(save, cache)
        if "writer.lock" in left:
            assert "taken over from run" in done.stderr, done.stderr[-3000:]
        return
    assert _left(save) == ["latest"], err[-3000:]
    _resume(save, cache)
