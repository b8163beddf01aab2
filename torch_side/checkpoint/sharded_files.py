"""Pickle-free sharded tensor files with checksums and a run identity (DESIGN.md 10).

A **step directory** written by a world of W ranks holds, for every rank r:

- ``rank_<r>.bin``: the raw bytes of rank r's tensors, one after another (each entry starts at a
  multiple of 64 bytes), in the machine's byte order (little-endian, recorded in ``meta.json``);
- ``rank_<r>.json``: its **index**: format version, run id, step, rank, world size, the data
  file's name and size, and one entry per tensor: ``key``, ``dtype`` (from the small allowlist
  ``DTYPES``), ``shape``, byte ``offset`` and ``nbytes``;

and ``meta.json``, written last by rank 0: format version, **run id**, step, world size, byte
order, the sha256 and size of every file of the step (``files``), the caller's own JSON fields,
and ``meta_sha256``, the sha256 of all of that (``meta_digest``): every byte a reader depends on
is covered by a digest it verifies. A directory without ``meta.json`` is incomplete.

**Writing** (``write_step``) never touches a complete copy until the new one is complete: the
ranks write into a hidden **staging** directory beside the target (``.<name>.<run id>.partial``,
files created exclusively, never through a planted link); rank 0 writes ``meta.json`` there last,
then renames it into place (``safe_files.publish_dir``: an existing step directory of the same
name is moved aside to ``.<name>.<random>.replaced`` first and deleted after). A save that fails
or is interrupted (an exception, SIGTERM, SIGINT) removes its staging directory; one killed
outright leaves it, and ``recover`` (run by the next writer of the directory) removes it, or
finishes a swap that was cut between its two renames.

**Run id**: a random id a caller draws once per run (``new_run_id``) and passes to every save;
each index carries it, so files of two runs mixed in one directory are told apart.

Reading (``ShardedReader``) trusts only ``meta.json``, after checking its own digest: every index
file is checked against it (sha256 and size) and must carry its run id, step, world size and its
own rank; every entry's key must match the caller's **schema** (key pattern -> dtype, the keys
the caller ever writes), with that dtype and a byte range inside its data file. A data file is
checked (sha256 and size) the first time an entry of it is read, through the open handle the
reads then use; a read takes only the byte range of the elements asked for (resharding reads
the overlaps, not whole files). Only regular files are opened and no read goes past the size
``meta.json`` declares (``torch_side.checkpoint.safe_files``): a FIFO, a device or a growing file is
refused, never waited on. Format 2 (before ``meta_sha256``) is still read, with an
``UnverifiedMetadataWarning``.

Nothing is unpickled: files are JSON and raw bytes. The only objects exchanged between ranks
(``all_gather_object``) are this world's own live ranks' file digests and error strings.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import sys
import uuid
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
import torch.distributed as dist

from torch_side.checkpoint import safe_files, step_dirs
from torch_side.checkpoint.safe_files import CheckpointError, open_regular, parse_json, write_new
from torch_side.checkpoint.step_dirs import META, rank_files, recover
from torch_side.comm.collectives import Collective, all_gather_objects, all_reduce_on

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "META",
    "CheckpointError",
    "Entry",
    "FileDigest",
    "Schema",
    "ShardedReader",
    "UnverifiedMetadataWarning",
    "agree",
    "meta_digest",
    "new_run_id",
    "rank_files",
    "read_json",
    "recover",
    "write_step",
]

# 1 was torch.distributed.checkpoint with a pickled .metadata (refused); 2 had no meta_sha256
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
META_DIGEST = "meta_sha256"
ALIGN = 64  # entry start alignment in a data file, bytes
MAX_JSON_BYTES = 64 << 20  # a larger index or meta.json is refused rather than parsed
_CHUNK = 8 << 20
_RESERVED = frozenset({"format_version", "run_id", "step", "world_size", "byteorder", "files",
                       META_DIGEST})

# The only element types a file may declare (the schema narrows this per key).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
    "int64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

Schema = Mapping[str, torch.dtype]  # key regex (full match) -> the dtype that key must have


class UnverifiedMetadataWarning(UserWarning):
    """A format 2 checkpoint: its ``meta.json`` carries no digest of its own, so a change to it
    (a data position, a job field) cannot be detected."""


class FileDigest(NamedTuple):
    sha256: str  # hex
    size: int  # bytes


class Entry(NamedTuple):
    """One tensor in a data file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str  # data file name inside the step directory
    offset: int  # first byte in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def new_run_id() -> str:
    """A fresh random run identity (32 hex digits)."""
    return uuid.uuid4().hex


