"""The command line is derived from the job's fields (``apps.training.options``): one flag per
field, every flag ``mxfp8-train`` ever had still there with its meaning, and a job round-trips
through its flags."""

from __future__ import annotations

import argparse
import dataclasses
import enum

import pytest

from apps.training import cli
from apps.training.job import OnNonFinite, RunOptions, TrainJob, Weights
from apps.training.options import Group, add_options, flags, from_args, option, to_argv
from common.kernels import Backend, GemmImpl, KernelConfig
from common.modes import Activations
from torch_side import ShardingStrategy

# The flags of mxfp8-train before its parser was derived from the fields (and their dests).
FLAGS_BEFORE = {
    "--device", "--nproc", "--timeout", "--collective-timeout", "--config", "--weights",
    "--activations", "--strategy", "--recompute", "--backend", "--deterministic", "--gemm",
    "--steps", "--micro-batches", "--batch-size", "--seq-len", "--lr", "--weight-decay",
    "--seed", "--data", "--eval-batches", "--on-nonfinite", "--max-consecutive-skips",
    "--metrics", "--plot", "--save-dir", "--save-every", "--resume", "--compare",
    "--no-progress", "--no-precompile",
}


def _parser_flags() -> list[str]:
    return [s for a in cli.build_parser()._actions for s in a.option_strings if s != "-h"
            and s != "--help"]


def test_every_field_has_exactly_one_flag_and_no_flag_two_fields():
    for cls in (TrainJob, RunOptions, cli.Launch):
        per_field = flags(cls)
        for f in dataclasses.fields(cls):
            if "why" in f.metadata:  # internal(): set by the command line itself
                assert f.name not in per_field
                continue
            expected = 2 if f.name == "kernels" else 1  # one per KernelConfig field
            assert len(per_field[f.name]) == expected, (cls.__name__, f.name, per_field)
    assert [f.name for f in dataclasses.fields(RunOptions) if "why" in f.metadata] == ["label"]
    every = _parser_flags()
    assert len(every) == len(set(every)), sorted(every)


def test_every_flag_the_command_had_is_still_there():
    assert FLAGS_BEFORE <= set(_parser_flags())
    # the flags added since (issue 19: --compute; issue 21: the schedule, gather and
    # instruments; issue 20: the overlap and the trace; issue 19 again: --blocks-per-unit;
    # issue 30: progress lines in a log; issue 34: --init, --replicas, --shard-layout;
    # issue 32: --shared-pool)
    assert set(_parser_flags()) - FLAGS_BEFORE == {"--init", "--replicas", "--shard-layout",
        "--branching", "--compute", "--telemetry", "--telemetry-every", "--digest", "--gather",
        "--lr-schedule", "--warmup-steps", "--min-lr", "--grad-clip",
        "--prefetch", "--sync-reduce", "--trace", "--trace-steps", "--blocks-per-unit",
        "--progress-every", "--shared-pool"}


def test_enum_fields_take_their_enum_values_as_choices():
    choices = {a.option_strings[0]: a.choices for a in cli.build_parser()._actions
               if a.option_strings}
    assert choices["--weights"] == tuple(w.value for w in Weights)
    assert choices["--activations"] == tuple(a.value for a in Activations)
    assert choices["--strategy"] == tuple(s.value for s in ShardingStrategy)
    assert choices["--on-nonfinite"] == tuple(o.value for o in OnNonFinite)
    assert choices["--gather"] == ("mxfp8", "bf16")
    assert choices["--lr-schedule"] == ("constant", "cosine", "linear")
    assert choices["--backend"] == tuple(b.value for b in Backend)
    assert choices["--gemm"] == tuple(g.value for g in GemmImpl)


def test_the_parser_round_trips_a_job_and_its_options():
    job = TrainJob(config="small", weights="bf16", activations="bf16", strategy="optim_grads",
                   recompute="block", steps=7, micro_batches=3, batch_size=5, seq_len=16,
                   lr=1.25e-4, weight_decay=0.1, seed=9, data="stdlib", branching=3,
                   eval_batches=2, device="cuda", kernels=KernelConfig("pallas"),
                   deterministic=True, lr_schedule="cosine", warmup_steps=2, min_lr=1e-5,
                   grad_clip=0.5, blocks_per_unit=2)
    opts = RunOptions(metrics="m.jsonl", save_dir="ck", save_every=2, resume="old",
                      progress=False, precompile=False, on_nonfinite="skip",
                      max_consecutive_skips=4)
    argv = to_argv(job) + to_argv(opts)
    assert "--no-progress" in argv and "--backend" in argv and "--gemm" not in argv
    [(label, job2, opts2)] = cli._runs(cli.parse_args(argv))
    assert job2 == job
    assert opts2 == dataclasses.replace(opts, label="bf16") and label == "bf16"
    assert to_argv(TrainJob()) == [] and to_argv(RunOptions()) == []
    gathered = TrainJob(gather="bf16", strategy="optim")
    assert cli._runs(cli.parse_args(to_argv(gathered)))[0][1] == gathered


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Toy:
    color: Color = option(Color.RED, Group.MODEL, help="a color")
    count: int = option(1, Group.OPTIM)
    loud: bool = option(False, Group.OUTPUTS)
    quiet_mode: bool = option(True, Group.OUTPUTS)
    kernels: KernelConfig | None = option(None, Group.MODEL)


def test_a_dataclass_of_options_becomes_flags_generically():
    """The builder knows nothing of TrainJob: any dataclass of ``option`` fields works."""
    p = argparse.ArgumentParser()
    add_options(p, Toy)
    assert from_args(Toy, p.parse_args([])) == Toy("red", 1, False, True, None)
    got = from_args(Toy, p.parse_args(["--color", "blue", "--count", "3", "--loud",
                                       "--no-quiet-mode", "--gemm", "dequant_dot"]))
    assert got == Toy("blue", 3, True, False, KernelConfig(gemm="dequant_dot"))
    with pytest.raises(SystemExit):
        p.parse_args(["--color", "green"])


def test_a_new_job_field_is_one_declaration(monkeypatch):
    """docs/extending.md, "A training option", from the tests alone: one field declared with
    ``option`` (on a subclass standing in for the edited ``TrainJob``, put where the command line
    reads it) gets its flag in its ``--help`` section, and a job round-trips through it."""

    @dataclasses.dataclass(frozen=True)
    class Job(TrainJob):
        eval_every: int = option(0, Group.OPTIM, help="evaluate every N steps (0: at the end)")

    monkeypatch.setattr(cli, "TrainJob", Job)
    text = cli.build_parser().format_help()
    section = text.split(f"{Group.OPTIM.value}:")[1].split(f"{Group.OUTPUTS.value}:")[0]
    assert "--eval-every" in section and "evaluate every N steps" in section
    job = Job(eval_every=3, steps=2, weights="bf16")
    assert to_argv(job)[-2:] == ["--eval-every", "3"]  # the new field comes last
    [(_, parsed, _)] = cli._runs(cli.parse_args(to_argv(job)))
    assert parsed == job and type(parsed) is Job
    with pytest.raises(SystemExit):
        cli.parse_args(["--eval-every", "three"])
