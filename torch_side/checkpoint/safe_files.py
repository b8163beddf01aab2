"""File primitives for checkpoints that cannot hang, follow a planted link, or lose a copy.

Checkpoint directories are inputs from outside (DESIGN.md 10): a file there may be a FIFO, a link
to a device, a symlink planted where a temporary file is about to be written, or a JSON document
nested a million levels deep. Everything ``torch_side.checkpoint.sharded_files`` and the training
app read or write in them goes through these functions:

- ``open_regular``: opens only regular files (a FIFO or a device, named directly or through a
  symlink, is refused before any blocking ``open``; the open handle is checked again, so a swap
  in between is caught);
- ``read_bounded`` / ``read_json``: read at most a declared number of bytes, so a file that
  grows (or ``/dev/zero`` behind a link) cannot make a reader run forever; JSON constants
  (NaN, Infinity) and nesting that Python cannot parse are refused with a ``CheckpointError``;
- ``write_new``: creates a file that must not exist (``O_EXCL | O_NOFOLLOW``: a planted symlink
  is never followed), writes and syncs it; ``replace_text`` writes a small file under a fresh
  random name and renames it over the target (``latest``);
- ``publish_dir``: renames a completed staging directory into place, moving a complete copy of
  the same name aside first and removing it only once the new one is in place (a save never
  removes the last complete checkpoint before the new one is complete);
- ``bounded``: runs a read phase with a deadline, so a stuck file system becomes an error on this
  rank before the other ranks give up waiting for it in a collective.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, TypeVar

__all__ = [
    "CheckpointError",
    "bounded",
    "open_regular",
    "publish_dir",
    "read_bounded",
    "read_json",
    "replace_text",
    "stale_temporaries",
    "write_new",
]

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or written: missing, corrupt, mixed, or mismatched."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, what: str) -> io.BufferedReader:
    """``path`` opened for binary reading, only if it is (or links to) a regular file."""
    try:
        before = os.stat(path)  # follows links: what an open would reach
        if not stat.S_ISREG(before.st_mode):
            raise CheckpointError(f"{what} {path} is {_kind(before.st_mode)}, not a regular "
                                  f"file; refused (it could block or never end)")
        # O_NONBLOCK: should the file have become a FIFO since the stat, open does not wait
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{what} {path} cannot be opened: {e}") from e
    after = os.fstat(fd)
    if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (
            before.st_dev, before.st_ino):
        os.close(fd)
        raise CheckpointError(f"{what} {path} changed while it was opened; refused")
    return os.fdopen(fd, "rb")


def read_bounded(f: BinaryIO, limit: int, what: str) -> bytes:
    """All of ``f`` from its position, refusing it as soon as it holds more than ``limit``."""
    data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{what} holds more than {limit} bytes; refused")
    return data


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON here")


def parse_json(data: bytes, where: str) -> Any:
    """JSON from ``data``; invalid, non-standard or too deeply nested input is a
    ``CheckpointError`` naming ``where``."""
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise CheckpointError(f"{where} is nested too deeply to be a checkpoint file; "
                              f"refused") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON: {e}") from e


def read_json(path: Path, what: str, limit: int) -> dict[str, Any]:
    """The JSON object in the regular file ``path`` (at most ``limit`` bytes)."""
    with open_regular(path, what) as f:
        data = read_bounded(f, limit, f"{what} {path}")
    value = parse_json(data, f"{what} {path}")
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} {path} is not a JSON object")
    return value


def write_new(path: Path, chunks: Iterable[Any]) -> tuple[Any, int]:
    """Create ``path`` (it must not exist; a symlink there is never followed), write ``chunks``
    (bytes-like), fsync; returns (sha256 hash object, size)."""
    import hashlib

    h, size = hashlib.sha256(), 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    with os.fdopen(fd, "wb") as f:
        for c in chunks:
            f.write(c)
            h.update(c)
            size += len(memoryview(c))
        f.flush()
        os.fsync(f.fileno())
    return h, size


def _sync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_text(path: Path, text: str) -> None:
    """Atomically set the small file ``path`` to ``text``: written under a fresh random name in
    the same directory (created exclusively: nothing planted there is followed), then renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)


def stale_temporaries(directory: Path, name: str) -> list[Path]:
    """The temporaries of ``replace_text(directory / name, ...)`` that a write killed before its
    rename left behind: regular files named as ``tempfile.mkstemp`` names them for it
    (``.<name>.`` + 8 characters + ``.tmp``; other hidden files are not matched)."""
    pattern = re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}\.tmp")
    return sorted(p for p in Path(directory).iterdir()
                  if pattern.fullmatch(p.name) and p.is_file() and not p.is_symlink())


def publish_dir(staging: Path, target: Path, aside: Path, *,
                replaceable: Callable[[Path], bool]) -> None:
    """Rename the complete directory ``staging`` to ``target``. An existing ``target`` (which
    ``replaceable`` must accept, else ``CheckpointError``) is first renamed to ``aside`` and
    deleted only after ``staging`` took its place: at every moment a complete copy exists under
    a name a reader can find (``target``, or ``aside`` / ``staging`` between the two renames;
    ``sharded_files.recover`` finishes such an interrupted swap)."""
    if target.exists() or target.is_symlink():
        if target.is_symlink() or not target.is_dir() or not replaceable(target):
            raise CheckpointError(
                f"{target} exists and holds files that are not a checkpoint's; refusing to "
                f"replace it (move it away, or save elsewhere)")
        target.rename(aside)
        staging.rename(target)
        _sync_dir(target.parent)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        staging.rename(target)
        _sync_dir(target.parent)


def bounded(fn: Callable[[], T], seconds: float | None, what: str) -> T:
    """``fn()``, or a ``CheckpointError`` once it has run ``seconds`` (None: no limit). The
    call goes on in a daemon thread that the process abandons (a read stuck in the kernel
    cannot be interrupted); its result, if it ever comes, is dropped."""
    if seconds is None:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name=f"bounded: {what}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise CheckpointError(f"{what} did not finish within {seconds:g} s (a stalled file "
                              f"system?); given up so that every rank stops with this error")
    if "error" in box:
        raise box["error"]
    return box["value"]