def schema_dtype(schema: Schema, key: str) -> torch.dtype | None:
    """The dtype ``schema`` gives ``key``, or None when no pattern matches it."""
    for pattern, dtype in schema.items():
        if re.fullmatch(pattern, key):
            return dtype
    return None


def agree(problem: str | None, *, group: dist.ProcessGroup | None = None) -> None:
    """Raise the same ``CheckpointError`` on every rank when any rank has a ``problem``.

    A collective (one all_reduce; an all_gather_object of the messages only when one failed),
    so a refusal on one rank never leaves the others waiting in the next collective."""
    # NCCL reduces only CUDA tensors; gloo only CPU ones
    device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.get_backend(group) == "nccl") else torch.device("cpu")
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64, device=device)
    all_reduce_on(flag, Collective.ALL_REDUCE_SUM, "a checkpoint's agreement", group)
    if not int(flag):
        return
    problems = all_gather_objects(problem, "a checkpoint's agreement (the refusals)", group)
    raise CheckpointError("; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p))


# ------------------------------------------------------------------------------------- write


def meta_digest(meta: Mapping[str, Any]) -> str:
    """The sha256 (hex) of ``meta`` without its ``meta_sha256`` field, in one canonical JSON
    form (sorted keys, no spaces): what ``meta_sha256`` holds."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def _first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return key
    return None


def _check_writable(tensors: Mapping[str, torch.Tensor], schema: Schema) -> None:
    for key, t in tensors.items():
        want = schema_dtype(schema, key)
        if want is None or t.dtype != want:
            raise CheckpointError(
                f"cannot save {key!r} ({t.dtype}): the schema allows "
                f"{'no such key' if want is None else want}; a reader would refuse it"
            )


def _write(path: Path, chunks: Iterable[bytes | memoryview]) -> FileDigest:
    h, size = write_new(path, chunks)
    return FileDigest(h.hexdigest(), size)


def _write_rank(path: Path, tensors: Mapping[str, torch.Tensor], head: dict) -> dict:
    data_name, index_name = rank_files(head["rank"])
    entries, pos = [], 0
    chunks: list[bytes | memoryview] = []
    for key, t in tensors.items():
        raw = _raw(t)
        pad = -pos % ALIGN
        if pad:
            chunks.append(bytes(pad))
            pos += pad
        entries.append({"key": key, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "offset": pos, "nbytes": len(raw)})
        chunks.append(raw)
        pos += len(raw)
    digests = {data_name: _write(path / data_name, chunks)}
    index = {**head, "data_file": data_name, "data_size": pos, "entries": entries}
    text = json.dumps(index, indent=0).encode()
    digests[index_name] = _write(path / index_name, [text])
    return {k: v._asdict() for k, v in digests.items()}


def write_step(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    *,
    run_id: str,
    step: int,
    schema: Schema,
    fields: Mapping[str, Any],
    require_finite: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Write this rank's ``tensors`` and (rank 0) ``meta.json`` as the step directory ``path``;
    a collective. Written into a staging directory and renamed into place (module note): a
    complete directory ``path`` of an earlier save stays until the new one is complete.

    ``fields`` (JSON-safe) join ``meta.json``. With ``require_finite`` no rank writes anything
    when any rank holds a non-finite float (``CheckpointError`` naming the first key and rank,
    on every rank). A failure on any rank (a full disk) is raised on every rank and nothing is
    published. Returns the meta."""
    path = Path(path)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _check_writable(tensors, schema)
    if clash := _RESERVED & set(fields):
        raise CheckpointError(f"write_step: fields {sorted(clash)} are reserved for the format")
    if require_finite:
        bad = _first_non_finite(tensors)
        agree(None if bad is None else f"refusing to save step {step}: {bad} holds a non-finite "
              f"value (nan or inf); nothing was written", group=group)
    staging = step_dirs.staging(path, run_id)
    try:  # from the staging directory's creation on: a signal anywhere leaves no partial copy
        agree(step_dirs.prepare(path, staging) if rank == 0 else None, group=group)
        head = {"format_version": FORMAT_VERSION, "run_id": run_id, "step": step, "rank": rank,
                "world_size": world}
        problem, mine = None, {}
        try:
            mine = _write_rank(staging, tensors, head)
        except OSError as e:
            problem = f"cannot write into {staging}: {e}"
        agree(problem, group=group)
        # our own ranks' digests (str, int)
        gathered = all_gather_objects(mine, "a checkpoint's file digests", group)
        meta = {"format_version": FORMAT_VERSION, "run_id": run_id, "step": step,
                "world_size": world, "byteorder": sys.byteorder,
                "files": {k: v for d in gathered for k, v in sorted(d.items())}, **fields}
        meta[META_DIGEST] = meta_digest(meta)
        problem = None
        if rank == 0:
            try:
                _write(staging / META, [json.dumps(meta, indent=1, sort_keys=True).encode()])
                step_dirs.publish(staging, path)
            except (OSError, CheckpointError) as e:
                problem = f"cannot publish {staging} as {path}: {e}"
        agree(problem, group=group)
    except BaseException:
        if rank == 0:  # abandoned: no partial copy left behind, never the step name missing
            step_dirs.abandon(staging, path)
        raise
    return meta


# -------------------------------------------------------------------------------------- read


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from the regular file ``path`` (at most ``MAX_JSON_BYTES``; NaN/Infinity
    and nesting too deep to parse refused) or a CheckpointError."""
    return safe_files.read_json(path, what, MAX_JSON_BYTES)


def _digest(f: BinaryIO, limit: int) -> FileDigest:
    """sha256 and size of ``f``, reading at most ``limit + 1`` bytes (a longer file is told
    apart by its size without reading it all)."""
    f.seek(0)
    h, size = hashlib.sha256(), 0
    while size <= limit and (chunk := f.read(min(_CHUNK, limit + 1 - size))):
        h.update(chunk)
        size += len(chunk)
    return FileDigest(h.hexdigest(), size)


def _is_int(v: Any, minimum: int = 0) -> bool:
    return type(v) is int and v >= minimum


def _check_own_digest(where: Path, meta: dict) -> None:
    if meta["format_version"] == 2:
        warnings.warn(f"{where} is format 2, which carries no digest of its own: a change to it "
                      f"cannot be detected (re-save with this version to cover it)",
                      UnverifiedMetadataWarning, stacklevel=4)
        return
    recorded = meta.get(META_DIGEST)
    if recorded != meta_digest(meta):
        raise CheckpointError(
            f"{where}: its content does not match its {META_DIGEST} ({recorded!r}): the file "
            f"was edited or damaged after it was written; refused (every field of it, the data "
            f"position and the job included, decides how training resumes)")


def _check_meta(path: Path, meta: dict) -> dict[str, FileDigest]:
    where = path / META
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{where}: format_version {meta.get('format_version')!r}, this "
                              f"code reads {list(READABLE_VERSIONS)}")
    _check_own_digest(where, meta)
    if not (isinstance(meta.get("run_id"), str) and _is_int(meta.get("step"))
            and _is_int(meta.get("world_size"), 1)):
        raise CheckpointError(f"{where}: run_id, step or world_size missing or malformed")
    if meta.get("byteorder") != sys.byteorder:
        raise CheckpointError(f"{where}: written in byte order {meta.get('byteorder')!r}, this "
                              f"machine is {sys.byteorder!r}")
    files, world = meta.get("files"), meta["world_size"]
    listed = sorted(files) if isinstance(files, dict) else files
    # the count first: a forged world size must not make us build its file list
    if not isinstance(files, dict) or len(files) != 2 * world or set(files) != {
            n for r in range(world) for n in rank_files(r)}:
        raise CheckpointError(
            f"{where}: lists files {str(listed)[:200]}, expected exactly the data and index "
            f"file of each of world size {world} ranks (rank_<r>.bin, rank_<r>.json)")
    out = {}
    for name, rec in files.items():
        if not (isinstance(rec, dict) and isinstance(rec.get("sha256"), str)
                and _is_int(rec.get("size"))):
            raise CheckpointError(f"{where}: the record of {name} is malformed: {rec!r}")
        out[name] = FileDigest(rec["sha256"], rec["size"])
    return out


class ShardedReader:
    """Verified reads from one step directory (see the module note); use as a context manager.

    ``meta``: the verified ``meta.json``; ``entries``: key -> ``Entry`` over all ranks' files.
    """

    def __init__(self, path: str | os.PathLike, schema: Schema):
        self.path = Path(path)
        self.meta = read_json(self.path / META, "checkpoint metadata")
        self._digests = _check_meta(self.path, self.meta)
        self._schema = schema
        self._open: dict[str, io.BufferedReader] = {}
        self.entries: dict[str, Entry] = {}
        try:
            for rank in range(self.meta["world_size"]):
                self._read_index(rank)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def _verified(self, name: str) -> io.BufferedReader:
        """The open file ``name``, checked against meta.json once (the reads use this handle)."""
        if name in self._open:
            return self._open[name]
        f_path = self.path / name
        f = open_regular(f_path, "checkpoint file")  # closed by close()
        want = self._digests[name]
        try:
            have = _digest(f, want.size)
        except OSError as e:
            f.close()
            raise CheckpointError(f"checkpoint file {f_path} cannot be read: {e}") from e
        if have != want:
            f.close()
            what = (f"is truncated or extended: {have.size}{'+' if have.size > want.size else ''}"
                    f" bytes, {META} records {want.size}"
                    if have.size != want.size else
                    f"is corrupt: sha256 {have.sha256}, {META} records {want.sha256}")
            raise CheckpointError(f"checkpoint file {f_path} {what} (a damaged copy, an "
                                  f"interrupted write, or a file of another run)")
        self._open[name] = f
        return f

    def _read_index(self, rank: int) -> None:
        data_name, index_name = rank_files(rank)
        f = self._verified(index_name)
        where = self.path / index_name
        f.seek(0)
        index = parse_json(f.read(self._digests[index_name].size), f"checkpoint index {where}")
        self._open.pop(index_name).close()
        want = {"format_version": self.meta["format_version"], "run_id": self.meta["run_id"],
                "step": self.meta["step"], "rank": rank, "world_size": self.meta["world_size"],
                "data_file": data_name, "data_size": self._digests[data_name].size}
        for k, v in want.items():
            if not isinstance(index, dict) or index.get(k) != v:
                got = index.get(k) if isinstance(index, dict) else index
                raise CheckpointError(
                    f"checkpoint index {where}: {k} is {got!r} but {META} says {v!r}; the "
                    f"directory mixes files of different runs or steps")
        entries = index.get("entries")
        if not isinstance(entries, list):
            raise CheckpointError(f"checkpoint index {where}: 'entries' is not a list")
        for e in entries:
            entry = self._entry(where, data_name, e)
            if entry.key in self.entries:
                raise CheckpointError(f"checkpoint index {where}: key {entry.key!r} is also "
                                      f"in {self.entries[entry.key].file}")
            self.entries[entry.key] = entry

    def _entry(self, where: Path, data_name: str, e: Any) -> Entry:
        if not (isinstance(e, dict) and isinstance(e.get("key"), str)):
            raise CheckpointError(f"checkpoint index {where}: malformed entry {e!r}")
        key, dtype_name = e["key"], e.get("dtype")
        want = schema_dtype(self._schema, key)
        if want is None:
            raise CheckpointError(f"checkpoint index {where}: unknown key {key!r}; this "
                                  f"program never writes such a key (refused)")
        if dtype_name not in DTYPES or DTYPES[dtype_name] != want:
            raise CheckpointError(f"checkpoint index {where}: {key!r} has dtype "
                                  f"{dtype_name!r}, expected {_DTYPE_NAMES[want]!r} (refused)")
        shape: Any = e.get("shape")
        offset: Any = e.get("offset")
        nbytes: Any = e.get("nbytes")
        if not (isinstance(shape, list) and all(_is_int(s) for s in shape)
                and _is_int(offset) and _is_int(nbytes)):
            raise CheckpointError(f"checkpoint index {where}: {key!r} has a malformed shape, "
                                  f"offset or nbytes: {e!r}")
        entry = Entry(key, want, tuple(shape), data_name, offset, nbytes)
        if nbytes != entry.numel * want.itemsize or offset + nbytes > (
                self._digests[data_name].size):
            raise CheckpointError(
                f"checkpoint index {where}: {key!r} declares {nbytes} bytes at offset {offset} "
                f"for shape {shape} {dtype_name}; inconsistent with itself or with {data_name} "
                f"({self._digests[data_name].size} bytes)")
        return entry

    def read(self, key: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + count)`` of ``key`` in flat order (all of it by default:
        then in its saved shape), reading only those bytes of its data file."""
        try:
            e = self.entries[key]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.path} has no entry {key!r}") from None
        full = count is None
        n = e.numel - start if count is None else count
        if not (0 <= start and 0 <= n and start + n <= e.numel):
            raise CheckpointError(f"read of {key!r}: elements [{start}, {start + n}) are "
                                  f"outside its {e.numel}")
        f = self._verified(e.file)
        size = e.dtype.itemsize
        f.seek(e.offset + start * size)
        buf = bytearray(n * size)
        if f.readinto(buf) != len(buf):
            raise CheckpointError(f"checkpoint file {self.path / e.file} ended inside {key!r}")
        t = torch.frombuffer(buf, dtype=torch.uint8).view(e.dtype) if buf else torch.empty(
            0, dtype=e.dtype)
        return t.reshape(e.shape) if full and start == 0 else t
