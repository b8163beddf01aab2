"""The training application end to end on two ranks, threads of this process (``run_ranks``: the
threaded process group; the spawned launch is test_cli's), all marked slow.

- MXFP8 trains (the held-out loss falls) and tracks the fp32 control from the same seed and data:
  the curves differ only by the MXFP8 quantization of weights, activations and gradients.
- Save at step k and resume: the losses after k equal an uninterrupted run's bit for bit (world
  size 2, MXFP8, ZeRO-3 and ZeRO-2); resuming at world size 1 with the same global batch agrees to
  fp32 summation order; bad checkpoints (truncated, one rank's files from another run) give clear
  errors naming the file (the other refusals: test_checkpoint.py, in one process).
- With warmup, cosine decay, gradient clipping and bf16 weight gathers, a resume mid-warmup
  (step 2) and mid-decay (step 4) is bit-exact too; every step record holds the schedule's lr
  and the global gradient norm; and the bf16-gather run's losses equal an MXFP8-gather run's
  bit for bit.
- ``FSDPModel.state_dict()`` holds the full main weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from apps.training.checkpoint import CheckpointError
from apps.training.job import TrainJob, Weights
from apps.training.loop import RunOptions, train_rank
from tests.torch_side.threaded_world import run_ranks
from torch_side import ShardingStrategy

pytestmark = pytest.mark.slow

JOB = TrainJob(steps=6, micro_batches=2, batch_size=4, seq_len=32, lr=1e-2, seed=3)
# warmup over steps 0-2, cosine decay over 3-5, clipped (the tiny GPT's norms: ~0.8-1.2)
SCHED = dataclasses.replace(JOB, lr_schedule="cosine", warmup_steps=3, min_lr=1e-3,
                            grad_clip=0.3, gather="bf16")


def _losses(result) -> dict[int, float]:
    return {s.step: s.loss for s in result.steps}


def _train_and_resume(root: str) -> dict:
    """On every rank: full runs saving at step 3, then runs resumed from step 3 (ZeRO-3, and
    ZeRO-2 with both blocks in one FSDP unit: a unit named "h_0+h_1"), and the fp32 control."""
    out = {}
    zero2 = dataclasses.replace(JOB, strategy=ShardingStrategy.OPTIM_GRADS, blocks_per_unit=2)
    for name, job in (("zero3", JOB), ("zero2", zero2)):
        save = f"{root}/{name}"
        full = train_rank(job, RunOptions(save_dir=save, save_every=3, progress=False,
                                          metrics=f"{root}/{name}.jsonl"))
        resumed = train_rank(job, RunOptions(resume=f"{save}/step_000003", progress=False))
        out[name] = (_losses(full), _losses(resumed), full.heldout_loss, resumed.heldout_loss)
        if name == "zero3":  # the first step of JOB: where training starts from
            out["start"] = (full.initial_loss, full.steps[0].loss)
    save = f"{root}/sched"
    full = train_rank(SCHED, RunOptions(save_dir=save, save_every=2, progress=False,
                                        metrics=f"{root}/sched.jsonl"))
    resumed = [train_rank(SCHED, RunOptions(resume=f"{save}/step_00000{k}", progress=False))
               for k in (2, 4)]
    mx = train_rank(dataclasses.replace(SCHED, gather="mxfp8"), RunOptions(progress=False))
    out["sched"] = (_losses(full), [_losses(r) for r in resumed], _losses(mx),
                    [full.heldout_loss] + [r.heldout_loss for r in resumed])
    control = train_rank(JOB.control(), RunOptions(progress=False))
    out["control"] = (_losses(control), control.heldout_loss)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two ranks in threads of this process (``run_ranks``; the spawned launch is test_cli's)."""
    root = tmp_path_factory.mktemp("train")
    return root, run_ranks(_train_and_resume, 2, (str(root),))


def test_every_rank_reports_the_same_losses(two_ranks):
    _, results = two_ranks
    assert results[0] == results[1]


@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
def test_resume_continues_the_loss_curve_bit_for_bit(two_ranks, strategy):
    _, results = two_ranks
    full, resumed, held_full, held_resumed = results[0][strategy]
    assert sorted(resumed) == [3, 4, 5]
    assert {k: full[k] for k in resumed} == resumed  # exact float equality
    assert held_full == held_resumed


def test_schedule_clipping_and_bf16_gathers_resume_bit_for_bit(two_ranks):
    root, results = two_ranks
    full, (from2, from4), mx, held = results[0]["sched"]
    assert sorted(from2) == [2, 3, 4, 5] and sorted(from4) == [4, 5]
    assert {k: full[k] for k in from2} == from2  # mid-warmup resume, exact
    assert {k: full[k] for k in from4} == from4  # mid-decay resume, exact
    assert held[0] == held[1] == held[2]
    assert mx == full  # MXFP8 and bf16 weight gathers: the same losses, bit for bit
    steps = [r for r in map(json.loads, (root / "sched.jsonl").read_text().splitlines())
             if r["kind"] == "step"]
    assert [r["lr"] for r in steps] == [SCHED.schedule().lr_at(s) for s in range(6)]
    assert steps[0]["lr"] == SCHED.lr / 3 and steps[2]["lr"] == SCHED.lr  # warmup
    assert steps[5]["lr"] < steps[4]["lr"] < steps[3]["lr"] == SCHED.lr  # decay from lr
    assert any(r["grad_norm"] > SCHED.grad_clip for r in steps), steps  # clipping did act


