"""Sharded training checkpoints without pickle, verified on load, resumable at any world size.

Layout of one checkpoint, ``<save_dir>/step_<k>/`` (the files of ``torch_side.sharded_files``):

- ``rank_<r>.bin`` / ``rank_<r>.json``, written by every rank: for each parameter piece the rank
  owns, its fp32 **main weight** slice and optimizer state slices (e.g. AdamW ``exp_avg``,
  ``exp_avg_sq``), keyed by parameter name and the piece's flat offset in the parameter
  (``main/<name>/<offset>``, ``optim/<state>/<name>/<offset>``); the optimizer's step count per
  group (``optim_scalar/<state>/<group>``, rank 0 only: it is replicated); and the rank's RNG
  states (``rng/<rank>/torch``, ``rng/<rank>/cuda``; restored only at the same world size).
  ``SCHEMA`` lists these keys with their dtypes; a file declaring any other key or dtype is refused.
- ``meta.json`` (rank 0, last): format version 2, run id, step, world size, sha256 and size of
  every file, and the training fields: data position, the job, the data's content digest
  (``Corpus.content_digest``), every parameter's name and shape, the optimizer class.

``<save_dir>/latest`` names the newest complete checkpoint and is written after its meta.json.
A run saving into ``<save_dir>`` holds ``<save_dir>/writer.lock`` for its life
(``apps.training.writer_lock``); its random **run id** is in every file it writes.

MXFP8 planes are never stored: after loading the main weights every rank re-derives them with the
distributed quantization (``FSDPModel.refresh_model_weights``), byte-identical to the planes of the
run that saved. Offsets within a parameter do not depend on the world size, so a rank of another
world size reads only the byte ranges of the saved pieces that overlap its own: resuming at the
same world size continues bit for bit, at another one to the precision re-sharding allows.

Refused, with a ``CheckpointError`` naming the file and what is wrong (on every rank at once): a
file whose sha256 or size differs from meta.json, an index of another run or step, an unknown key
or dtype, a checkpoint of another model or job setup, other data (content digest), a save holding
a non-finite value (``latest`` then stays where it was), and format 1 checkpoints (DCP, whose
``.metadata`` is a pickle: never read, for safety).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from apps.training.data import DataPosition
from apps.training.writer_lock import WriterLock
from torch_side.sharded_files import (
    FORMAT_VERSION,
    META,
    CheckpointError,
    ShardedReader,
    agree,
    new_run_id,
    read_json,
    write_step,
)

__all__ = [
    "FORMAT_VERSION",
    "SCHEMA",
    "CheckpointError",
    "CheckpointSaver",
    "ResumeState",
    "checkpoint_dir",
    "load",
    "resolve",
]

LATEST = "latest"
_STEP_DIR = re.compile(r"step_\d{6,}")
_NAME = r"[A-Za-z0-9_.]+"  # parameter and state names (module paths)
SCHEMA: dict[str, torch.dtype] = {
    rf"main/{_NAME}/\d+": torch.float32,
    rf"optim/{_NAME}/{_NAME}/\d+": torch.float32,
    rf"optim_scalar/{_NAME}/[A-Za-z0-9_.<>/-]+": torch.float32,
    r"rng/\d+/(torch|cuda)": torch.uint8,
}


class ResumeState(NamedTuple):
    step: int  # the number of completed steps (training continues at this step index)
    position: DataPosition
    meta: dict[str, Any]


# ------------------------------------------------------------------------- what a rank holds


class _Piece(NamedTuple):
    name: str  # parameter name
    offset: int  # first element, in the parameter's own flat order
    group: Any  # torch_side ParamGroup
    lo: int  # slice of the group's main / optimizer tensors
    hi: int


def _pieces(fsdp) -> list[_Piece]:
    out = []
    for g in fsdp.param_groups:
        for p in g.main_pieces():
            slot = g.layout.slots[p.slot_index]
            out.append(_Piece(slot.name, p.param_offset, g, p.shard_offset,
                              p.shard_offset + p.numel))
    return out


def _optim_states(opt, group) -> dict[str, torch.Tensor]:
    return opt.optimizer.state.get(group.main, {})


def _state_dict(fsdp, opt) -> dict[str, torch.Tensor]:
    """This rank's tensors to save (see the module note); main weights first, so a non-finite
    refusal names a weight before its optimizer state."""
    sd: dict[str, torch.Tensor] = {}
    pieces = _pieces(fsdp)
    for pc in pieces:
        sd[f"main/{pc.name}/{pc.offset}"] = pc.group.main[pc.lo:pc.hi]
    for pc in pieces:
        for key, value in _optim_states(opt, pc.group).items():
            if torch.is_tensor(value) and value.shape == pc.group.main.shape:
                sd[f"optim/{key}/{pc.name}/{pc.offset}"] = value[pc.lo:pc.hi]
    rank = dist.get_rank()
    if rank == 0:
        for g in opt.groups:
            for key, value in _optim_states(opt, g).items():
                if torch.is_tensor(value) and value.dim() == 0:
                    sd[f"optim_scalar/{key}/{g.label}"] = value.detach().float()
    sd[f"rng/{rank}/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sd[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state()
    return sd


def _param_shapes(fsdp) -> dict[str, list[int]]:
    return {s.name: list(s.shape) for g in fsdp.param_groups for s in g.layout.slots}


def checkpoint_dir(save_dir: str | os.PathLike, step: int) -> Path:
    return Path(save_dir) / f"step_{step:06d}"


# ------------------------------------------------------------------------- save


class CheckpointSaver:
    """The saving side of one training run: the directory lock (rank 0), the run id, the saves.

    ``start`` and ``save`` are collectives (call on every rank); ``close`` releases the lock
    (rank 0; local, so it is safe in a ``finally`` after another rank failed). A context manager.
    """

    def __init__(self, save_dir: Path, run_id: str, lock: WriterLock | None):
        self.save_dir, self.run_id, self._lock = save_dir, run_id, lock

    @classmethod
    def start(cls, save_dir: str | os.PathLike) -> CheckpointSaver:
        """Take ``<save_dir>/writer.lock`` for a fresh run id; every rank raises the same
        ``CheckpointError`` when another run holds it."""
        save_dir = Path(save_dir)
        run_id, lock, problem = new_run_id(), None, None
        if dist.get_rank() == 0:
            try:
                lock = WriterLock.acquire(save_dir, run_id)
            except (CheckpointError, OSError) as e:
                problem = str(e)
        agree(problem)
        box = [run_id]
        dist.broadcast_object_list(box, src=0)  # rank 0's id (a str between our own ranks)
        return cls(save_dir, box[0], lock)

    def __enter__(self) -> CheckpointSaver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def save(self, *, step: int, fsdp, opt, position: DataPosition, job: Mapping,
             data_digest: str) -> Path:
        """Write the checkpoint of ``step`` completed steps, then point ``latest`` at it.

        Refused on every rank, with nothing written and ``latest`` unchanged, when a main weight
        or optimizer state holds a non-finite value or this run no longer holds the lock."""
        lost = None
        if self._lock is not None and not self._lock.held():
            lost = (f"{self._lock.path} no longer names this run ({self.run_id}): another run "
                    f"took the directory over; refusing to save step {step} there")
        agree(lost)
        path = checkpoint_dir(self.save_dir, step)
        fields = {
            "data_position": position.to_dict(),
            "data_digest": data_digest,
            "job": dict(job),
            "params": _param_shapes(fsdp),
            "optimizer": type(opt.optimizer).__name__,
        }
        write_step(path, _state_dict(fsdp, opt), run_id=self.run_id, step=step, schema=SCHEMA,
                   fields=fields)
        if dist.get_rank() == 0:
            latest = self.save_dir / (LATEST + ".tmp")
            latest.write_text(path.name + "\n")
            latest.replace(self.save_dir / LATEST)
        return path


# ------------------------------------------------------------------------- load


def _refuse_format_1(where: Path) -> CheckpointError:
    return CheckpointError(
        f"{where}: this checkpoint was written by an earlier version of mxfp8-train (format 1, "
        f"torch.distributed.checkpoint), whose .metadata file is a pickle; pickles from "
        f"checkpoints are no longer loaded, for safety (unpickling can run code planted in the "
        f"file), and it was not opened. Retrain with this version (format {FORMAT_VERSION}), or, "
        f"if you trust where the files came from, finish that run with the earlier version "
        f"that wrote it")


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from ``--resume``: a step directory, or a save dir (its latest)."""
    path = Path(path)
    if (path / META).is_file() or (path / ".metadata").is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        if not _STEP_DIR.fullmatch(name):
            raise CheckpointError(f"{latest} holds {name[:80]!r}, not a step_<k> directory name")
        step_dir = path / name
        if (step_dir / META).is_file() or (step_dir / ".metadata").is_file():
            return step_dir
        raise CheckpointError(
            f"{latest} names {step_dir.name!r}, which has no {META}: the checkpoint is incomplete"
        )
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    raise CheckpointError(
        f"{path} is not a checkpoint: it holds neither {META} (a step directory) nor {LATEST} "
        f"(a save directory); pass the --save-dir of a run or one of its step_* directories"
    )


