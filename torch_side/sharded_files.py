"""Pickle-free sharded tensor files with checksums and a run identity (DESIGN.md 10).

A **step directory** written by a world of W ranks holds, for every rank r:

- ``rank_<r>.bin``: the raw bytes of rank r's tensors, one after another (each entry starts at a
  multiple of 64 bytes), in the machine's byte order (little-endian, recorded in ``meta.json``);
- ``rank_<r>.json``: its **index**: format version, run id, step, rank, world size, the data
  file's name and size, and one entry per tensor: ``key``, ``dtype`` (from the small allowlist
  ``DTYPES``), ``shape``, byte ``offset`` and ``nbytes``;

and ``meta.json``, written last by rank 0: format version, **run id**, step, world size, byte
order, the sha256 and size of every file of the step (``files``), and the caller's own JSON fields.
A directory without ``meta.json`` is incomplete. Every file is written to a temporary name and
renamed into place.

**Run id**: a random id a caller draws once per run (``new_run_id``) and passes to every save;
each index carries it, so files of two runs mixed in one directory are told apart.

Reading (``ShardedReader``) trusts only ``meta.json``: every index file is checked against it
(sha256 and size) and must carry its run id, step, world size and its own rank; every entry's key
must match the caller's **schema** (key pattern -> dtype, the keys the caller ever writes), with
that dtype and a byte range inside its data file. A data file is checked (sha256 and size) the
first time an entry of it is read, through the open handle the reads then use; a read takes only
the byte range of the elements asked for (resharding reads the overlaps, not whole files).

Nothing is unpickled: files are JSON and raw bytes. The only objects exchanged between ranks
(``all_gather_object``) are this world's own live ranks' file digests and error strings.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "META",
    "CheckpointError",
    "Entry",
    "FileDigest",
    "Schema",
    "ShardedReader",
    "agree",
    "new_run_id",
    "rank_files",
    "read_json",
    "write_step",
]

FORMAT_VERSION = 2  # 1 was torch.distributed.checkpoint with a pickled .metadata (refused)
META = "meta.json"
ALIGN = 64  # entry start alignment in a data file, bytes
MAX_JSON_BYTES = 64 << 20  # a larger index or meta.json is refused rather than parsed
_CHUNK = 8 << 20
_RANK_FILE = re.compile(r"rank_(\d{5})\.(bin|json)")
_RESERVED = frozenset({"format_version", "run_id", "step", "world_size", "byteorder", "files"})

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


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or written: missing, corrupt, mixed, or mismatched."""


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


def rank_files(rank: int) -> tuple[str, str]:
    """(data file, index file) names of ``rank``."""
    return f"rank_{rank:05d}.bin", f"rank_{rank:05d}.json"


def schema_dtype(schema: Schema, key: str) -> torch.dtype | None:
    """The dtype ``schema`` gives ``key``, or None when no pattern matches it."""
    for pattern, dtype in schema.items():
        if re.fullmatch(pattern, key):
            return dtype
    return None


def agree(problem: str | None, *, group=None) -> None:
    """Raise the same ``CheckpointError`` on every rank when any rank has a ``problem``.

    A collective (one all_reduce; an all_gather_object of the messages only when one failed),
    so a refusal on one rank never leaves the others waiting in the next collective."""
    # NCCL reduces only CUDA tensors; gloo only CPU ones
    device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.get_backend(group) == "nccl") else torch.device("cpu")
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, group=group)
    if not int(flag):
        return
    problems: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    raise CheckpointError("; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p))


# ------------------------------------------------------------------------------------- write


def _atomic_write(path: Path, chunks) -> FileDigest:
    """Write ``chunks`` (bytes-like) to ``path`` via a temporary file and rename; their digest."""
    tmp = path.with_name(f".{path.name}.tmp")
    h, size = hashlib.sha256(), 0
    with open(tmp, "wb") as f:
        for c in chunks:
            f.write(c)
            h.update(c)
            size += len(memoryview(c))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return FileDigest(h.hexdigest(), size)


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


def _write_rank(path: Path, tensors: Mapping[str, torch.Tensor], head: dict) -> dict:
    data_name, index_name = rank_files(head["rank"])
    entries, chunks, pos = [], [], 0
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
    digests = {data_name: _atomic_write(path / data_name, chunks)}
    index = {**head, "data_file": data_name, "data_size": pos, "entries": entries}
    text = json.dumps(index, indent=0).encode()
    digests[index_name] = _atomic_write(path / index_name, [text])
    return {k: v._asdict() for k, v in digests.items()}


def _clear(path: Path) -> None:
    """Invalidate what a step directory holds (meta.json first): it is rewritten now."""
    (path / META).unlink(missing_ok=True)
    for f in path.iterdir():
        if _RANK_FILE.fullmatch(f.name) or (f.name.startswith(".") and f.name.endswith(".tmp")):
            f.unlink()  # files of the earlier save, and temporaries an interrupted one left


def write_step(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    *,
    run_id: str,
    step: int,
    schema: Schema,
    fields: Mapping[str, Any],
    require_finite: bool = True,
    group=None,
) -> dict[str, Any]:
    """Write this rank's ``tensors`` and (rank 0) ``meta.json`` into ``path``; a collective.

    ``fields`` (JSON-safe) join ``meta.json``. With ``require_finite`` no rank writes anything
    when any rank holds a non-finite float (``CheckpointError`` naming the first key and rank,
    on every rank). Files of an earlier save in ``path`` are removed first. Returns the meta."""
    path = Path(path)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _check_writable(tensors, schema)
    if clash := _RESERVED & set(fields):
        raise CheckpointError(f"write_step: fields {sorted(clash)} are reserved for the format")
    if require_finite:
        bad = _first_non_finite(tensors)
        agree(None if bad is None else f"refusing to save step {step}: {bad} holds a non-finite "
              f"value (nan or inf); nothing was written", group=group)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        _clear(path)
    dist.barrier(group=group)
    head = {"format_version": FORMAT_VERSION, "run_id": run_id, "step": step, "rank": rank,
            "world_size": world}
    mine = _write_rank(path, tensors, head)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)  # our own ranks' digests (str, int)
    meta = {"format_version": FORMAT_VERSION, "run_id": run_id, "step": step,
            "world_size": world, "byteorder": sys.byteorder,
            "files": {k: v for d in gathered for k, v in sorted(d.items())}, **fields}
    if rank == 0:
        _atomic_write(path / META, [json.dumps(meta, indent=1, sort_keys=True).encode()])
    dist.barrier(group=group)
    return meta


