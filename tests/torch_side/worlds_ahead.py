"""Run the session's spawned worlds ahead, in a helper process, while pytest runs other tests.

A world's ranks spend much of their time compiling JAX programs one after another (one core
busy, ``tests/compile_once.py``), and most tests in the pytest process use one core too: on the
2-core CI box the two overlap. ``start(plan)`` (tests/torch_side/conftest.py, at the end of
collection) starts ``python -m tests.torch_side.worlds_ahead``, which runs each planned world
in turn through ``run_cases``, exactly as the ``spawned`` fixture would, and writes its
outcomes to a file; the fixture reads them when a test needs them (waiting if the world is
still running). The helper runs in its own process so that the pytest process's monkeypatching
(``tempfile.tempdir``, ``multiprocessing.get_context`` in test_launch.py, environment
variables) never reaches these launches; its output (and its ranks') goes to a log file, whose
tail a test reports when the helper itself fails.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.torch_side.multiprocess import CaseOutcome

_ROOT = Path(__file__).resolve().parents[2]


class WorldsAhead:
    """The helper process and where it writes each world's outcomes."""

    def __init__(self, plan: list[tuple[int, list[str]]]):
        self.plan = plan
        self.dir = Path(tempfile.mkdtemp(prefix="worlds_ahead_"))
        (self.dir / "plan.json").write_text(json.dumps(plan))
        self.log = self.dir / "helper.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.torch_side.worlds_ahead", str(self.dir)],
                cwd=_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )

    def outcomes(self, index: int) -> dict[str, CaseOutcome]:
        """The outcomes of ``plan[index]``, waiting for its world to finish."""
        path = self.dir / f"world{index}.json"
        while not path.exists():
            if self.proc.poll() is not None and not path.exists():
                tail = self.log.read_text(errors="replace")[-6000:]
                detail = (f"the helper running the worlds ahead (tests/torch_side/worlds_ahead.py)"
                          f" exited with status {self.proc.returncode} before this world "
                          f"finished; its output ends:\n{tail}")
                return {name: CaseOutcome(False, detail) for name in self.plan[index][1]}
            time.sleep(0.2)
        return {name: CaseOutcome(ok, detail)
                for name, (ok, detail) in json.loads(path.read_text()).items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the launcher ends its ranks on SIGTERM (torch_side.launch)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in self.dir.iterdir():
            f.unlink()
        self.dir.rmdir()


def _die_with_pytest() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: pytest killed -> this helper ends too
    except OSError:
        pass


def main(directory: str) -> None:
    _die_with_pytest()
    # the environment is pytest's (tests/conftest.py set XLA_FLAGS there), as for its own spawns
    from tests.torch_side.multiprocess import run_cases

    out = Path(directory)
    for index, (world_size, names) in enumerate(json.loads((out / "plan.json").read_text())):
        outcomes = run_cases(world_size, names)
        tmp = out / f"world{index}.json.tmp"
        tmp.write_text(json.dumps({n: (o.ok, o.detail) for n, o in outcomes.items()}))
        os.replace(tmp, out / f"world{index}.json")  # the reader never sees half a file


if __name__ == "__main__":
    main(sys.argv[1])
