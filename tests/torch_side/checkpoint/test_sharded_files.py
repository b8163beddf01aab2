"""``torch_side.checkpoint.sharded_files``: pickle-free step directories, verified on every read.

In one process (a one-rank gloo group): a round trip is bit exact in dtype and shape; partial reads
return the asked elements; every file is listed in meta.json with its sha256 and size; a flipped
bit, a truncated file, a file of another run, an index declaring an unknown key or dtype, and a
file name outside the format are refused naming the file; a non-finite tensor is never written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from torch_side.checkpoint import sharded_files as sf
from torch_side.checkpoint.sharded_files import CheckpointError, ShardedReader, write_step

pytestmark = pytest.mark.usefixtures("single_rank_world")

SCHEMA = {
    r"w/\w+": torch.float32,
    r"h/\w+": torch.bfloat16,
    r"b/\w+": torch.uint8,
    r"i/\w+": torch.int64,
}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w/matrix": torch.randn(5, 3, generator=g),
        "w/scalar": torch.tensor(7.0),
        "w/empty": torch.empty(0),
        "w/special": torch.tensor([-0.0, 1e-45, 3.4e38, -1.5]),
        "h/half": torch.randn(7, generator=g).bfloat16(),
        "b/bytes": torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8),
        "i/ints": torch.tensor([[-(2**62), 1], [2, 3]]),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _write(path: Path, run_id: str = "run-a", tensors=None, step: int = 3) -> dict:
    return write_step(path, _tensors() if tensors is None else tensors, run_id=run_id, step=step,
                      schema=SCHEMA, fields={"note": "test"})


def _forge_meta(path: Path, edit) -> None:
    """What a forger who edits meta.json and knows the format does: ``edit(meta)``, then record
    the new content's own digest."""
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    meta[sf.META_DIGEST] = sf.meta_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def _rewrite_meta_digest(path: Path, name: str) -> None:
    """What a forger who also edits meta.json does: record the file's current digest."""
    data = (path / name).read_bytes()
    _forge_meta(path, lambda meta: meta["files"].__setitem__(
        name, {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}))


def test_round_trip_is_bit_exact_in_dtype_and_shape(tmp_path):
    _write(tmp_path)
    with ShardedReader(tmp_path, SCHEMA) as r:
        assert r.meta["run_id"] == "run-a" and r.meta["step"] == 3 and r.meta["note"] == "test"
        assert set(r.entries) == set(_tensors())
        for key, want in _tensors().items():
            got = r.read(key)
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(_bits(got), _bits(want)), key


def test_partial_reads_return_the_asked_elements(tmp_path):
    _write(tmp_path)
    flat = _tensors()["w/matrix"].reshape(-1)
    with ShardedReader(tmp_path, SCHEMA) as r:
        assert torch.equal(r.read("w/matrix", 4, 6), flat[4:10])
        assert torch.equal(r.read("w/matrix", 14, 1), flat[14:])
        assert r.read("w/matrix", 15, 0).numel() == 0
        with pytest.raises(CheckpointError, match=r"elements \[10, 16\) are outside its 15"):
            r.read("w/matrix", 10, 6)
        with pytest.raises(CheckpointError, match="no entry 'w/absent'"):
            r.read("w/absent")


class _CountingFile:
    """A file handle that counts the bytes ``readinto`` delivers (the ranged reads)."""

    def __init__(self, f):
        self.f, self.bytes = f, 0

    def readinto(self, buf):
        n = self.f.readinto(buf)
        self.bytes += n
        return n

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_partial_read_reads_only_its_byte_range(tmp_path):
    _write(tmp_path)
    with ShardedReader(tmp_path, SCHEMA) as r:
        r.read("w/scalar")  # the data file is verified (read whole) once, here
        counting = r._open["rank_00000.bin"] = _CountingFile(r._open["rank_00000.bin"])
        r.read("w/matrix", 4, 6)
        assert counting.bytes == 6 * 4


