"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP), resumable at any
world size.

Layout of one checkpoint, ``<save_dir>/step_<k>/``:

- DCP files written by every rank: for each parameter piece a rank owns, its fp32 **main weight**
  slice and the optimizer state slices (e.g. AdamW ``exp_avg``, ``exp_avg_sq``), keyed by the
  parameter name and the piece's flat offset in the parameter (``main/<name>/<offset>``,
  ``optim/<state>/<name>/<offset>``); the optimizer's step count per group (replicated); and each
  rank's RNG states (``rng/<rank>/...``, restored only at the same world size).
- ``meta.json`` (rank 0, plain JSON): format version, step, data position, world size, the job,
  and every parameter's name and shape -- what a resume is checked against.

MXFP8 planes are never stored: after loading the main weights, every rank re-derives them with
the distributed quantization (``FSDPModel.refresh_model_weights``), byte-identical to the planes
of the run that saved. Offsets within a parameter do not depend on the world size, so a rank of
another world size reads the saved pieces overlapping its own and copies the overlap: resuming at
the same world size continues bit for bit, at another one to the precision re-sharding allows
(the optimizer and weights are the same numbers; only the gradient reduction order changes).

Safety: DCP reads tensors with ``torch.load(weights_only=True)``; its ``.metadata`` file is a
pickle, read here with an unpickler that admits only DCP's own metadata classes and torch's
dtype/size objects. A missing, truncated or mismatched checkpoint raises ``CheckpointError``
naming the file and what is wrong. ``<save_dir>/latest`` names the newest complete checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from apps.training.data import DataPosition

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "ResumeState",
    "SafeFileSystemReader",
    "checkpoint_dir",
    "load",
    "resolve",
    "save",
]

FORMAT_VERSION = 1
META = "meta.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, truncated, or from another model/run setup."""


class ResumeState(NamedTuple):
    step: int  # the number of completed steps (training continues at this step index)
    position: DataPosition
    meta: dict[str, Any]


# ------------------------------------------------------------------------- safe metadata


_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "float32"),
    ("torch", "bfloat16"),
    ("torch", "uint8"),
    ("torch", "int64"),
    ("torch", "strided"),
    ("torch", "contiguous_format"),
    ("torch", "preserve_format"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "getattr"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # the checkpoint id DCP records (a path: inert)
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name} from a checkpoint's metadata (only DCP "
            f"metadata classes are allowed)"
        )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with an allowlist (see module note)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise CheckpointError(f"checkpoint metadata {path} cannot be read: {e}") from e
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise CheckpointError(f"checkpoint metadata {path} is not valid: {e}") from e
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return metadata


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
    """This rank's tensors to save (see the module note)."""
    sd: dict[str, torch.Tensor] = {}
    # clones: DCP writes a tensor's whole storage, and these are slices of the group buffers
    for pc in _pieces(fsdp):
        sd[f"main/{pc.name}/{pc.offset}"] = pc.group.main[pc.lo:pc.hi].clone()
        for key, value in _optim_states(opt, pc.group).items():
            if torch.is_tensor(value) and value.shape == pc.group.main.shape:
                sd[f"optim/{key}/{pc.name}/{pc.offset}"] = value[pc.lo:pc.hi].clone()
    for g in opt.groups:
        for key, value in _optim_states(opt, g).items():
            if torch.is_tensor(value) and value.dim() == 0:
                sd[f"optim_scalar/{key}/{g.label}"] = value.detach().clone()
    rank = dist.get_rank()
    sd[f"rng/{rank}/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sd[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state()
    return sd


def _param_shapes(fsdp) -> dict[str, list[int]]:
    return {s.name: list(s.shape) for g in fsdp.param_groups for s in g.layout.slots}


def checkpoint_dir(save_dir: str | os.PathLike, step: int) -> Path:
    return Path(save_dir) / f"step_{step:06d}"


def save(save_dir, *, step: int, fsdp, opt, position: DataPosition, job: Mapping) -> Path:
    """Write the checkpoint of ``step`` completed steps (a collective: call on every rank)."""
    path = checkpoint_dir(save_dir, step)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(_state_dict(fsdp, opt), storage_writer=FileSystemWriter(path))
    if dist.get_rank() == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "data_position": position.to_dict(),
            "world_size": dist.get_world_size(),
            "job": dict(job),
            "params": _param_shapes(fsdp),
            "optimizer": type(opt.optimizer).__name__,
        }
        tmp = path / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
        tmp.replace(path / META)
        latest = Path(save_dir) / (LATEST + ".tmp")
        latest.write_text(path.name + "\n")
        latest.replace(Path(save_dir) / LATEST)
    dist.barrier()
    return path


# ------------------------------------------------------------------------- load


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory from ``--resume``: a step directory, or a save dir (its latest)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        step_dir = path / latest.read_text().strip()
        if (step_dir / META).is_file():
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


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path / META} cannot be read: {e}") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path / META}: format_version {meta.get('format_version')!r}, this code reads "
            f"{FORMAT_VERSION}"
        )
    return meta


# Job fields that must match for a resume (others, e.g. steps, lr, metrics, may change).
_MUST_MATCH = ("config", "weights", "activations", "data", "seed", "branching")