# -------------------------------------------------------------------------------------- read


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON here")


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path`` (size-capped; NaN/Infinity refused) or a CheckpointError."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{what} {path} is {size} bytes, over {MAX_JSON_BYTES}")
        value = json.loads(path.read_bytes(), parse_constant=_reject_constant)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{what} {path} cannot be read: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} {path} is not a JSON object")
    return value


def _digest(f: BinaryIO) -> FileDigest:
    f.seek(0)
    h, size = hashlib.sha256(), 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return FileDigest(h.hexdigest(), size)


def _is_int(v: Any, minimum: int = 0) -> bool:
    return type(v) is int and v >= minimum


def _check_meta(path: Path, meta: dict) -> dict[str, FileDigest]:
    where = path / META
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: format_version {meta.get('format_version')!r}, this "
                              f"code reads {FORMAT_VERSION}")
    if not (isinstance(meta.get("run_id"), str) and _is_int(meta.get("step"))
            and _is_int(meta.get("world_size"), 1)):
        raise CheckpointError(f"{where}: run_id, step or world_size missing or malformed")
    if meta.get("byteorder") != sys.byteorder:
        raise CheckpointError(f"{where}: written in byte order {meta.get('byteorder')!r}, this "
                              f"machine is {sys.byteorder!r}")
    files = meta.get("files")
    expected = {n for r in range(meta["world_size"]) for n in rank_files(r)}
    if not isinstance(files, dict) or set(files) != expected:
        raise CheckpointError(
            f"{where}: lists files {sorted(files) if isinstance(files, dict) else files!r}, "
            f"expected exactly {sorted(expected)} for world size {meta['world_size']}")
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
        self._open: dict[str, BinaryIO] = {}
        self.entries: dict[str, Entry] = {}
        try:
            for rank in range(self.meta["world_size"]):
                self._read_index(rank)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def _verified(self, name: str) -> BinaryIO:
        """The open file ``name``, checked against meta.json once (the reads use this handle)."""
        if name in self._open:
            return self._open[name]
        f_path = self.path / name
        try:
            f = open(f_path, "rb")  # noqa: SIM115 -- kept open for the reads; closed by close()
        except OSError as e:
            raise CheckpointError(f"checkpoint file {f_path} cannot be opened: {e}") from e
        want = self._digests[name]
        try:
            have = _digest(f)
        except OSError as e:
            f.close()
            raise CheckpointError(f"checkpoint file {f_path} cannot be read: {e}") from e
        if have != want:
            f.close()
            what = (f"is truncated or extended: {have.size} bytes, {META} records {want.size}"
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
        try:
            f.seek(0)
            index = json.loads(f.read(), parse_constant=_reject_constant)
        except ValueError as e:
            raise CheckpointError(f"checkpoint index {where} is not valid JSON: {e}") from e
        self._open.pop(index_name).close()
        want = {"format_version": FORMAT_VERSION, "run_id": self.meta["run_id"],
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
        shape, offset, nbytes = e.get("shape"), e.get("offset"), e.get("nbytes")
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
        count = e.numel - start if full else count
        if not (0 <= start and 0 <= count and start + count <= e.numel):
            raise CheckpointError(f"read of {key!r}: elements [{start}, {start + count}) are "
                                  f"outside its {e.numel}")
        f = self._verified(e.file)
        size = e.dtype.itemsize
        f.seek(e.offset + start * size)
        buf = bytearray(count * size)
        if f.readinto(buf) != len(buf):
            raise CheckpointError(f"checkpoint file {self.path / e.file} ended inside {key!r}")
        t = torch.frombuffer(buf, dtype=torch.uint8).view(e.dtype) if buf else torch.empty(
            0, dtype=e.dtype)
        return t.reshape(e.shape) if full and start == 0 else t