def test_mxfp8_learns_and_tracks_the_fp32_control(two_ranks):
    _, results = two_ranks
    mx, _, held_mx, _ = results[0]["zero3"]
    fp32, held_fp32 = results[0]["control"]
    initial, first = results[0]["start"]
    assert abs(first - initial) < 0.05  # starts near a uniform prediction
    assert held_mx < initial - 0.25, (initial, held_mx)  # 6 steps at lr 1e-2 move it ~0.4
    diffs = [abs(mx[k] - fp32[k]) for k in mx]
    # MXFP8 vs fp32 differ by the quantization only: a few 1e-3 nats per step (measured <= 0.02)
    assert max(diffs) < 0.1 and abs(held_mx - held_fp32) < 0.1, (diffs, held_mx, held_fp32)


def test_metrics_file_holds_a_run_record_every_step_and_the_held_out_loss(two_ranks):
    root, results = two_ranks
    records = [json.loads(line) for line in (root / "zero3.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["run"] + ["step"] * 6 + ["eval"]
    run, steps, final = records[0], records[1:-1], records[-1]
    assert run["world_size"] == 2 and run["job"]["weights"] == "mxfp8" and run["loss_floor"] > 0
    full = results[0]["zero3"][0]
    for r in steps:
        assert set(r) >= {"step", "loss", "tokens_per_s", "step_s"}
        assert r["loss"] == full[r["step"]]  # the JSON number is the float, exactly
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
    assert final["step"] == 6 and final["heldout_loss"] == results[0]["zero3"][2]


def _resume_on_one_rank(save: str, root: str) -> dict:
    """World size 1 resumes the 2-rank checkpoint with the same global batch (8 per micro-batch
    instead of 4 per rank), then exercises bad checkpoints."""
    job = dataclasses.replace(JOB, batch_size=8)
    resumed = train_rank(job, RunOptions(resume=f"{save}/step_000003", progress=False))
    errors = {}

    def attempt(name, path, j=job):
        try:
            train_rank(j, RunOptions(resume=path, progress=False))
        except CheckpointError as e:
            errors[name] = str(e)

    attempt("missing", f"{root}/nowhere")
    attempt("config", f"{save}/step_000003", dataclasses.replace(job, weights=Weights.FP32))
    bad = Path(root, "bad")
    # a truncated data file
    trunc = bad / "trunc"
    _copy(Path(save, "step_000003"), trunc)
    data = trunc / "rank_00001.bin"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    attempt("truncated", str(trunc))
    # one rank's files from another run at the same step (the ZeRO-2 run, one unit of 2 blocks)
    mixed = bad / "mixed"
    _copy(Path(save, "step_000003"), mixed)
    for name in ("rank_00001.bin", "rank_00001.json"):
        (mixed / name).write_bytes(Path(root, "zero2", "step_000003", name).read_bytes())
    attempt("mixed", str(mixed))
    # an incomplete checkpoint: meta.json missing
    incomplete = bad / "incomplete"
    _copy(Path(save, "step_000003"), incomplete)
    (incomplete / "meta.json").unlink()
    attempt("incomplete", str(incomplete))
    return {"losses": _losses(resumed), "errors": errors}


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())


@pytest.fixture(scope="module")
def one_rank(two_ranks):
    root, _ = two_ranks
    return run_ranks(_resume_on_one_rank, 1, (str(root / "zero3"), str(root)))[0]


def test_resume_at_another_world_size_agrees_to_summation_order(two_ranks, one_rank):
    _, results = two_ranks
    full = results[0]["zero3"][0]
    got = one_rank["losses"]
    assert sorted(got) == [3, 4, 5]
    for k, v in got.items():  # the same samples per step; gradients summed in another order
        assert v == pytest.approx(full[k], rel=1e-4), (k, v, full[k])


def test_bad_checkpoints_are_refused_naming_the_file(two_ranks, one_rank):
    root, _ = two_ranks
    errors = one_rank["errors"]
    assert "does not exist" in errors["missing"] and "nowhere" in errors["missing"]
    assert "weights='mxfp8'" in errors["config"] and "meta.json" in errors["config"]
    assert "truncated" in errors["truncated"] and "bad/trunc/rank_00001.bin" in errors["truncated"]
    assert "bad/mixed/rank_00001.json is " in errors["mixed"]  # corrupt, or of another size
    assert "or a file of another run" in errors["mixed"]
    assert "is not a checkpoint" in errors["incomplete"]
