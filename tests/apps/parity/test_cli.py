"""The parity command line refuses arguments it cannot honour (argparse errors, exit code 2),
and a checkpoint the replay cannot start from (exit code 2, the reason on stderr)."""

from __future__ import annotations

import json

import pytest

from apps.parity.cli import main, parse_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["--world-size", "-2"], "--world-size must be >= 1, got -2"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--steps", "-3"], "--steps must be >= 1, got -3"),
        (["--from-checkpoint", "/no/such/dir"],
         "--from-checkpoint /no/such/dir: no such directory; pass the --save-dir"),
        (["--lr", "1e-3"], "--lr / --weight-decay set the replay's AdamW; add --steps N"),
        (["--compute", "op", "--activations", "bf16"], "--activations bf16 needs --compute unit"),
        (["--steps", "2", "--device", "cuda"], "the unit report and the replay run on the CPU"),
        # AdamW's first step overflowed inside torch.optim (a traceback); nan trained NaN
        (["--steps", "1", "--lr", "1e38"], "--lr 1e+38: expected a finite learning rate > 0 "
                                           "and <= 3.4e+37"),
        (["--steps", "1", "--lr", "nan"], "--lr nan: expected a finite learning rate > 0"),
        (["--steps", "1", "--weight-decay", "-1"], "--weight-decay -1.0: expected a finite"),
    ],
)
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_and_single_process():
    args = parse_args([])
    assert args.world_size == 2 and args.compute == "unit" and not args.replay
    replay = parse_args(["--steps", "3"])
    assert replay.replay and replay.world_size == 1 and replay.adamw_sqrt == "torch"
    assert parse_args(["--steps", "3", "--world-size", "2"]).world_size == 2
    assert parse_args(["--world-size", "1", "--compute", "op", "--device", "cuda"]).device == "cuda"
    assert parse_args(["--compute", "op", "--device", "cuda"]).device == "cuda"  # NCCL ranks


def test_a_checkpoint_directory_starts_a_five_step_replay(tmp_path):
    args = parse_args(["--from-checkpoint", str(tmp_path)])
    assert args.replay and args.steps == 5 and args.from_checkpoint == str(tmp_path)


def test_a_checkpoint_with_an_edited_job_is_exit_2_naming_the_field(tmp_path, capsys):
    """It was a traceback (KeyError: 'config')."""
    (tmp_path / "meta.json").write_text(json.dumps({
        "job": {"weights": "mxfp8", "activations": "fp32", "lr": 3e-3}, "optimizer": "AdamW",
        "params": {"wte.weight": [128, 64]}}))
    assert main(["--steps", "1", "--from-checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m apps.parity: error: {tmp_path / 'meta.json'}: job field "
                          f"'config' holds None, expected one of ['tiny'"), err
