"""Training checkpoints (``apps.training.checkpoint``) on a tiny GPT in this process (one rank).

- save -> load restores main weights, optimizer state and step counts bit for bit and re-derives
  the MXFP8 planes; saved pieces cut at other offsets (another world size) are read by overlap;
  a format 2 checkpoint as the code before ``torch_side.fsdp.sharded_state`` wrote it loads, and
  this code writes the same keys and fields;
- refused, naming the file, with nothing restored: a flipped bit, a truncated file, a file of
  another run, an index key or dtype the trainer never writes, other data (content digest), a
  format 1 (pickle) checkpoint -- whose planted code never runs;
- the writer lock: a second run saving into the same directory is refused before training, a
  stale lock is reported as such, the lock is released when a run raises;
- a save holding a non-finite value is refused and ``latest`` keeps naming the last good one.
The 2-rank save/resume and the resume at another world size run in test_training.py (slow).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path, PosixPath

import pytest
import torch

from apps.training import checkpoint as ckpt
from apps.training.checkpoint import CheckpointError, CheckpointSaver
from apps.training.data import DataPosition
from apps.training.job import TrainJob
from apps.training.loop import RunOptions, Trainer, _Model, train_rank
from apps.training.writer_lock import LOCK
from torch_side import ShardingStrategy
from torch_side.checkpoint.sharded_files import (
    ShardedReader,
    UnverifiedMetadataWarning,
    meta_digest,
    write_step,
)

pytestmark = pytest.mark.usefixtures("single_rank_world")

JOB = TrainJob(steps=2, micro_batches=1, batch_size=2, seq_len=32, seed=5)
DESC = JOB.describe()
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def models(single_rank_world):
    """(trained, fresh): a model after one AdamW step on seeded gradients, and one to load into."""
    trained, fresh = _Model(JOB), _Model(JOB)
    g = torch.Generator().manual_seed(1)
    for group in trained.opt.groups:
        for p in group.main_pieces():  # padding keeps a zero gradient, as in training
            group.main_grad[p.shard_offset:p.shard_offset + p.numel] = torch.randn(
                p.numel, generator=g)
    trained.opt.step()
    trained.opt.zero_grad()
    return trained, fresh


def _digest(m) -> str:
    return m.corpus.content_digest()


def _save(m, save_dir: Path, step: int = 1) -> Path:
    with CheckpointSaver.start(save_dir) as saver:
        return saver.save(step=step, fsdp=m.fsdp, opt=m.opt, position=DataPosition(4 * step),
                          job=DESC, data_digest=_digest(m))


def _load(path, m, job=DESC, digest=None, timeout=None):
    return ckpt.load(path, fsdp=m.fsdp, opt=m.opt, job=job,
                     data_digest=_digest(m) if digest is None else digest, timeout=timeout)


def _snapshot(m) -> dict[str, torch.Tensor]:
    """What a checkpoint restores (parameter elements only: padding is not state) and the planes."""
    out = {}
    for g in m.fsdp.param_groups:
        state = m.opt.optimizer.state.get(g.main, {})
        for p in g.main_pieces():
            sl = slice(p.shard_offset, p.shard_offset + p.numel)
            out[f"{g.label}/{p.slot_index}/main"] = g.main[sl].clone()
            for k, v in state.items():
                out[f"{g.label}/{p.slot_index}/{k}"] = (v[sl] if v.dim() else v).clone()
        for plane, buf in g.model.items():
            out[f"{g.label}/plane/{plane}"] = buf.clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _forge_meta(path: Path, edit) -> None:
    """``edit(meta)`` of a step's meta.json, its own digest recomputed (a forger who knows the
    format, or a checkpoint as an earlier version wrote it)."""
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    meta["meta_sha256"] = meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def _scramble(m) -> None:
    with torch.no_grad():
        for g in m.fsdp.param_groups:
            for p in g.main_pieces():  # padding stays zero, as in any run
                g.main[p.shard_offset:p.shard_offset + p.numel] = 0.25
        m.fsdp.refresh_model_weights()


def test_save_then_load_is_bit_exact_and_rederives_the_mxfp8_planes(models, tmp_path):
    trained, fresh = models
    path = _save(trained, tmp_path)
    assert (tmp_path / "latest").read_text() == "step_000001\n"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "rank_00000.bin",
                                                      "rank_00000.json"]
    assert not (tmp_path / LOCK).exists()  # released when the saver closed
    _scramble(fresh)
    resumed = _load(tmp_path, fresh)
    assert resumed.step == 1 and resumed.position == DataPosition(4)
    assert resumed.meta["data_digest"] == _digest(trained)
    assert _same(_snapshot(fresh), _snapshot(trained))


def test_saved_pieces_cut_at_other_offsets_are_read_by_overlap(models, tmp_path):
    """What a rank of another world size sees: the saved pieces split where it owns nothing."""
    trained, fresh = models
    path = _save(trained, tmp_path / "whole")
    split = {}
    with ShardedReader(path, ckpt.SCHEMA) as r:
        meta = r.meta
        for key, e in r.entries.items():
            value = r.read(key)
            if key.startswith(("main/", "optim/")) and e.numel > 3:
                head, offset = key.rsplit("/", 1)
                cut = e.numel // 3
                split[key] = value[:cut]
                split[f"{head}/{int(offset) + cut}"] = value[cut:]
            else:
                split[key] = value
    fields = {k: meta[k] for k in ("data_position", "data_digest", "job", "params", "optimizer")}
    write_step(tmp_path / "cut", split, run_id="other-layout", step=1, schema=ckpt.SCHEMA,
               fields=fields)
    _scramble(fresh)
    _load(tmp_path / "cut", fresh)
    assert _same(_snapshot(fresh), _snapshot(trained))


def _write_format_2_by_hand(m, path: Path) -> None:
    """A step directory as the trainer before ``torch_side.fsdp.sharded_state`` wrote it (format 2),
    its keys spelled out here as that code formatted them."""
    sd, opt = {}, m.opt.optimizer
    pieces = [(g, g.layout.slots[p.slot_index].name, p) for g in m.fsdp.param_groups
              for p in g.main_pieces()]
    for g, name, p in pieces:
        sd[f"main/{name}/{p.param_offset}"] = g.main[p.shard_offset:p.shard_offset + p.numel]
    for g, name, p in pieces:
        for k, v in opt.state.get(g.main, {}).items():
            if v.dim():
                sd[f"optim/{k}/{name}/{p.param_offset}"] = v[p.shard_offset:
                                                             p.shard_offset + p.numel]
    for g in m.opt.groups:
        for k, v in opt.state[g.main].items():
            if not v.dim():
                sd[f"optim_scalar/{k}/{g.label}"] = v.float()
    sd["rng/0/torch"] = torch.get_rng_state()
    params = {s.name: list(s.shape) for g in m.fsdp.param_groups for s in g.layout.slots}
    write_step(path, sd, run_id="format-2", step=1, schema=ckpt.SCHEMA, fields={
        "data_position": {"samples_consumed": 4}, "data_digest": _digest(m), "job": DESC,
        "params": params, "optimizer": "AdamW"})
    _downgrade_to_format_2(path)


def _downgrade_to_format_2(path: Path) -> None:
    """Format 2's files: version 2 in meta.json and the indexes, no meta_sha256."""
    meta = json.loads((path / "meta.json").read_text())
    for name in meta["files"]:
        if name.endswith(".json"):
            index = json.loads((path / name).read_text())
            index["format_version"] = 2
            data = json.dumps(index).encode()
            (path / name).write_bytes(data)
            meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(),
                                   "size": len(data)}
    meta["format_version"] = 2
    del meta["meta_sha256"]
    (path / "meta.json").write_text(json.dumps(meta))


