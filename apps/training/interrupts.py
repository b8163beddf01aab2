"""SIGTERM and SIGINT unwind a training process instead of killing it where it stands.

Python's default SIGTERM ends the process at once, so nothing in a ``finally`` runs: a rank
killed that way left ``writer.lock`` behind and a half-written checkpoint in its staging
directory. Inside ``unwinding()`` the first SIGTERM or SIGINT raises ``Interrupted`` in the main
thread instead; the exception unwinds the training like any other (``Trainer.close`` releases
the writer lock, a save in progress is abandoned by ``torch_side.checkpoint.step_dirs.abandon``,
which never leaves the step without a complete copy), and the process exits with ``128 + signal``
(143 for SIGTERM, 130 for SIGINT), as a shell reports a process killed by that signal. Signals that
come while it unwinds are ignored, so a second Ctrl-C cannot cut the cleanup short; whoever sent
them may still SIGKILL the process, and the next run then takes the lock over
(``apps.training.writer_lock``).

Who sends what: Ctrl-C in a terminal sends SIGINT to the launcher and every rank; SIGTERM to the
``mxfp8-train`` launcher is passed on to its ranks (``torch_side.launch``); ``torchrun`` passes a
SIGTERM (a preemption notice) on to its workers.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["Interrupted", "unwinding"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """The process received ``signum`` (SIGTERM or SIGINT) and is unwinding. A BaseException,
    like KeyboardInterrupt, so that ``except Exception`` does not swallow it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def unwinding() -> Iterator[None]:
    """While inside, the first SIGTERM or SIGINT raises ``Interrupted`` (module note). Outside
    the main thread (where Python cannot install handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, frame):
        if fired:
            return  # already unwinding: let the cleanup finish
        fired.append(signum)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
