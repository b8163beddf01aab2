"""``Trainer`` (apps.training.loop): the steps of ``train_rank`` driven by hand, in-process on one
gloo rank (slow: it compiles the tiny GPT's JAX programs)."""

from __future__ import annotations

import dataclasses
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
    # both blocks as one FSDP unit (one program per direction): the same numbers
    (tmp_path / "c").mkdir()
    one = dataclasses.replace(job, blocks_per_unit=2)
    with Trainer(one, _opts(tmp_path / "c")) as t:
        assert [u.name for u in t.parts.fsdp.units] == ["<root>", "h_0+h_1"]
        assert [t.step().loss for _ in range(job.steps)] == [s.loss for s in ran.steps]


@pytest.mark.slow
def test_trace_writes_a_chrome_trace_of_the_steps_after_the_first(single_rank_world, tmp_path):
    """``--trace`` (RunOptions.trace): a Chrome trace JSON of steps 1 and 2 with the unit spans,
    their JAX program dispatches, the collectives and the bucket-memory counter; the prefetch
    setting reaches FSDP."""
    path = tmp_path / "traces" / "t.json"  # a directory the trainer creates
    opts = _opts(tmp_path, trace=str(path), trace_steps=2, prefetch=2, sync_reduce=True)
    with Trainer(JOB, opts) as t:
        assert t.parts.fsdp.state.overlap.prefetch == 2
        assert not t.parts.fsdp.state.overlap.async_reduce
        for _ in range(JOB.steps):
            t.step()
    events = json.loads(path.read_text())["traceEvents"]
    steps = [e["name"] for e in events if e.get("cat") == "host: steps"]
    assert steps == ["step 1", "step 2"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"host: steps", "compute: units", "jax: unit programs (dispatch)"} <= tracks
    assert any(t.startswith("comm: all-gather") for t in tracks), tracks
    names = {e["name"] for e in events if e.get("cat") == "compute: units"}
    assert {"forward h_0", "backward h_0", "forward <root>"} <= names, names
    assert any(e["ph"] == "C" and e["name"] == "bucket bytes" for e in events)
    assert RunOptions(trace="a/t.json").trace_path(1, 2) == "a/t.rank1.json"
    assert RunOptions(trace="a/t.json").trace_path(0, 1) == "a/t.json"
    with pytest.raises(ValueError, match=r"prefetch=-1: expected an integer >= 0"):
        RunOptions(prefetch=-1)