def test_a_format_2_checkpoint_of_the_earlier_code_loads_bit_exact(models, tmp_path):
    trained, fresh = models
    _write_format_2_by_hand(trained, tmp_path / "step_000001")
    _scramble(fresh)
    with pytest.warns(UnverifiedMetadataWarning, match="format 2, which carries no digest"):
        resumed = _load(tmp_path / "step_000001", fresh)
    assert resumed.step == 1 and resumed.position == DataPosition(4)
    assert _same(_snapshot(fresh), _snapshot(trained))
    # and what this code writes is the same format plus meta.json's own digest (format 3)
    ours = _save(trained, tmp_path / "ours")
    with pytest.warns(UnverifiedMetadataWarning), ShardedReader(
            ours, ckpt.SCHEMA) as a, ShardedReader(tmp_path / "step_000001", ckpt.SCHEMA) as b:
        assert [(e.key, e.dtype, e.shape) for e in a.entries.values()] == [
            (e.key, e.dtype, e.shape) for e in b.entries.values()]
        assert (a.meta["format_version"], b.meta["format_version"]) == (3, 2)
        skip = ("run_id", "files", "format_version", "meta_sha256")
        assert {k: v for k, v in a.meta.items() if k not in skip} == {
            k: v for k, v in b.meta.items() if k not in skip}


def _refused(path, m, match: str, **kw) -> None:
    before = _snapshot(m)
    with pytest.raises(CheckpointError, match=match):
        _load(path, m, **kw)
    assert _same(_snapshot(m), before)  # nothing restored from a refused checkpoint