def _check_version(path: Path) -> None:
    """Format 1 is refused before anything but its meta.json is read (never its .metadata)."""
    if not (path / META).is_file():
        raise _refuse_format_1(path / ".metadata")
    meta = read_json(path / META, "checkpoint metadata")
    if meta.get("format_version") == 1:
        raise _refuse_format_1(path / META)


# Job fields that must match for a resume (others, e.g. steps, lr, metrics, may change). The
# data is matched by content (data_digest), not by the --data string.
_MUST_MATCH = ("config", "weights", "activations", "seed", "branching")


def _check_meta(path: Path, meta: Mapping, fsdp, job: Mapping, data_digest: str) -> None:
    where = path / META
    saved_job = meta.get("job")
    if not isinstance(saved_job, dict) or not isinstance(meta.get("params"), dict):
        raise CheckpointError(f"{where}: 'job' or 'params' missing; not a training checkpoint")
    for key in _MUST_MATCH:
        if saved_job.get(key) != job.get(key):
            raise CheckpointError(
                f"{where}: the checkpoint was saved with {key}={saved_job.get(key)!r} but this "
                f"run has {key}={job.get(key)!r}; resume with the same {key}"
            )
    if meta.get("data_digest") != data_digest:
        raise CheckpointError(
            f"{where}: the checkpoint was trained on data with digest "
            f"{meta.get('data_digest')!r} (--data {saved_job.get('data')!r}), but this run's "
            f"--data {job.get('data')!r} has digest {data_digest!r}; resume on the same data"
        )
    ours = _param_shapes(fsdp)
    if meta["params"] != ours:
        diff = sorted(
            n for n in set(ours) | set(meta["params"]) if ours.get(n) != meta["params"].get(n)
        )
        raise CheckpointError(
            f"{where}: parameters differ from this model's (first: {diff[:3]}); the checkpoint "
            f"belongs to another model"
        )