def test_meta_json_lists_every_file_with_its_sha256_and_size(tmp_path):
    meta = _write(tmp_path)
    assert set(meta["files"]) == {"rank_00000.bin", "rank_00000.json"}
    for name, rec in meta["files"].items():
        data = (tmp_path / name).read_bytes()
        assert rec == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    index = json.loads((tmp_path / "rank_00000.json").read_text())
    assert index["run_id"] == "run-a" and index["step"] == 3 and index["rank"] == 0
    assert all(e["offset"] % sf.ALIGN == 0 for e in index["entries"])
    assert json.loads((tmp_path / "meta.json").read_text()) == meta
    assert not list(tmp_path.glob(".*tmp"))  # temporaries renamed into place


def test_a_flipped_bit_in_a_data_file_is_refused_naming_the_file(tmp_path):
    _write(tmp_path)
    data = bytearray((tmp_path / "rank_00000.bin").read_bytes())
    data[5] ^= 0x01
    (tmp_path / "rank_00000.bin").write_bytes(bytes(data))
    with ShardedReader(tmp_path, SCHEMA) as r, pytest.raises(
            CheckpointError, match=r"rank_00000\.bin is corrupt: sha256"):
        r.read("w/matrix")


def test_a_truncated_file_is_refused_naming_the_file(tmp_path):
    _write(tmp_path)
    f = tmp_path / "rank_00000.bin"
    f.write_bytes(f.read_bytes()[:-9])
    with ShardedReader(tmp_path, SCHEMA) as r, pytest.raises(
            CheckpointError, match=r"rank_00000\.bin is truncated or extended: \d+ bytes"):
        r.read("i/ints")
    (tmp_path / "rank_00000.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"rank_00000\.json is truncated or extended"):
        ShardedReader(tmp_path, SCHEMA)


def test_files_of_another_run_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, run_id="run-a")
    _write(b, run_id="run-b", tensors=_tensors(seed=1))
    shutil.copy(b / "rank_00000.bin", a / "rank_00000.bin")  # same step, same size
    with ShardedReader(a, SCHEMA) as r, pytest.raises(CheckpointError, match="corrupt"):
        r.read("w/scalar")
    # even when meta.json records the swapped index's digest, its run id gives it away
    shutil.copy(b / "rank_00000.json", a / "rank_00000.json")
    _rewrite_meta_digest(a, "rank_00000.json")
    with pytest.raises(CheckpointError, match=r"rank_00000\.json: run_id is 'run-b' but meta"
                                              r"\.json says 'run-a'; the directory mixes"):
        ShardedReader(a, SCHEMA)


@pytest.mark.parametrize("field,value,message", [
    ("key", "evil/payload", "unknown key 'evil/payload'; this program never writes"),
    ("dtype", "object", "'w/matrix' has dtype 'object', expected 'float32'"),
    ("dtype", "uint8", "'w/matrix' has dtype 'uint8', expected 'float32'"),
    ("nbytes", 1 << 40, "'w/matrix' declares 1099511627776 bytes"),
    ("shape", [5, "3"], "malformed shape"),
])
def test_an_index_declaring_what_the_writer_never_writes_is_refused(tmp_path, field, value,
                                                                     message):
    _write(tmp_path)
    index_path = tmp_path / "rank_00000.json"
    index = json.loads(index_path.read_text())
    entry = next(e for e in index["entries"] if e["key"] == "w/matrix")
    entry[field] = value
    index_path.write_text(json.dumps(index))
    _rewrite_meta_digest(tmp_path, "rank_00000.json")
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("(", r"\(")):
        ShardedReader(tmp_path, SCHEMA)


def test_meta_json_naming_files_outside_the_format_is_refused(tmp_path):
    _write(tmp_path)
    _forge_meta(tmp_path, lambda meta: meta["files"].__setitem__(
        "../../etc/passwd", {"sha256": "0" * 64, "size": 1}))
    with pytest.raises(CheckpointError, match=r"lists files \['../../etc/passwd', "
                                              r"'rank_00000.bin'.*expected exactly the data"):
        ShardedReader(tmp_path, SCHEMA)
    (tmp_path / "meta.json").write_text('{"format_version": NaN}')
    with pytest.raises(CheckpointError, match="NaN is not valid JSON here"):
        ShardedReader(tmp_path, SCHEMA)
    (tmp_path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="meta.json cannot be opened"):
        ShardedReader(tmp_path, SCHEMA)