def test_a_flipped_bit_is_refused_naming_the_file(models, tmp_path):
    trained, fresh = models
    path = _save(trained, tmp_path)
    f = path / "rank_00000.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    _refused(tmp_path, fresh, r"step_000001/rank_00000\.bin is corrupt: sha256 ")


def test_a_truncated_file_is_refused_naming_the_file(models, tmp_path):
    trained, fresh = models
    path = _save(trained, tmp_path)
    f = path / "rank_00000.bin"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    _refused(path, fresh, r"rank_00000\.bin is truncated or extended")


def test_a_file_of_another_run_at_the_same_step_is_refused(models, tmp_path):
    trained, fresh = models
    ours, theirs = _save(trained, tmp_path / "ours"), _save(trained, tmp_path / "theirs")
    # the same weights, but the other run's id: a mixed directory is still told apart
    (ours / "rank_00000.json").write_bytes((theirs / "rank_00000.json").read_bytes())
    _refused(ours, fresh, r"ours/step_000001/rank_00000\.json is corrupt")


@pytest.mark.parametrize("key,dtype", [("pickle/0", "uint8"), (None, "bfloat16")])
def test_an_index_with_a_key_or_dtype_the_trainer_never_writes_is_refused(models, tmp_path,
                                                                          key, dtype):
    trained, fresh = models
    path = _save(trained, tmp_path)
    index_path = path / "rank_00000.json"
    index = json.loads(index_path.read_text())
    entry = next(e for e in index["entries"] if e["key"].startswith("main/"))
    entry["key"], entry["dtype"] = key or entry["key"], dtype
    entry["nbytes"] //= 1 if dtype == "uint8" else 2
    index_path.write_text(json.dumps(index))
    data = index_path.read_bytes()  # a forger who also edits meta.json, digests included
    _forge_meta(path, lambda meta: meta["files"].__setitem__(
        "rank_00000.json", {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}))
    match = "unknown key 'pickle/0'" if key else "has dtype 'bfloat16', expected 'float32'"
    _refused(path, fresh, r"rank_00000\.json: .*" + match)


def test_other_data_is_refused_naming_both_digests(models, tmp_path):
    trained, fresh = models
    _save(trained, tmp_path)
    _refused(tmp_path, fresh, r"digest 'sha256:[0-9a-f]{64}' \(--data 'markov'\), but this "
                              r"run's --data 'markov' has digest 'sha256:other'",
             digest="sha256:other")


def test_another_blocks_per_unit_is_refused_and_older_checkpoints_mean_one(models, tmp_path):
    """The optimizer state is kept per unit group, so a resume needs the same units; a
    checkpoint saved before --blocks-per-unit existed ran with one block per unit."""
    trained, fresh = models
    path = _save(trained, tmp_path)
    _refused(path, fresh, "saved with blocks_per_unit=1 but this run has blocks_per_unit=2; "
                          "resume with the same blocks_per_unit",
             job={**DESC, "blocks_per_unit": 2})
    _forge_meta(path, lambda meta: meta["job"].pop("blocks_per_unit"))
    _scramble(fresh)
    _load(path, fresh)
    assert _same(_snapshot(fresh), _snapshot(trained))


