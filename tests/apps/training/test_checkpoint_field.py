"""docs/extending.md, "A checkpoint field", performed from the tests alone on a tiny GPT in this
process (one rank):

1. a training-only field is a ``torch_side.fsdp.sharded_state.Stateful`` part (``HitCounter``: a
   tensor entry under a key of its own, with its schema, and a ``meta.json`` field) and one line
   in ``apps.training.checkpoint._parts`` (here the same line added by ``monkeypatch``): it is
   saved and resumed with the model, and a checkpoint holding its key is refused by a reader
   without the part (no part declares the key);
2. a bump of ``torch_side.checkpoint.sharded_files.FORMAT_VERSION`` with the old version taken out
of
   ``READABLE_VERSIONS``: the new version saves and loads, the old one is refused by name.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from apps.training import checkpoint as ckpt
from apps.training.checkpoint import CheckpointError, CheckpointSaver
from apps.training.data import DataPosition
from apps.training.job import TrainJob
from apps.training.loop import _Model
from torch_side.checkpoint import sharded_files
from torch_side.fsdp.sharded_state import key_text, parse_key

pytestmark = pytest.mark.usefixtures("single_rank_world")

JOB = TrainJob(steps=1, micro_batches=1, batch_size=2, seq_len=32, seed=5)
DESC = JOB.describe()


class HitsKey(NamedTuple):
    PREFIX = "hits"
    rank: int


class HitCounter:
    """The new part: each rank's hit counts (an int64 tensor) and their total (a field)."""

    schema = {r"hits/\d+": torch.int64}
    FIELD = "hits_total"

    def __init__(self, hits: torch.Tensor):
        self.hits = hits

    def state_entries(self) -> dict[str, torch.Tensor]:
        return {key_text(HitsKey(dist.get_rank())): self.hits}

    def state_fields(self) -> dict:
        return {self.FIELD: int(self.hits.sum())}

    def read_state(self, reader):
        mine = [t for t in reader.entries if parse_key(t, [HitsKey]) == HitsKey(dist.get_rank())]
        hits = reader.read(mine[0])
        if int(hits.sum()) != reader.meta[self.FIELD]:
            raise CheckpointError(f"{reader.path}: {self.FIELD} does not match the hits")

        def restore() -> None:
            self.hits = hits

        return restore


@pytest.fixture(scope="module")
def model(single_rank_world):
    return _Model(JOB)


def _add_part(monkeypatch, part: HitCounter) -> None:
    """The walkthrough's "one line in its ``_parts`` list"."""
    parts = ckpt._parts
    monkeypatch.setattr(ckpt, "_parts", lambda *a, **kw: [*parts(*a, **kw), part])


def _save(m, save_dir, step: int = 1):
    with CheckpointSaver.start(save_dir) as saver:
        return saver.save(step=step, fsdp=m.fsdp, opt=m.opt, position=DataPosition(step),
                          job=DESC, data_digest=m.corpus.content_digest())


def _load(path, m):
    return ckpt.load(path, fsdp=m.fsdp, opt=m.opt, job=DESC,
                     data_digest=m.corpus.content_digest())


def test_a_new_part_saves_and_resumes_with_the_model(model, tmp_path, monkeypatch):
    saved = HitCounter(torch.tensor([3, 1, 4], dtype=torch.int64))
    _add_part(monkeypatch, saved)
    path = _save(model, tmp_path)
    assert sharded_files.read_json(path / "meta.json", "meta")[HitCounter.FIELD] == 8
    monkeypatch.undo()
    resumed = HitCounter(torch.zeros(3, dtype=torch.int64))
    _add_part(monkeypatch, resumed)
    _load(tmp_path, model)
    assert torch.equal(resumed.hits, saved.hits)


def test_a_key_that_no_part_declares_is_refused(model, tmp_path, monkeypatch):
    _add_part(monkeypatch, HitCounter(torch.ones(2, dtype=torch.int64)))
    _save(model, tmp_path)
    monkeypatch.undo()  # a reader without the part
    with pytest.raises(CheckpointError, match=r"unknown key 'hits/0'"):
        _load(tmp_path, model)


def test_a_format_bump_reads_the_new_version_and_refuses_the_old(model, tmp_path, monkeypatch):
    old = _save(model, tmp_path / "old")
    new_version = sharded_files.FORMAT_VERSION + 1
    monkeypatch.setattr(sharded_files, "FORMAT_VERSION", new_version)
    monkeypatch.setattr(sharded_files, "READABLE_VERSIONS", (new_version,))
    new = _save(model, tmp_path / "new")
    assert sharded_files.read_json(new / "meta.json", "meta")["format_version"] == new_version
    _load(new, model)
    with pytest.raises(CheckpointError, match=rf"format_version {new_version - 1}, this code "
                                              rf"reads \[{new_version}\]"):
        _load(old, model)
