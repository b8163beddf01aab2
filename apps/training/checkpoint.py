"""Training checkpoints: parts that save and load their own state, resumable at any world size.

A checkpoint is the list of **parts** of ``_parts`` (``torch_side.fsdp.sharded_state.Stateful``, as
torchtitan's checkpointer composes ``Stateful`` objects), each writing its own entries and
``meta.json`` fields, in this order:

- the model (``FSDPModel.sharded_state()``): fp32 **main weight** pieces, ``main/<name>/<offset>``,
  and the ``params`` field (every parameter's name and shape);
- the optimizer (``FSDPOptimizer.sharded_state()``): per-element states by piece
  (``optim/<state>/<name>/<offset>``, e.g. AdamW ``exp_avg``), step counts per group
  (``optim_scalar/<state>/<group>``, rank 0), and the ``optimizer`` field (its class);
- the data position (``data_position`` field, ``DataPosition.to_dict``);
- the RNG (``RngState``): each rank's ``rng/<rank>/torch`` and ``rng/<rank>/cuda`` (restored only
  at the same world size).

- the learning-rate schedule (``LRScheduleState``): the ``lr_schedule`` field, the scheduler's
  ``state_dict()`` (its step and, for the record, its config). On load the step is restored; the
  config in force is the resuming run's (as with ``--lr`` before schedules existed), so a resume
  with the same flags is bit-exact. A checkpoint without the field (written before schedules)
  resumes the schedule at its step. The app adds the
``job`` and ``data_digest`` fields, checked on load. The files
(``torch_side.checkpoint.sharded_files``): ``<save_dir>/step_<k>/rank_<r>.bin`` / ``rank_<r>.json``
per rank and ``meta.json`` (rank 0, last: format version 2, run id, step, world size, sha256 and
size of every file, the fields). ``SCHEMA`` lists the keys with their dtypes; a file declaring any
other key or dtype is refused.

``<save_dir>/latest`` names the newest complete checkpoint and is replaced (never followed
through a planted link) after that checkpoint is complete. A run saving into ``<save_dir>``
holds ``<save_dir>/writer.lock`` for its life (``apps.training.writer_lock``; a holder killed
outright is taken over), first finishes or removes what a killed save left there
(``torch_side.checkpoint.step_dirs.recover``), and writes its random **run id** into every
file. A save of a step that exists already (a resume from an earlier step into the same
directory) replaces the complete copy only once the new one is complete
(``torch_side.checkpoint.sharded_files``).

MXFP8 planes are never stored: the model part re-derives them after loading the main weights
(``FSDPModel.refresh_model_weights``), byte-identical to the planes of the run that saved. A rank
of another world size reads only the byte ranges of the saved pieces that overlap its own:
resuming at the same world size continues bit for bit, at another one to the precision
re-sharding allows.

Refused, with a ``CheckpointError`` naming the file and what is wrong (on every rank at once,
with nothing restored: every part reads before any restores): a file whose sha256 or size
differs from meta.json, an index of another run or step, an unknown key or dtype, a checkpoint
of another model, optimizer or job setup, other data (content digest), a save holding a
non-finite value (``latest`` then stays where it was), an edited ``meta.json`` (its own
digest), an RNG state of the wrong size, files that are not regular files (a FIFO, a device),
a load that takes longer than its ``timeout`` on any rank (a stalled file system: every rank
stops with the error instead of waiting forever), and format 1 checkpoints (DCP, whose
``.metadata`` is a pickle: never read, for safety).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist

from apps.training.data import DataPosition
from apps.training.lr_schedule import LRScheduler
from apps.training.writer_lock import WriterLock
from torch_side.checkpoint.safe_files import bounded, open_regular, read_bounded, replace_text
from torch_side.checkpoint.sharded_files import (
    FORMAT_VERSION,
    META,
    CheckpointError,
    ShardedReader,
    agree,
    new_run_id,
    read_json,
    recover,
)
from torch_side.checkpoint.step_dirs import interrupted_copies
from torch_side.comm.collectives import broadcast_object
from torch_side.fsdp.fsdp_model import FSDPModel
from torch_side.fsdp.optimizer import FSDPOptimizer
from torch_side.fsdp.sharded_state import (
    MODEL_SCHEMA,
    OPTIMIZER_SCHEMA,
    Restore,
    Stateful,
    key_text,
    parse_key,
    read_parts,
    save_parts,
)

__all__ = [
    "FORMAT_VERSION",
    "SCHEMA",
    "CheckpointError",
    "CheckpointSaver",
    "DataPositionState",
    "LRScheduleState",
    "ResumeState",
    "RngKey",
    "RngState",
    "checkpoint_dir",
    "load",
    "resolve",
]

LATEST = "latest"
_STEP_DIR = re.compile(r"step_\d{6,}")


class _RngFields(NamedTuple):
    rank: int
    device: str  # "torch" (the CPU generator) or "cuda"


class RngKey(_RngFields):
    """One rank's RNG state of one device type (a key of ``torch_side.fsdp.sharded_state.Key``)."""

    __slots__ = ()
    PREFIX: ClassVar[str] = "rng"


