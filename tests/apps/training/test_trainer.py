"""``Trainer`` (apps.training.loop): the steps of ``train_rank`` driven by hand, in-process on one
gloo rank (slow: it compiles the tiny GPT's JAX programs)."""

from __future__ import annotations

import json

import pytest

from apps.training.job import RunOptions, TrainJob
from apps.training.loop import Trainer, train_rank

JOB = TrainJob(steps=3, micro_batches=1, batch_size=2, seq_len=32, eval_batches=1, seed=2)


def _opts(d, **kw) -> RunOptions:
    return RunOptions(progress=False, precompile=False, metrics=str(d / "m.jsonl"), **kw)


@pytest.mark.slow
def test_a_trainer_driven_step_by_step_is_train_rank(single_rank_world, tmp_path):
    """``Trainer.step`` / ``save`` / ``evaluate`` called by hand give ``train_rank``'s losses, its
    held-out loss and its metrics records (timings aside), and the same checkpoints."""
    job = JOB
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ran = train_rank(job, _opts(tmp_path / "a", save_dir=str(tmp_path / "a" / "ck")))
    with Trainer(job, _opts(tmp_path / "b", save_dir=str(tmp_path / "b" / "ck"))) as t:
        logs = [t.step() for _ in range(job.steps)]
        t.save()
        held = t.evaluate()
    assert [s.loss for s in logs] == [s.loss for s in ran.steps] and held == ran.heldout_loss
    assert [s.grad_norm for s in logs] == [s.grad_norm for s in ran.steps]

    def records(d):
        out = []
        for r in map(json.loads, (d / "m.jsonl").read_text().splitlines()):
            out.append({k: v for k, v in r.items() if k not in ("step_s", "tokens_per_s")})
        return out

    assert records(tmp_path / "a") == records(tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "b" / "ck").iterdir()) == ["latest", "step_000003"]
    assert not (tmp_path / "b" / "ck" / "writer.lock").exists()