class _Call:
    """Pickles as ``fn(*args)``: a chain a permissive unpickler runs while loading."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)

    def __call__(self, *args):  # pickle wants a callable here; never called in this process
        raise AssertionError("not to be called")


def _planted_pickle(marker: Path) -> bytes:
    """getattr + pathlib.PosixPath reach os.system (both were on the old allowlist)."""
    exists = _Call(getattr, PosixPath, "exists")
    get = _Call(getattr, _Call(getattr, exists, "__globals__"), "get")
    system = _Call(getattr, _Call(get, "os"), "system")
    return pickle.dumps(_Call(system, f"touch {marker}"), protocol=4)


@pytest.mark.parametrize("with_meta", [True, False])
def test_a_format_1_checkpoint_is_refused_without_unpickling(models, tmp_path, with_meta):
    _, fresh = models
    old = tmp_path / "step_000001"
    old.mkdir()
    marker = tmp_path / "code-ran"
    (old / ".metadata").write_bytes(_planted_pickle(marker))
    (old / "__0_0.distcp").write_bytes(b"\0" * 64)
    if with_meta:  # a format 1 meta.json that matches this run, as the old loader wanted
        params = {s.name: list(s.shape) for g in fresh.fsdp.param_groups for s in g.layout.slots}
        (old / "meta.json").write_text(json.dumps({
            "format_version": 1, "step": 1, "data_position": {"samples_consumed": 4},
            "world_size": 1, "job": DESC, "params": params, "optimizer": "AdamW"}))
    _refused(tmp_path / "step_000001", fresh,
             r"written by an earlier version of mxfp8-train \(format 1, .*\.metadata file is a "
             r"pickle; pickles from checkpoints are no longer loaded, for safety.*Retrain")
    assert not marker.exists()


def test_no_checkpoint_module_can_unpickle():
    for rel in ("apps/training/checkpoint.py", "apps/training/writer_lock.py",
                "torch_side/checkpoint/sharded_files.py"):
        text = (ROOT / rel).read_text()
        for banned in ("import pickle", "torch.load(", "checkpoint as dcp", "FileSystemReader",
                       "Unpickler"):
            assert banned not in text, (rel, banned)


def test_latest_naming_a_path_outside_the_save_dir_is_refused(tmp_path):
    (tmp_path / "latest").write_text("../../elsewhere\n")
    with pytest.raises(CheckpointError, match=r"not a step_<k> directory name"):
        ckpt.resolve(tmp_path)


def test_a_second_writer_is_refused_naming_the_lock_and_its_holder(tmp_path):
    with CheckpointSaver.start(tmp_path) as first:
        with pytest.raises(CheckpointError) as info:
            CheckpointSaver.start(tmp_path)
        msg = str(info.value)
        assert str(tmp_path / LOCK) in msg and f"run {first.run_id}" in msg
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg
        assert "use another --save-dir" in msg
        assert json.loads((tmp_path / LOCK).read_text())["run_id"] == first.run_id
    assert not (tmp_path / LOCK).exists()
    with CheckpointSaver.start(tmp_path):  # the next run may take it
        pass


def test_a_lock_left_by_a_run_that_is_gone_is_taken_over(tmp_path):
    """A run killed outright (SIGKILL) leaves writer.lock; the next run on this host takes it
    (the holder's pid is not running and nothing holds its flock): resume needs no hand edit."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs (reuse within this test is not expected)
    (tmp_path / LOCK).write_text(json.dumps({"run_id": "gone", "host": socket.gethostname(),
                                              "pid": dead.pid, "started": "earlier"}))
    with CheckpointSaver.start(tmp_path) as saver:
        assert json.loads((tmp_path / LOCK).read_text())["run_id"] == saver.run_id
    assert not (tmp_path / LOCK).exists()


def test_a_run_refused_at_start_or_failing_later_leaves_the_lock_as_it_found_it(tmp_path):
    with CheckpointSaver.start(tmp_path):
        with pytest.raises(CheckpointError, match="locked by another run"):
            train_rank(JOB, RunOptions(save_dir=str(tmp_path), progress=False))
        assert (tmp_path / LOCK).exists()
    opts = RunOptions(save_dir=str(tmp_path), resume=str(tmp_path / "nowhere"), progress=False)
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        train_rank(JOB, opts)
    assert not (tmp_path / LOCK).exists()


def test_a_non_finite_save_is_refused_and_latest_is_unchanged(models, tmp_path):
    trained, _ = models
    _save(trained, tmp_path, step=1)
    g = trained.fsdp.param_groups[0]
    piece = g.main_pieces()[0]
    name = g.layout.slots[piece.slot_index].name
    keep = g.main[piece.shard_offset + 1].item()
    g.main[piece.shard_offset + 1] = float("nan")
    try:
        with pytest.raises(CheckpointError, match=rf"refusing to save step 2: main/{name}/"
                                                  rf"{piece.param_offset} holds a non-finite"):
            _save(trained, tmp_path, step=2)
    finally:
        g.main[piece.shard_offset + 1] = keep
    assert (tmp_path / "latest").read_text() == "step_000001\n"
    assert not (tmp_path / "step_000002").exists()


def test_resume_and_save_into_the_same_directory_by_a_later_run(models, tmp_path):
    trained, fresh = models
    _save(trained, tmp_path, step=1)
    with CheckpointSaver.start(tmp_path) as saver:
        _load(tmp_path, fresh)
        saver.save(step=2, fsdp=fresh.fsdp, opt=fresh.opt, position=DataPosition(8), job=DESC,
                   data_digest=_digest(fresh))
    assert (tmp_path / "latest").read_text() == "step_000002\n"
    assert _load(tmp_path, fresh).step == 2
    assert dataclasses.asdict(_load(tmp_path / "step_000001", fresh).position) == {
        "samples_consumed": 4}


# ---- issue 30, item 1: units of several blocks (the recommended GPU setting) save and resume --

SMALL_JOB = TrainJob(config="small", steps=2, micro_batches=1, batch_size=2, seq_len=32,
                     eval_batches=1, seed=4)


@pytest.mark.parametrize("blocks", [2, 3, 4])
@pytest.mark.parametrize("strategy", list(ShardingStrategy))
def test_units_of_several_blocks_save_and_resume_bit_for_bit(tmp_path, blocks, strategy):
    """The small GPT (4 blocks) with 2, 3 (a unit of 3 and one of 1) and 4 blocks per FSDP unit
    under every strategy: a checkpoint saved after step 1 resumes to step 2's exact loss,
    gradient norm, weights, optimizer state and MXFP8 planes (the unit names hold "+")."""
    job = dataclasses.replace(SMALL_JOB, blocks_per_unit=blocks, strategy=strategy)
    opts = RunOptions(progress=False, precompile=False)
    save = tmp_path / "ck"
    with Trainer(job, dataclasses.replace(opts, save_dir=str(save))) as t:
        assert any("+" in u.name for u in t.parts.fsdp.units)
        t.step()
        t.save()
        second = t.step()
        want = _snapshot(t.parts)
    with Trainer(job, dataclasses.replace(opts, resume=str(save))) as r:
        assert r.start_step == 1
        again = r.step()
        assert (again.loss, again.grad_norm) == (second.loss, second.grad_norm)
        assert _same(_snapshot(r.parts), want)


# ---- issue 30: what a resume depends on is verified; writes never follow planted links -------


def test_an_edited_data_position_is_refused(models, tmp_path):
    trained, fresh = models
    path = _save(trained, tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["data_position"]["samples_consumed"] += 1  # 4 -> 5: a shifted data stream
    (path / "meta.json").write_text(json.dumps(meta))
    _refused(path, fresh, r"meta.json: its content does not match its meta_sha256")


def test_an_rng_state_of_the_wrong_size_is_refused_before_anything_is_restored(models, tmp_path):
    trained, fresh = models
    path = _save(trained, tmp_path)
    index = json.loads((path / "rank_00000.json").read_text())
    rng = next(e for e in index["entries"] if e["key"] == "rng/0/torch")
    rng["shape"], rng["nbytes"] = [rng["shape"][0] - 16], rng["nbytes"] - 16
    data = json.dumps(index).encode()
    (path / "rank_00000.json").write_bytes(data)
    _forge_meta(path, lambda meta: meta["files"].__setitem__(
        "rank_00000.json", {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}))
    _refused(path, fresh, r"the torch RNG state of rank 0 has \d+ bytes, this generator's has")


def test_a_load_that_does_not_finish_in_time_is_refused(models, tmp_path, monkeypatch):
    import time

    trained, fresh = models
    path = _save(trained, tmp_path)
    real = ckpt.read_parts
    monkeypatch.setattr(ckpt, "read_parts", lambda *a: (time.sleep(1.5), real(*a))[1])
    _refused(path, fresh, r"reading the checkpoint .* did not finish within 0.5 s", timeout=0.5)


def test_a_planted_latest_tmp_symlink_is_not_followed(models, tmp_path):
    trained, _ = models
    victim = tmp_path / "victim.txt"
    victim.write_text("a user's file")
    save_dir = tmp_path / "ck"
    save_dir.mkdir()
    (save_dir / "latest.tmp").symlink_to(victim)
    _save(trained, save_dir)
    assert victim.read_text() == "a user's file"
    assert (save_dir / "latest").read_text() == "step_000001\n"
    assert not (save_dir / "latest").is_symlink()


def test_resaving_an_existing_step_keeps_the_complete_copy_until_the_new_one_is_in(models,
                                                                                   tmp_path):
    """``--resume ow/step_000002 --save-dir ow`` where ``latest`` names step 4: the second run's
    step 4 replaces the first run's only once complete; a kill between the two renames of the
    swap leaves copies that ``resolve`` finds and the next writer puts back in place."""
    trained, fresh = models
    first = _save(trained, tmp_path, step=4)
    run_of = json.loads((first / "meta.json").read_text())["run_id"]
    # a kill between the renames: the old copy set aside, the new one complete but unpublished
    aside = tmp_path / ".step_000004.0a1b.replaced"
    first.rename(aside)
    assert ckpt.resolve(tmp_path) == aside  # latest still names step 4: its copy is found
    with CheckpointSaver.start(tmp_path):  # the next writer finishes it
        pass
    assert json.loads((first / "meta.json").read_text())["run_id"] == run_of
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004"]
    _scramble(fresh)
    assert _load(tmp_path, fresh).step == 4
    assert _same(_snapshot(fresh), _snapshot(trained))