def _saved_pieces(reader: ShardedReader, params: Mapping) -> dict[str, list[tuple[int, int]]]:
    """name -> [(offset, numel)] of the saved main-weight pieces, each inside its parameter."""
    out: dict[str, list[tuple[int, int]]] = {}
    for key, e in reader.entries.items():
        if not key.startswith("main/"):
            continue
        name, offset = key[5:].rsplit("/", 1)
        numel = 1
        for s in params.get(name, [0]):
            numel *= s
        if name not in params or int(offset) + e.numel > numel or len(e.shape) != 1:
            raise CheckpointError(
                f"{reader.path / e.file}: {key!r} ({e.numel} elements) is not a piece of a "
                f"parameter of this model (its shape: {params.get(name)})")
        out.setdefault(name, []).append((int(offset), e.numel))
    return out


def _overlaps(saved, name: str, offset: int, numel: int):
    """(saved offset, saved length) of every saved piece of ``name`` overlapping
    [offset, offset + numel)."""
    for start, length in saved.get(name, ()):
        if start < offset + numel and offset < start + length:
            yield start, length


class _Overlap(NamedTuple):
    """Saved elements that land in one of this rank's pieces."""

    group: Any  # torch_side ParamGroup
    dst: slice  # in the group's main / optimizer tensors
    values: dict[str, torch.Tensor]  # "main" or an optimizer state name -> the saved elements


