"""``torch_side.checkpoint.step_dirs``: a save killed between the two renames of its swap (or while
its staging directory was incomplete) is finished or cleaned by the next writer (``recover``) and
can be found by a reader (``interrupted_copies``)."""

from __future__ import annotations

from pathlib import Path

from torch_side.checkpoint.step_dirs import interrupted_copies, rank_files, recover


def _step(path: Path, content: str, complete: bool = True) -> Path:
    path.mkdir()
    for name in rank_files(0):
        (path / name).write_text(content)
    if complete:
        (path / "meta.json").write_text(content)
    return path


def _contents(d: Path) -> dict[str, str]:
    return {p.name: (p / "meta.json").read_text() if (p / "meta.json").exists() else "incomplete"
            for p in d.iterdir()}


def test_a_swap_cut_between_its_renames_is_finished_with_the_new_copy(tmp_path):
    _step(tmp_path / ".step_000004.newrun.partial", "new")
    _step(tmp_path / ".step_000004.0a1b.replaced", "old")
    assert [p.name for p in interrupted_copies(tmp_path / "step_000004")] == [
        ".step_000004.newrun.partial", ".step_000004.0a1b.replaced"]
    done = recover(tmp_path)
    assert _contents(tmp_path) == {"step_000004": "new"}
    assert done == ["finished an interrupted save: .step_000004.newrun.partial -> step_000004",
                    "removed .step_000004.0a1b.replaced (left by an interrupted save)"]


def test_an_incomplete_new_copy_is_dropped_and_the_old_one_restored(tmp_path):
    _step(tmp_path / ".step_000004.newrun.partial", "new", complete=False)
    _step(tmp_path / ".step_000004.0a1b.replaced", "old")
    assert [p.name for p in interrupted_copies(tmp_path / "step_000004")] == [
        ".step_000004.0a1b.replaced"]
    recover(tmp_path)
    assert _contents(tmp_path) == {"step_000004": "old"}


def test_leftovers_beside_a_complete_step_are_removed_and_other_files_kept(tmp_path):
    _step(tmp_path / "step_000002", "kept")
    _step(tmp_path / ".step_000002.run.partial", "unpublished")
    _step(tmp_path / ".step_000006.run.partial", "cut", complete=False)
    (tmp_path / "writer.lock").write_text("{}")
    (tmp_path / ".hidden_user_dir").mkdir()
    recover(tmp_path)
    assert _contents(tmp_path) == {"step_000002": "kept", "writer.lock": "incomplete",
                                   ".hidden_user_dir": "incomplete"}
    assert recover(tmp_path) == []


def test_a_pointer_write_killed_before_its_rename_leaves_nothing_behind(tmp_path):
    """``replace_text``'s temporary of ``latest`` (a SIGKILL between its write and its rename)
    is removed by the next writer; a hidden file of another shape, or of another name, stays."""
    (tmp_path / "latest").write_text("step_000002\n")
    (tmp_path / ".latest._9dmq8ta.tmp").write_text("step_0000")
    (tmp_path / ".latest.mine.tmp").write_text("a user's")
    (tmp_path / ".other.abcd1234.tmp").write_text("not a pointer's")
    (tmp_path / ".latest.zz99zz99.tmp").mkdir()  # not a regular file
    assert recover(tmp_path) == []  # no pointer named: nothing of that kind removed
    assert recover(tmp_path, texts=("latest",)) == [
        "removed .latest._9dmq8ta.tmp (left by an interrupted write of latest)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".latest.mine.tmp", ".latest.zz99zz99.tmp", ".other.abcd1234.tmp", "latest"]
