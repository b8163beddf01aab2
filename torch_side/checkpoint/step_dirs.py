"""Step directories of ``torch_side.checkpoint.sharded_files``: their file names, and how a save
puts one in place without ever removing the last complete copy first.

Names: ``meta.json`` (``META``) and, per rank r, ``rank_<r>.bin`` / ``rank_<r>.json``
(``rank_files``). A save of ``<dir>/<name>`` is written into the hidden staging directory
``<dir>/.<name>.<run id>.partial`` (``staging``, made fresh by ``prepare``) and renamed into
place by ``publish``; a complete ``<name>`` it replaces is first renamed to
``<dir>/.<name>.<random>.replaced`` and removed after. A save killed outright (SIGKILL, a lost
node) can leave either hidden directory behind: ``recover``, run by the next writer of ``<dir>``
while it holds the directory's lock, finishes a swap that was cut between its two renames and
removes the rest; ``interrupted_copies`` lets a reader find the complete copy of a step whose
swap was cut, without changing anything. A save that fails or is interrupted by a signal
(SIGTERM, SIGINT: an exception in Python, which can land between the two renames) calls
``abandon``, which leaves the step complete under its name whenever a complete copy exists.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from torch_side.checkpoint.safe_files import publish_dir, stale_temporaries

__all__ = ["META", "abandon", "interrupted_copies", "prepare", "publish", "rank_files",
           "recover", "staging"]

META = "meta.json"
_RANK_FILE = re.compile(r"rank_(\d{5})\.(bin|json)")
_PARTIAL, _REPLACED = ".partial", ".replaced"


def rank_files(rank: int) -> tuple[str, str]:
    """(data file, index file) names of ``rank``."""
    return f"rank_{rank:05d}.bin", f"rank_{rank:05d}.json"


def staging(path: Path, run_id: str) -> Path:
    """Where a save of ``path`` by run ``run_id`` is written before it is complete."""
    return path.with_name(f".{path.name}.{run_id}{_PARTIAL}")


def _only_checkpoint_files(path: Path) -> bool:
    """Whether ``path`` holds nothing but what a save writes (a step directory to replace;
    ``.*.tmp``: temporaries of format 2's writer)."""
    return all(f.name == META or _RANK_FILE.fullmatch(f.name)
               or (f.name.startswith(".") and f.name.endswith(".tmp")) for f in path.iterdir())


def prepare(path: Path, stage: Path) -> str | None:
    """Rank 0, before a save of ``path``: a fresh, empty ``stage`` (what an earlier attempt of
    this run left there is removed). Returns the problem that stops the save, if any."""
    try:
        if path.exists() and not (path.is_dir() and _only_checkpoint_files(path)):
            return (f"{path} exists and holds files that are not a checkpoint's; refusing to "
                    f"save over it (move it away, or save elsewhere)")
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
    except OSError as e:
        return f"cannot create {stage}: {e}"
    return None


def publish(stage: Path, path: Path) -> None:
    """Rank 0, once ``stage`` is complete: rename it to ``path``, a complete copy there set
    aside first and removed after (``safe_files.publish_dir``)."""
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_REPLACED}")
    publish_dir(stage, path, aside, replaceable=_only_checkpoint_files)


def _complete(path: Path) -> bool:
    return (path / META).is_file()


def interrupted_copies(path: Path) -> list[Path]:
    """Complete copies of the step directory ``path`` left by a save cut between its two
    renames (``path`` itself missing): the new copy first, then the one it was replacing."""
    return [p for p in _hidden(path.parent, path.name) if _complete(p)]


def _settle(target: Path, copies: list[Path]) -> list[str]:
    """Finish or clean the hidden ``copies`` of ``target`` (new copies first)."""
    done = []
    for p in copies:
        if not target.exists() and _complete(p):
            p.rename(target)
            done.append(f"finished an interrupted save: {p.name} -> {target.name}")
        else:
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name} (left by an interrupted save)")
    return done


def _hidden(directory: Path, name: str = "*") -> list[Path]:
    found = [p for suffix in (_PARTIAL, _REPLACED) for p in directory.glob(f".{name}.*{suffix}")
             if p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: (not p.name.endswith(_PARTIAL), p.name))


def abandon(stage: Path, path: Path) -> None:
    """Rank 0, after a save of ``path`` failed or was interrupted at any point (a signal may
    land between the two renames of ``publish``): ``path`` is left complete whenever a complete
    copy exists, and the save's hidden directories are removed."""
    if path.exists():
        shutil.rmtree(stage, ignore_errors=True)
    _settle(path, _hidden(path.parent, path.name))


def recover(directory: str | os.PathLike, texts: tuple[str, ...] = ()) -> list[str]:
    """Tidy ``directory`` after saves that were killed (the caller writes there alone, holding
    its lock): a swap cut between its renames is finished (the complete new copy, else the old
    one, takes the step's name); other staging and set-aside copies are removed, and so are the
    temporaries of a ``safe_files.replace_text`` of a file named in ``texts`` (the ``latest``
    pointer) that was killed before its rename. Returns what it did, one line each."""
    directory = Path(directory)
    by_target: dict[str, list[Path]] = {}
    for p in _hidden(directory):
        by_target.setdefault(p.name[1:].rsplit(".", 2)[0], []).append(p)  # .<name>.<id>.<kind>
    done = [line for name, copies in sorted(by_target.items())
            for line in _settle(directory / name, copies)]
    for name in texts:
        for p in stale_temporaries(directory, name):
            p.unlink(missing_ok=True)
            done.append(f"removed {p.name} (left by an interrupted write of {name})")
    return done
