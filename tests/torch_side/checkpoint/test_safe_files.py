"""``torch_side.checkpoint.safe_files``: what a checkpoint reader opens and a writer creates cannot
block,
follow a planted link, run past a declared size, or leave the last complete copy missing."""

from __future__ import annotations

import os
import threading
import time

import pytest

from torch_side.checkpoint.safe_files import (
    CheckpointError,
    bounded,
    open_regular,
    publish_dir,
    read_bounded,
    read_json,
    replace_text,
    write_new,
)


def test_only_regular_files_open(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    with open_regular(tmp_path / "link", "file") as f:  # a link to a regular file is fine
        assert f.read() == b"x"
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to_null").symlink_to("/dev/null")
    for name, kind in (("fifo", "a FIFO"), ("to_null", "a character device"),
                       (".", "a directory")):
        with pytest.raises(CheckpointError, match=f"is {kind}, not a regular file"):
            open_regular(tmp_path / name, "file")


def test_reads_stop_at_the_declared_size(tmp_path):
    (tmp_path / "f").write_bytes(b"0123456789")
    with open_regular(tmp_path / "f", "file") as f:
        assert read_bounded(f, 10, "f") == b"0123456789"
    with open_regular(tmp_path / "f", "file") as f, pytest.raises(
            CheckpointError, match="f holds more than 9 bytes"):
        read_bounded(f, 9, "f")
    (tmp_path / "j").write_text('{"a": 1}')
    assert read_json(tmp_path / "j", "index", 100) == {"a": 1}
    with pytest.raises(CheckpointError, match="holds more than 4 bytes"):
        read_json(tmp_path / "j", "index", 4)
    (tmp_path / "j").write_text('[1]')
    with pytest.raises(CheckpointError, match="is not a JSON object"):
        read_json(tmp_path / "j", "index", 100)


def test_a_new_file_never_follows_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_new(tmp_path / "out", [b"overwritten"])
    assert victim.read_text() == "precious"
    h, size = write_new(tmp_path / "new", [b"ab", b"c"])
    assert (tmp_path / "new").read_bytes() == b"abc" and size == 3
    assert h.hexdigest() == __import__("hashlib").sha256(b"abc").hexdigest()


def test_replace_text_ignores_a_planted_temporary(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "latest.tmp").symlink_to(victim)  # what format 2's writer would have followed
    (tmp_path / ".latest.tmp").symlink_to(victim)
    replace_text(tmp_path / "latest", "step_000002\n")
    assert (tmp_path / "latest").read_text() == "step_000002\n"
    assert not (tmp_path / "latest").is_symlink() and victim.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".latest.tmp", "latest", "latest.tmp", "victim"]


def test_publish_keeps_a_complete_copy_until_the_new_one_is_in_place(tmp_path):
    old, new, aside = tmp_path / "step", tmp_path / ".step.run.partial", tmp_path / ".aside"
    old.mkdir()
    (old / "meta.json").write_text("old")
    new.mkdir()
    (new / "meta.json").write_text("new")
    publish_dir(new, old, aside, replaceable=lambda p: True)
    assert (old / "meta.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]
    new.mkdir()
    with pytest.raises(CheckpointError, match="holds files that are not a checkpoint's"):
        publish_dir(new, old, aside, replaceable=lambda p: False)
    assert (old / "meta.json").read_text() == "new"


def test_bounded_gives_up_on_a_stuck_call_and_passes_results_and_errors():
    assert bounded(lambda: 7, 1.0, "x") == 7
    assert bounded(lambda: 7, None, "x") == 7
    with pytest.raises(KeyError):
        bounded(lambda: {}["missing"], 1.0, "x")
    release = threading.Event()
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="reading the checkpoint did not finish within "
                                              "0.2 s"):
        bounded(release.wait, 0.2, "reading the checkpoint")
    assert time.perf_counter() - start < 2
    release.set()
