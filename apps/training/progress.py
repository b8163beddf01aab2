"""Rank 0's progress display: a tqdm bar on a terminal, a line every N steps anywhere else.

A bar redraws itself in place with carriage returns. In a log that is not a terminal (CI, nohup,
a file, a notebook cell capturing the output) nothing is redrawn: every update stays in the
text, hundreds per run. So ``progress()`` asks the stream: a terminal gets ``BarProgress``, any
other stream ``LineProgress``, one line on the run's first step (it includes compilation), on
every step that completes a multiple of ``every`` steps, and on the last step.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO

__all__ = ["BarProgress", "LineProgress", "Progress", "progress"]


class Progress(Protocol):
    """What the training loop calls after each step, and once at the end."""

    def show(self, step: int, loss: float, tokens_per_s: float, seconds: float) -> None: ...

    def close(self) -> None: ...


class BarProgress:
    """A tqdm bar (a terminal): loss, tokens/s and step time as its postfix."""

    def __init__(self, label: str, total: int, start: int, stream: TextIO):
        from tqdm import tqdm

        self._bar = tqdm(total=total, initial=start, desc=label, unit="step", file=stream,
                         dynamic_ncols=True, leave=True)

    def show(self, step: int, loss: float, tokens_per_s: float, seconds: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}",
                              step_s=f"{seconds:.3f}")
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


class LineProgress:
    """One plain line per ``every`` steps (and the run's first and last step): for logs."""

    def __init__(self, label: str, total: int, start: int, stream: TextIO, every: int):
        self.label, self.total, self.start, self.stream, self.every = (
            label, total, start, stream, every)
        self._t0 = time.perf_counter()

    def show(self, step: int, loss: float, tokens_per_s: float, seconds: float) -> None:
        done = step + 1  # ``step`` is the 0-based index of the step that just ran
        if step != self.start and done != self.total and done % self.every:
            return
        print(f"{self.label}: step {done}/{self.total}, loss {loss:.4f}, {tokens_per_s:,.0f} "
              f"tokens/s, {seconds:.3f} s/step, {time.perf_counter() - self._t0:.1f} s elapsed",
              file=self.stream, flush=True)

    def close(self) -> None:
        pass


def progress(label: str, total: int, start: int, *, every: int,
             stream: TextIO | None = None) -> Progress:
    """The display for ``stream`` (default: stderr): a bar on a terminal, else lines every
    ``every`` steps. ``start``: the steps already done (a resumed run)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return BarProgress(label, total, start, stream)
    return LineProgress(label, total, start, stream, every)