def _check_meta(path: Path, meta: Mapping, fsdp, job: Mapping) -> None:
    where = path / META
    for key in _MUST_MATCH:
        if meta["job"].get(key) != job.get(key):
            raise CheckpointError(
                f"{where}: the checkpoint was saved with {key}={meta['job'].get(key)!r} but this "
                f"run has {key}={job.get(key)!r}; resume with the same {key}"
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


def _check_files(path: Path, metadata) -> None:
    """Every data file the metadata points into exists and is long enough (a truncated copy or
    an interrupted write is named here, before DCP fails somewhere inside its reader)."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint data file {f} is missing")
        have = f.stat().st_size
        if have < size:
            raise CheckpointError(
                f"checkpoint data file {f} is truncated: {have} bytes, the metadata needs {size}"
            )


def _overlaps(saved: dict[str, int], name: str, offset: int, numel: int):
    """(key, saved offset, saved length) of every saved piece of ``name`` overlapping
    [offset, offset + numel)."""
    for key, length in saved.items():
        if not key.startswith(name + "/"):
            continue
        start = int(key[len(name) + 1:])
        if start < offset + numel and offset < start + length:
            yield key, start, length


def load(path, *, fsdp, opt, job: Mapping) -> ResumeState:
    """Restore main weights, optimizer state and RNG (a collective: call on every rank), then
    re-derive the MXFP8 planes. Checks the checkpoint against this run first."""
    path = resolve(path)
    meta = _read_meta(path)
    _check_meta(path, meta, fsdp, job)
    reader = SafeFileSystemReader(path)
    md = reader.read_metadata().state_dict_metadata
    saved_main = {k[5:]: md[k].size.numel() for k in md if k.startswith("main/")}
    pieces = _pieces(fsdp)
    request: dict[str, torch.Tensor] = {}
    for pc in pieces:
        for key, _, length in _overlaps(saved_main, pc.name, pc.offset, pc.hi - pc.lo):
            request[f"main/{key}"] = torch.empty(length, dtype=torch.float32)
    optim_keys = sorted({k.split("/")[1] for k in md if k.startswith("optim/")})
    for state in optim_keys:
        for k in list(request):
            if k.startswith("main/"):
                request[f"optim/{state}/{k[5:]}"] = torch.empty_like(request[k])
    for k in md:
        if k.startswith("optim_scalar/"):
            request[k] = torch.empty((), dtype=torch.float32)
    same_world = meta["world_size"] == dist.get_world_size()
    rank = dist.get_rank()
    if same_world:
        for k in md:
            if k.startswith(f"rng/{rank}/"):
                request[k] = torch.empty(md[k].size, dtype=torch.uint8)
    for pc in pieces:
        n = pc.hi - pc.lo
        covered = sum(
            min(s + ln, pc.offset + n) - max(s, pc.offset)
            for _, s, ln in _overlaps(saved_main, pc.name, pc.offset, n)
        )
        if covered != n:
            raise CheckpointError(
                f"{path}: the saved main weights cover {covered} of the {n} elements of "
                f"{pc.name!r} at offset {pc.offset} this rank needs; the checkpoint is incomplete"
            )
    _check_files(path, reader.read_metadata())
    try:
        dcp.load(request, storage_reader=reader)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- DCP's errors name no file
        raise CheckpointError(
            f"checkpoint {path} could not be read (a data file is missing, truncated or "
            f"corrupt): {type(e).__name__}: {e}"
        ) from e
    _restore(pieces, saved_main, request, fsdp, opt, optim_keys)
    if same_world:
        if f"rng/{rank}/torch" in request:
            torch.set_rng_state(request[f"rng/{rank}/torch"])
        if f"rng/{rank}/cuda" in request and torch.cuda.is_available():
            torch.cuda.set_rng_state(request[f"rng/{rank}/cuda"])
    fsdp.refresh_model_weights()  # MXFP8 planes re-derived from the loaded main weights
    return ResumeState(int(meta["step"]), DataPosition.from_dict(meta["data_position"]), meta)


def _restore(pieces, saved_main, request, fsdp, opt, optim_keys) -> None:
    for g in opt.groups:
        state = opt.optimizer.state.setdefault(g.main, {})
        for key in optim_keys:
            state.setdefault(key, torch.zeros_like(g.main))
        for k, v in request.items():
            if k.startswith("optim_scalar/") and k.endswith("/" + g.label):
                state[k.split("/")[1]] = v  # step counts stay on the CPU, as torch.optim keeps them
    for pc in pieces:
        n = pc.hi - pc.lo
        for key, start, length in _overlaps(saved_main, pc.name, pc.offset, n):
            a, b = max(start, pc.offset), min(start + length, pc.offset + n)
            dst = slice(pc.lo + a - pc.offset, pc.lo + b - pc.offset)
            src = slice(a - start, b - start)
            with torch.no_grad():
                pc.group.main[dst].copy_(request[f"main/{key}"][src])
                if pc.group not in opt.groups:  # a frozen group has no optimizer state
                    continue
                for state in optim_keys:
                    t = opt.optimizer.state[pc.group.main][state]
                    t[dst].copy_(request[f"optim/{state}/{key}"][src])