class _Loaded(NamedTuple):
    overlaps: list[_Overlap]
    states: list[str]  # optimizer state names of the per-element states (e.g. exp_avg)
    scalars: dict[str, torch.Tensor]  # optim_scalar/<state>/<group label> -> 0-d
    rng: dict[str, torch.Tensor]  # "torch" / "cuda" -> state (same world size only)


def _read_local(path: Path, reader: ShardedReader, fsdp, opt) -> _Loaded:
    """Every value this rank needs, read (and verified) before anything is restored: only the
    byte ranges of the saved pieces that overlap this rank's pieces."""
    saved = _saved_pieces(reader, reader.meta["params"])
    states = sorted({k.split("/")[1] for k in reader.entries if k.startswith("optim/")})
    overlaps = []
    for pc in _pieces(fsdp):
        n = pc.hi - pc.lo
        covered = 0
        kinds = ["main"] + (states if pc.group in opt.groups else [])
        for start, length in _overlaps(saved, pc.name, pc.offset, n):
            a, b = max(start, pc.offset), min(start + length, pc.offset + n)
            covered += b - a
            values = {
                kind: reader.read(("main" if kind == "main" else f"optim/{kind}")
                                  + f"/{pc.name}/{start}", a - start, b - a)
                for kind in kinds
            }
            dst = slice(pc.lo + a - pc.offset, pc.lo + b - pc.offset)
            overlaps.append(_Overlap(pc.group, dst, values))
        if covered != n:
            raise CheckpointError(
                f"{path}: the saved main weights cover {covered} of the {n} elements of "
                f"{pc.name!r} at offset {pc.offset} this rank needs; the checkpoint is incomplete"
            )
    scalars = {k: reader.read(k) for k in reader.entries if k.startswith("optim_scalar/")}
    rng = {}
    if reader.meta["world_size"] == dist.get_world_size():
        prefix = f"rng/{dist.get_rank()}/"
        rng = {k[len(prefix):]: reader.read(k) for k in reader.entries if k.startswith(prefix)}
    return _Loaded(overlaps, states, scalars, rng)


def load(path, *, fsdp, opt, job: Mapping, data_digest: str) -> ResumeState:
    """Restore main weights, optimizer state and RNG (a collective: call on every rank), then
    re-derive the MXFP8 planes. Checks the checkpoint against this run and every file it reads
    against meta.json first; any rank's refusal is raised on every rank."""
    problem, loaded, meta = None, None, {}
    try:
        path = resolve(path)
        _check_version(path)
        with ShardedReader(path, SCHEMA) as reader:
            meta = reader.meta
            _check_meta(path, meta, fsdp, job, data_digest)
            loaded = _read_local(path, reader, fsdp, opt)
        position = DataPosition.from_dict(meta.get("data_position"))
    except (CheckpointError, TypeError, ValueError) as e:
        problem = str(e)
    agree(problem)
    _restore(loaded, opt)
    fsdp.refresh_model_weights()  # MXFP8 planes re-derived from the loaded main weights
    return ResumeState(int(meta["step"]), position, meta)


def _restore(loaded: _Loaded, opt) -> None:
    for g in opt.groups:
        state = opt.optimizer.state.setdefault(g.main, {})
        for key in loaded.states:
            state.setdefault(key, torch.zeros_like(g.main))
        for k, v in loaded.scalars.items():
            _, name, label = k.split("/", 2)
            if label == g.label:
                state[name] = v.clone()  # step counts stay on the CPU, as torch.optim keeps them
    with torch.no_grad():
        for o in loaded.overlaps:
            for kind, v in o.values.items():
                t = o.group.main if kind == "main" else opt.optimizer.state[o.group.main][kind]
                t[o.dst].copy_(v)
    if "torch" in loaded.rng:
        torch.set_rng_state(loaded.rng["torch"])
    if "cuda" in loaded.rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(loaded.rng["cuda"])
