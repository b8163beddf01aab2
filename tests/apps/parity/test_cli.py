"""The parity command line refuses arguments it cannot honour (argparse errors, exit code 2)."""

from __future__ import annotations

import pytest

from apps.parity.cli import parse_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["--world-size", "-2"], "--world-size must be >= 1, got -2"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    ],
)
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_and_single_process():
    assert parse_args([]).world_size == 2
    assert parse_args(["--world-size", "1", "--device", "cuda"]).device == "cuda"
    assert parse_args(["--world-size", "2", "--device", "cuda"]).device == "cuda"  # NCCL ranks
