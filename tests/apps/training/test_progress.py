"""Rank 0's progress display (``apps.training.progress``): a bar on a terminal, plain lines
every N steps in a log that is not one (CI, nohup, a file: where a bar's carriage-return
redraws all stay in the text, hundreds per run)."""

from __future__ import annotations

import io

from apps.training import cli
from apps.training.progress import BarProgress, LineProgress, progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream, *, total=25, start=0, every=10):
    shown = progress("mxfp8", total, start, every=every, stream=stream)
    for step in range(start, total):
        shown.show(step, 4.0 - step / 100, 1234.0, 0.25)
    shown.close()
    return shown


def test_a_log_gets_a_line_on_the_first_step_every_n_steps_and_the_last():
    log = io.StringIO()
    assert isinstance(_run(log), LineProgress)
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "mxfp8: step 1/25", "mxfp8: step 10/25", "mxfp8: step 20/25", "mxfp8: step 25/25"]
    assert lines[-1].startswith("mxfp8: step 25/25, loss 3.7600, 1,234 tokens/s, 0.250 s/step, ")
    assert lines[-1].endswith(" s elapsed")


def test_a_resumed_run_shows_its_own_first_step_then_the_multiples():
    log = io.StringIO()
    _run(log, total=30, start=13)
    assert [line.split(",")[0] for line in log.getvalue().splitlines()] == [
        "mxfp8: step 14/30", "mxfp8: step 20/30", "mxfp8: step 30/30"]


def test_a_terminal_gets_the_bar():
    tty = _Terminal()
    assert isinstance(_run(tty), BarProgress)
    assert "\r" in tty.getvalue() and "25/25" in tty.getvalue()


def test_the_interval_is_a_flag():
    assert cli._runs(cli.parse_args(["--progress-every", "5"]))[0][2].progress_every == 5
    assert cli._runs(cli.parse_args([]))[0][2].progress_every == 10