def test_a_non_finite_tensor_is_never_written(tmp_path):
    tensors = _tensors()
    tensors["w/special"][2] = float("inf")
    with pytest.raises(CheckpointError, match=r"rank 0: refusing to save step 3: w/special "
                                              r"holds a non-finite value"):
        _write(tmp_path / "step", tensors=tensors)
    assert not (tmp_path / "step").exists()


def test_the_writer_refuses_keys_and_dtypes_its_schema_would_not_read(tmp_path):
    with pytest.raises(CheckpointError, match="cannot save 'w/x' .*torch.float64.* the schema "
                                              "allows torch.float32"):
        _write(tmp_path, tensors={"w/x": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(CheckpointError, match="cannot save 'other' .* allows no such key"):
        _write(tmp_path, tensors={"other": torch.zeros(2)})


def test_a_rewrite_of_a_step_directory_leaves_no_file_of_the_earlier_save(tmp_path):
    _write(tmp_path, run_id="first")
    (tmp_path / "rank_00001.bin").write_bytes(b"left over by a larger world")
    _write(tmp_path, run_id="second", tensors={"w/only": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "meta.json", "rank_00000.bin", "rank_00000.json"]
    with ShardedReader(tmp_path, SCHEMA) as r:
        assert r.meta["run_id"] == "second" and list(r.entries) == ["w/only"]


# ---- issue 30: every byte a resume depends on is verified (item 6) ---------------------------


def test_an_edit_of_meta_json_is_refused_naming_its_digest(tmp_path):
    _write(tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["note"] = "edited"  # e.g. a data position 128 -> 129
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta.json: its content does not match its "
                                              r"meta_sha256 .* edited or damaged"):
        ShardedReader(tmp_path, SCHEMA)
    meta.pop(sf.META_DIGEST)  # removing the digest does not help either
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not match its meta_sha256 .None."):
        ShardedReader(tmp_path, SCHEMA)


def test_a_format_2_directory_is_read_with_a_warning_that_its_meta_is_unverified(tmp_path):
    _write(tmp_path)
    for name in ("rank_00000.json",):
        index = json.loads((tmp_path / name).read_text())
        index["format_version"] = 2
        (tmp_path / name).write_text(json.dumps(index))
    _rewrite_meta_digest(tmp_path, "rank_00000.json")
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["format_version"] = 2
    meta.pop(sf.META_DIGEST)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(sf.UnverifiedMetadataWarning, match="format 2, which carries no digest"):
        with ShardedReader(tmp_path, SCHEMA) as r:
            assert torch.equal(r.read("w/matrix"), _tensors()["w/matrix"])


# ---- inputs that could hang every rank, or run a reader out of memory (items 5 and 11) --------


@pytest.fixture
def no_hang():
    """Turn a hang into a test failure (10 s) instead of a stuck CI job."""
    import signal

    def fail(signum, frame):
        raise AssertionError("the reader blocked")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.usefixtures("no_hang")
def test_an_index_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    import os

    _write(tmp_path)
    (tmp_path / "rank_00000.json").unlink()
    os.mkfifo(tmp_path / "rank_00000.json")
    with pytest.raises(CheckpointError, match=r"rank_00000.json is a FIFO, not a regular file"):
        ShardedReader(tmp_path, SCHEMA)
    (tmp_path / "meta.json").unlink()
    os.mkfifo(tmp_path / "meta.json")
    with pytest.raises(CheckpointError, match=r"meta.json is a FIFO, not a regular file"):
        ShardedReader(tmp_path, SCHEMA)


@pytest.mark.usefixtures("no_hang")
def test_a_data_file_linked_to_dev_zero_is_refused_without_reading_it(tmp_path):
    _write(tmp_path)
    (tmp_path / "rank_00000.bin").unlink()
    (tmp_path / "rank_00000.bin").symlink_to("/dev/zero")
    with ShardedReader(tmp_path, SCHEMA) as r, pytest.raises(
            CheckpointError, match=r"rank_00000.bin is a character device, not a regular file"):
        r.read("w/matrix")


def test_a_data_file_larger_than_declared_is_refused_after_its_declared_size(tmp_path):
    _write(tmp_path)
    size = (tmp_path / "rank_00000.bin").stat().st_size
    with open(tmp_path / "rank_00000.bin", "ab") as f:
        f.truncate(size + (1 << 30))  # a sparse gigabyte more: read, it would take seconds
    with ShardedReader(tmp_path, SCHEMA) as r, pytest.raises(
            CheckpointError, match=rf"is truncated or extended: {size + 1}\+ bytes, meta.json "
                                   rf"records {size}"):
        r.read("w/matrix")


@pytest.mark.parametrize("name", ["meta.json", "rank_00000.json"])
def test_json_nested_too_deeply_is_refused_clearly(tmp_path, name):
    _write(tmp_path)
    (tmp_path / name).write_text("[" * 100_000 + "]" * 100_000)
    if name != "meta.json":
        _rewrite_meta_digest(tmp_path, name)
    with pytest.raises(CheckpointError, match=rf"{name} is nested too deeply"):
        ShardedReader(tmp_path, SCHEMA)


def test_a_forged_huge_world_size_is_refused_at_once(tmp_path):
    import time

    _write(tmp_path)
    _forge_meta(tmp_path, lambda meta: meta.__setitem__("world_size", 10**9))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="expected exactly the data and index file of each "
                                              "of world size 1000000000 ranks"):
        ShardedReader(tmp_path, SCHEMA)
    assert time.perf_counter() - start < 1.0


# ---- a save never removes the last complete copy before the new one is complete (item 4) -----


def test_a_failed_rewrite_leaves_the_complete_copy_and_no_staging(tmp_path, monkeypatch):
    step = tmp_path / "step_000004"
    _write(step, run_id="first")
    before = {p.name: p.read_bytes() for p in step.iterdir()}

    def disk_full(path, tensors, head):
        (path / "rank_00000.bin").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sf, "_write_rank", disk_full)
    with pytest.raises(CheckpointError, match="rank 0: cannot write into .*No space left"):
        _write(step, run_id="second")
    assert {p.name: p.read_bytes() for p in step.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]  # staging removed


def test_a_rewrite_is_published_whole_by_rename(tmp_path, monkeypatch):
    """While the new copy is written, the directory holds the complete old one; the new one
    appears under the step's name only with its meta.json."""
    step = tmp_path / "step_000004"
    _write(step, run_id="first")
    seen = []
    real = sf._write_rank

    def spy(path, tensors, head):
        seen.append((path.name, ShardedReader(step, SCHEMA).meta["run_id"]))
        return real(path, tensors, head)

    monkeypatch.setattr(sf, "_write_rank", spy)
    _write(step, run_id="second")
    assert seen == [(".step_000004.second.partial", "first")]
    assert ShardedReader(step, SCHEMA).meta["run_id"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]


def test_a_directory_holding_other_files_is_never_saved_over(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="holds files that are not a checkpoint's; refusing"):
        _write(target)
    assert (target / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_signal_between_the_two_renames_still_leaves_a_complete_step(tmp_path, monkeypatch):
    """SIGTERM/SIGINT become exceptions that can land anywhere, even between setting the old
    copy aside and renaming the new one into place: the step is then complete (the new copy)."""
    from torch_side.checkpoint import step_dirs

    step = tmp_path / "step_000004"
    _write(step, run_id="first")

    def cut_publish(stage, path):
        path.rename(path.with_name(f".{path.name}.0a1b.replaced"))
        raise KeyboardInterrupt  # Ctrl-C, right there

    monkeypatch.setattr(step_dirs, "publish", cut_publish)
    with pytest.raises(KeyboardInterrupt):
        _write(step, run_id="second")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]
    assert ShardedReader(step, SCHEMA).meta["run_id"] == "second"