RNG_SCHEMA: dict[str, torch.dtype] = {r"rng/\d+/(torch|cuda)": torch.uint8}
SCHEMA: dict[str, torch.dtype] = {**MODEL_SCHEMA, **OPTIMIZER_SCHEMA, **RNG_SCHEMA}


class ResumeState(NamedTuple):
    step: int  # the number of completed steps (training continues at this step index)
    position: DataPosition
    meta: dict[str, Any]


# ------------------------------------------------------------------------- the parts


class RngState:
    """This rank's RNG states; restored only at the world size that saved them (at another one
    the ranks are other ranks, and each keeps its own seeded generators)."""

    schema = RNG_SCHEMA

    def __init__(self) -> None:
        # the rank and world size are read here, on the caller's thread: a bounded read runs the
        # reading in a worker thread (safe_files.bounded)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def state_entries(self) -> dict[str, torch.Tensor]:
        rank = self.rank
        out = {key_text(RngKey(rank, "torch")): torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out[key_text(RngKey(rank, "cuda"))] = torch.cuda.get_rng_state()
        return out

    def state_fields(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def _size(device: str) -> int | None:
        """Bytes of this process's ``device`` generator state (None: no such generator)."""
        if device == "torch":
            return torch.get_rng_state().numel()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.get_rng_state().numel()
        return None

    def read_state(self, reader: ShardedReader) -> Restore:
        states = {}
        if reader.meta["world_size"] == self.world_size:
            for text in reader.entries:
                key = parse_key(text, [RngKey])
                if key is not None and key.rank == self.rank:
                    states[key.device] = reader.read(text)
        for device, state in states.items():  # checked now: nothing is restored yet
            want = self._size(device)
            if want is not None and state.numel() != want:
                raise CheckpointError(
                    f"{reader.path}: the {device} RNG state of rank {self.rank} has "
                    f"{state.numel()} bytes, this generator's has {want}; refused")

        def restore() -> None:
            if "torch" in states:
                torch.set_rng_state(states["torch"])
            if "cuda" in states and torch.cuda.is_available():
                torch.cuda.set_rng_state(states["cuda"])

        return restore


class DataPositionState:
    """The data position: small JSON state, a ``meta.json`` field."""

    schema: dict[str, torch.dtype] = {}
    FIELD = "data_position"

    def __init__(self, position: DataPosition | None = None):
        self.position = DataPosition(0) if position is None else position

    def state_entries(self) -> dict[str, torch.Tensor]:
        return {}

    def state_fields(self) -> dict[str, Any]:
        return {self.FIELD: self.position.to_dict()}

    def read_state(self, reader: ShardedReader) -> Restore:
        position = DataPosition.from_dict(reader.meta.get(self.FIELD))  # checked before restoring

        def restore() -> None:
            self.position = position

        return restore


class LRScheduleState:
    """The learning-rate scheduler's step (and config, for the record): a ``meta.json`` field."""

    schema: dict[str, torch.dtype] = {}
    FIELD = "lr_schedule"

    def __init__(self, scheduler: LRScheduler):
        self.scheduler = scheduler

    def state_entries(self) -> dict[str, torch.Tensor]:
        return {}

    def state_fields(self) -> dict[str, Any]:
        return {self.FIELD: self.scheduler.state_dict()}

    def read_state(self, reader: ShardedReader) -> Restore:
        step = reader.meta.get("step")
        saved = reader.meta.get(self.FIELD, {"step": step})  # older checkpoints: at their step
        if not isinstance(saved, dict) or saved.get("step") != step:
            raise CheckpointError(
                f"{reader.path / META}: field {self.FIELD!r} = {saved!r} does not hold the "
                f"checkpoint's step {step}; the metadata is inconsistent"
            )

        def restore() -> None:
            self.scheduler.load_state_dict(saved)

        return restore


def _parts(fsdp: FSDPModel, opt: FSDPOptimizer, position: DataPositionState,
           scheduler: LRScheduler | None = None) -> list[Stateful]:
    """What a training checkpoint holds, in save order (main weights first, so a non-finite
    refusal names a weight before its optimizer state)."""
    parts: list[Stateful] = [fsdp.sharded_state(), opt.sharded_state(), position, RngState()]
    return parts if scheduler is None else [*parts, LRScheduleState(scheduler)]


def checkpoint_dir(save_dir: str | os.PathLike, step: int) -> Path:
    return Path(save_dir) / f"step_{step:06d}"


# ------------------------------------------------------------------------- save


def _report_takeover(lock: WriterLock) -> None:
    gone = lock.taken_over
    if gone is not None:
        print(f"checkpoint: {lock.path}: taken over from run {gone.get('run_id')} (pid "
              f"{gone.get('pid')} on this host, since {gone.get('started')}), which is no longer "
              f"running", file=sys.stderr, flush=True)


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
                _report_takeover(lock)
                # what a killed save left (we hold the lock), a half-written pointer included
                for line in recover(save_dir, texts=(LATEST,)):
                    print(f"checkpoint: {save_dir}: {line}", file=sys.stderr, flush=True)
            except (CheckpointError, OSError) as e:
                if lock is not None:
                    lock.release()
                problem = str(e)
        agree(problem)
        # rank 0's id (a str between our own ranks)
        return cls(save_dir, broadcast_object(run_id, "the checkpoint's run id"), lock)

    def __enter__(self) -> CheckpointSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def save(self, *, step: int, fsdp: FSDPModel, opt: FSDPOptimizer, position: DataPosition,
             job: Mapping, data_digest: str, scheduler: LRScheduler | None = None) -> Path:
        """Write the checkpoint of ``step`` completed steps, then point ``latest`` at it.

        Refused on every rank, with nothing written and ``latest`` unchanged, when a main weight
        or optimizer state holds a non-finite value or this run no longer holds the lock."""
        lost = None
        if self._lock is not None and not self._lock.held():
            lost = (f"{self._lock.path} no longer names this run ({self.run_id}): another run "
                    f"took the directory over; refusing to save step {step} there")
        agree(lost)
        path = checkpoint_dir(self.save_dir, step)
        save_parts(path, _parts(fsdp, opt, DataPositionState(position), scheduler),
                   run_id=self.run_id, step=step,
                   fields={"data_digest": data_digest, "job": dict(job)})
        if dist.get_rank() == 0:
            replace_text(self.save_dir / LATEST, path.name + "\n")
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


def _usable(step_dir: Path) -> Path | None:
    """``step_dir`` if it is complete; else, when it is missing because a save was killed
    between the two renames of its swap, the complete copy that save left (``step_dirs``)."""
    if (step_dir / META).is_file() or (step_dir / ".metadata").is_file():
        return step_dir
    if step_dir.exists() or not _STEP_DIR.fullmatch(step_dir.name):
        return None
    copies = interrupted_copies(step_dir)
    return copies[0] if copies else None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from ``--resume``: a step directory, or a save dir (its latest)."""
    path = Path(path)
    if (found := _usable(path)) is not None:
        return found
    latest = path / LATEST
    if latest.exists() or latest.is_symlink():
        with open_regular(latest, "checkpoint pointer") as f:
            raw = read_bounded(f, 256, f"checkpoint pointer {latest}")
        name = raw.decode("utf-8", errors="replace").strip()
        if not _STEP_DIR.fullmatch(name):
            raise CheckpointError(f"{latest} holds {name[:80]!r}, not a step_<k> directory name")
        if (found := _usable(path / name)) is not None:
            return found
        raise CheckpointError(
            f"{latest} names {name!r}, which has no {META}: the checkpoint is incomplete"
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
_MUST_MATCH = ("config", "weights", "activations", "seed", "branching", "blocks_per_unit")
# what a checkpoint saved before a field existed ran with
_SAVED_DEFAULTS = {"blocks_per_unit": 1}


def _check_meta(path: Path, meta: Mapping, job: Mapping, data_digest: str) -> None:
    """The app's own fields; each part checks its own (the model its parameters)."""
    where = path / META
    saved_job = meta.get("job")
    if not isinstance(saved_job, dict) or not isinstance(meta.get("params"), dict):
        raise CheckpointError(f"{where}: 'job' or 'params' missing; not a training checkpoint")
    for key in _MUST_MATCH:  # (blocks_per_unit: the optimizer state is kept per unit group)
        saved = saved_job.get(key, _SAVED_DEFAULTS.get(key))
        if saved != job.get(key):
            raise CheckpointError(
                f"{where}: the checkpoint was saved with {key}={saved!r} but this "
                f"run has {key}={job.get(key)!r}; resume with the same {key}"
            )
    if meta.get("data_digest") != data_digest:
        raise CheckpointError(
            f"{where}: the checkpoint was trained on data with digest "
            f"{meta.get('data_digest')!r} (--data {saved_job.get('data')!r}), but this run's "
            f"--data {job.get('data')!r} has digest {data_digest!r}; resume on the same data"
        )


def load(path: str | os.PathLike, *, fsdp: FSDPModel, opt: FSDPOptimizer, job: Mapping,
         data_digest: str, scheduler: LRScheduler | None = None,
         timeout: float | None = None) -> ResumeState:
    """Restore every part (main weights, then MXFP8 planes re-derived; optimizer state; data
    position; RNG; the LR scheduler's step when one is given) -- a collective: call on every
    rank. Checks the checkpoint against this run and every file it reads against meta.json
    first; any rank's refusal is raised on every rank with nothing restored. ``timeout``: the
    seconds this rank may spend reading (None: no limit); past it the read is a refusal, so a
    stalled file system stops every rank instead of leaving them waiting in a collective (give
    less than the collective timeout)."""
    problem, pending = None, None
    position = DataPositionState()

    parts = _parts(fsdp, opt, position, scheduler)  # on this thread (RngState reads the rank)

    def read():
        where = resolve(path)
        _check_version(where)
        return read_parts(where, parts, lambda meta: _check_meta(where, meta, job, data_digest))

    try:
        pending = bounded(read, timeout, f"reading the checkpoint {path}")
    except (CheckpointError, TypeError, ValueError) as e:
        problem = str(e)
    agree(problem)
    assert pending is not None
    pending.apply()
    return ResumeState(int(pending.meta["step"]), position.position, pending.meta)
