"""A diverged run stops (or skips the step, ``OnNonFinite.SKIP``) instead of training on NaN
(issue 17 item 5): in-process, one gloo rank, the tiny GPT. The training tests are marked slow:
together ~45 s on a loaded 2-core box, most of it compiling the JAX programs once."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch.distributed as dist

from apps.training import loop
from apps.training.job import TrainJob
from apps.training.loop import (
    NonFiniteTraining,
    OnNonFinite,
    RunOptions,
    StepOutcome,
    train_rank,
)
from apps.training.lr_schedule import ScheduleConfig
from torch_side.fsdp.optimizer import FSDPOptimizer

JOB = TrainJob(steps=5, micro_batches=1, batch_size=2, seq_len=32, eval_batches=1, seed=2)


@pytest.fixture(scope="module")
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _opts(tmp_path, **kw) -> RunOptions:
    return RunOptions(progress=False, precompile=False, metrics=str(tmp_path / "m.jsonl"), **kw)


def _step_records(tmp_path) -> list[dict]:
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


@pytest.mark.slow
def test_a_diverged_run_stops_naming_the_step_and_saves_nothing_after_it(one_rank, tmp_path):
    """--lr 1e5 used to train on NaN to the end and save a checkpoint of NaN weights."""
    job = TrainJob(**{**JOB.__dict__, "lr": 1e5, "steps": 8})
    with pytest.raises(NonFiniteTraining) as err:
        train_rank(job, _opts(tmp_path, save_dir=str(tmp_path / "ckpt"), save_every=1))
    records = _step_records(tmp_path)
    stopped = records[-1]
    assert stopped["outcome"] == StepOutcome.STOPPED.value
    assert stopped["loss"] is None or stopped["grad_norm"] is None  # non-finite: null
    assert all(r["outcome"] == "applied" and math.isfinite(r["grad_norm"])
               for r in records[:-1])
    k = stopped["step"]
    text = str(err.value)
    assert text.startswith(f"step {k}: non-finite training (loss "), text
    assert "global gradient norm" in text and "(--on-nonfinite skip)" in text, text
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert all(int(name.split("_")[1]) <= k for name in saved), (k, saved)
    assert not any(r["kind"] == "eval" for r in map(json.loads, (tmp_path / "m.jsonl")
                                                    .read_text().splitlines()))


@pytest.mark.slow
@pytest.mark.parametrize(("steps", "save_every", "saved"), [
    (2, 0, []),  # the last step diverges; its checkpoint is the final one
    (4, 1, ["step_000001"]),  # a middle step: the checkpoint after it is refused
], ids=["last-step", "middle-step"])
def test_an_update_whose_forward_overflows_is_never_saved(one_rank, tmp_path, monkeypatch,
                                                          steps, save_every, saved):
    """``--lr 1e37 --steps 1 --save-dir d`` applied a finite step (loss 4.86, gradient norm
    0.86), saved its state, reported held-out loss NaN and exited 0 with ``latest`` naming it.
    Every main weight was finite (~1e37), and so were their bf16 casts and MXFP8 planes (scale
    2^115): the first linear layer's output, 1e37 x 1e37, overflows fp32. Such a state is now
    never saved, at the last step or any other, and the run stops (exit status 1)."""
    real = ScheduleConfig.lr_at
    monkeypatch.setattr(ScheduleConfig, "lr_at",
                        lambda self, step: 1e37 if step == 1 else real(self, step))
    ckpt = tmp_path / "ckpt"
    job = dataclasses.replace(JOB, steps=steps)
    with pytest.raises(NonFiniteTraining) as err:
        train_rank(job, _opts(tmp_path, save_dir=str(ckpt), save_every=save_every))
    text = str(err.value)
    assert text.startswith("step 1: its update made the held-out loss nan, although the step's "
                           "loss ("), text
    assert ("at lr 1e+37 it moved the weights to where the forward overflows (every main "
            "weight is finite, the largest of magnitude 1e+37)") in text, text
    assert "no checkpoint of this state is written" in text
    assert sorted(p.name for p in ckpt.glob("step_*")) == saved
    latest = ckpt / "latest"
    assert (latest.read_text().strip() if latest.exists() else None) == (
        saved[-1] if saved else None)  # still the last good checkpoint
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["kind"], r.get("outcome")) for r in records[1:]] == [
        ("step", "applied"), ("step", "applied"), ("eval", None)]
    assert records[-1] == {"kind": "eval", "step": 2, "heldout_loss": None}


def _nan_norm_at(monkeypatch, steps: set[int]) -> list[int]:
    """Make the global gradient norm NaN at the given steps (counted from 0); returns the list
    that records every FSDPOptimizer.step() call by step index."""
    real_fb, real_step = loop._forward_backward, FSDPOptimizer.step
    seen = {"step": -1}
    updates: list[int] = []

    def forward_backward(m, job, position):
        seen["step"] += 1
        loss, norm = real_fb(m, job, position)
        return loss, (math.nan if seen["step"] in steps else norm)

    def step(self):
        updates.append(seen["step"])
        real_step(self)

    monkeypatch.setattr(loop, "_forward_backward", forward_backward)
    monkeypatch.setattr(FSDPOptimizer, "step", step)
    return updates


@pytest.mark.slow
def test_skip_drops_the_step_counts_it_and_goes_on(one_rank, tmp_path, monkeypatch):
    updates = _nan_norm_at(monkeypatch, {1, 2})
    result = train_rank(JOB, _opts(tmp_path, on_nonfinite=OnNonFinite.SKIP))
    assert [s.outcome for s in result.steps] == [
        StepOutcome.APPLIED, StepOutcome.SKIPPED, StepOutcome.SKIPPED, StepOutcome.APPLIED,
        StepOutcome.APPLIED,
    ]
    assert updates == [0, 3, 4]  # no optimizer step for a skipped step
    assert math.isfinite(result.heldout_loss)
    records = _step_records(tmp_path)
    assert [r["outcome"] for r in records] == [s.outcome.value for s in result.steps]
    assert records[1]["grad_norm"] is None and math.isfinite(records[3]["grad_norm"])


@pytest.mark.slow
def test_skip_stops_after_too_many_consecutive_skips(one_rank, tmp_path, monkeypatch):
    _nan_norm_at(monkeypatch, {1, 2, 3})
    with pytest.raises(NonFiniteTraining, match=r"^step 3: non-finite training .* after 2 "
                                                r"consecutive skipped steps"):
        train_rank(JOB, _opts(tmp_path, on_nonfinite="skip", max_consecutive_skips=2))
    assert [r["outcome"] for r in _step_records(tmp_path)] == [
        "applied", "skipped", "skipped", "stopped"]


@pytest.mark.slow
def test_clipping_never_touches_a_nonfinite_step_and_the_schedule_counts_it(one_rank, tmp_path,
                                                                             monkeypatch):
    """--grad-clip with a NaN norm: the step is skipped before any clipping (clip_grad_norm_ is
    not called, so the gradients are not scaled to NaN), the learning rate still follows the
    step index, and the finite steps are clipped by the norm already computed."""
    updates = _nan_norm_at(monkeypatch, {1})
    clipped: list[float] = []
    real_clip = loop.clip_grad_norm_

    def clip(opt, max_norm, *, total_norm):
        clipped.append(total_norm)
        return real_clip(opt, max_norm, total_norm=total_norm)

    monkeypatch.setattr(loop, "clip_grad_norm_", clip)
    job = TrainJob(**{**JOB.__dict__, "grad_clip": 1e-3, "lr_schedule": "linear",
                      "warmup_steps": 2})
    result = train_rank(job, _opts(tmp_path, on_nonfinite=OnNonFinite.SKIP))
    assert [s.outcome.value for s in result.steps] == ["applied", "skipped", "applied",
                                                       "applied", "applied"]
    assert updates == [0, 2, 3, 4]
    norms = [s.grad_norm for s in result.steps]
    assert clipped == [norms[0], norms[2], norms[3], norms[4]]  # once per applied step
    records = _step_records(tmp_path)
    assert [r["lr"] for r in records] == [job.schedule().lr_at(s) for s in range(5)]
    assert [s.lr for s in result.steps] == [r["lr"] for r in records]


def test_run_options_validation():
    with pytest.raises(ValueError, match="'sometimes' is not a valid OnNonFinite"):
        RunOptions(on_nonfinite="sometimes")
    with pytest.raises(ValueError, match="max_consecutive_skips=0: expected an integer >= 1"):
        RunOptions(max_consecutive_skips=0)
