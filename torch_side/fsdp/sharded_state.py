"""Sharded state of ``FSDPModel`` and ``FSDPOptimizer``, saved and loaded by FSDP itself.

A checkpoint is a list of **parts** (``Stateful``), each saving and loading its own state: the
model's main weights (``ModelState``, ``FSDPModel.sharded_state()``), the optimizer's state
(``OptimizerState``, ``FSDPOptimizer.sharded_state()``), and whatever an application adds (data
position, RNG, an LR schedule). ``save_parts`` writes them into one step directory of
``torch_side.checkpoint.sharded_files`` (no pickle, checksums, a run id); ``load_parts`` reads them
back. (Not ``torch.distributed.checkpoint``: its ``.metadata`` is a pickle, never loaded here.)

Keys are structured (``MainKey``, ``OptimKey``, ``OptimScalarKey``, an application's own
``NamedTuple`` with a ``PREFIX``), formatted in one place (``key_text``:
``"<PREFIX>/<field>/<field>..."``) and parsed back in one (``parse_key``). What the parts write:

- ``main/<param>/<offset>`` (fp32): the **main weight** of one piece of parameter ``param``
  that this rank holds, ``offset`` its first element in the parameter's own flat order;
- ``optim/<state>/<param>/<offset>`` (fp32): an optimizer state with one value per element
  (AdamW ``exp_avg``, ``exp_avg_sq``) over the same piece;
- ``optim_scalar/<state>/<group label>`` (fp32, written by rank 0: it is replicated): a 0-d
  optimizer state of one group (AdamW ``step``);
- ``meta.json`` fields: ``params`` (every parameter's name and shape) and ``optimizer`` (the
  inner optimizer's class name), checked on load.

A replicated main weight (``no_shard``) is written once, by rank 0 of its group. Offsets within
a parameter do not depend on the world size, so a rank of any world size reads only the byte
ranges of the saved pieces that overlap the pieces it holds now.

Loading is two-phase, so a refusal anywhere changes nothing anywhere: ``read_state(reader)``
reads and verifies everything this rank needs (local, no collective) and returns the restore;
``load_parts`` runs the restores only after every rank read without a refusal (``agree``). The
model's restore copies the main weights, then re-derives the MXFP8 planes with the distributed
quantization (``FSDPModel.refresh_model_weights``, a collective): byte-identical to the planes of
the run that saved at the same world size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol, get_type_hints

import torch
import torch.distributed as dist

from torch_side.checkpoint.sharded_files import (
    META,
    CheckpointError,
    Schema,
    ShardedReader,
    agree,
    write_step,
)
from torch_side.fsdp.param_group import GROUP_LABEL, ParamGroup

__all__ = [
    "MODEL_SCHEMA",
    "OPTIMIZER_SCHEMA",
    "MainKey",
    "ModelState",
    "OptimKey",
    "OptimScalarKey",
    "OptimizerState",
    "Pending",
    "Restore",
    "Stateful",
    "key_text",
    "load_parts",
    "parse_key",
    "read_parts",
    "save_parts",
]

Restore = Callable[[], None]


class Stateful(Protocol):
    """One part of a sharded checkpoint. ``schema``: the key patterns it writes -> dtype."""

    @property
    def schema(self) -> Schema: ...

    def state_entries(self) -> dict[str, torch.Tensor]:
        """This rank's tensors to save, keyed by ``key_text`` of structured keys."""
        ...

    def state_fields(self) -> dict[str, Any]:
        """JSON-safe fields for ``meta.json`` (small state, e.g. a data position; may be {})."""
        ...

    def read_state(self, reader: ShardedReader) -> Restore:
        """Read and verify what this rank needs (no collective, nothing changed; refusals raise
        ``CheckpointError``); returns what restores it, run on every rank once all have read."""
        ...


# ----------------------------------------------------------------------------------- keys


# A key is a NamedTuple of its fields, subclassed to add its ``PREFIX`` (a NamedTuple body holds
# fields only): ``key_text`` and ``parse_key`` read both.


class Key(Protocol):
    """A structured checkpoint key (``MainKey``, ``OptimKey``, ...)."""

    PREFIX: ClassVar[str]  # (and NamedTuple's ``_fields``)

    def __iter__(self) -> Iterator[Any]: ...


class _MainFields(NamedTuple):
    param: str  # qualified parameter name
    offset: int  # first element, in the parameter's own flat (row-major) order


class MainKey(_MainFields):
    """A piece of a parameter's main weight."""

    __slots__ = ()
    PREFIX: ClassVar[str] = "main"


class _OptimFields(NamedTuple):
    state: str  # e.g. "exp_avg"
    param: str
    offset: int


class OptimKey(_OptimFields):
    """A piece of a per-element optimizer state (same elements as the ``MainKey`` piece)."""

    __slots__ = ()
    PREFIX: ClassVar[str] = "optim"


class _OptimScalarFields(NamedTuple):
    state: str
    group: str  # ParamGroup.label (may hold "/": the last field takes the rest)


class OptimScalarKey(_OptimScalarFields):
    """A 0-d optimizer state of one parameter group (e.g. AdamW's "step")."""

    __slots__ = ()
    PREFIX: ClassVar[str] = "optim_scalar"


_NAME = r"[A-Za-z0-9_.]+"  # parameter and state names (module paths)
MODEL_SCHEMA: dict[str, torch.dtype] = {rf"main/{_NAME}/\d+": torch.float32}
OPTIMIZER_SCHEMA: dict[str, torch.dtype] = {
    rf"optim/{_NAME}/{_NAME}/\d+": torch.float32,
    rf"optim_scalar/{_NAME}/{GROUP_LABEL}": torch.float32,  # units of several modules too
}


def key_text(key: Key) -> str:
    """The one formatting of a structured key: ``"<PREFIX>/<field>/<field>..."``."""
    return "/".join([type(key).PREFIX, *map(str, key)])


def parse_key(text: str, kinds: Iterable[type[Key]]) -> Any:
    """The key of ``kinds`` that ``key_text`` formats to ``text``, or None when none does."""
    head, _, rest = text.partition("/")
    for kind in kinds:
        if kind.PREFIX != head:
            continue
        fields: tuple[str, ...] = kind._fields  # type: ignore[attr-defined]  # a NamedTuple
        values = rest.split("/", len(fields) - 1)
        if len(values) != len(fields):
            return None
        hints = get_type_hints(kind)
        ints = [hints[f] is int for f in fields]
        if any(i and not v.isdigit() for i, v in zip(ints, values, strict=True)):
            return None
        return kind(*(int(v) if i else v for i, v in zip(ints, values, strict=True)))
    return None


# ------------------------------------------------------------------- the pieces a rank holds


class _Piece(NamedTuple):
    """A piece of one parameter held in a group's main weight."""

    param: str
    offset: int  # in the parameter's flat order
    group: ParamGroup
    lo: int  # slice of the group's main / optimizer tensors
    hi: int
    saved_here: bool  # False for a replicated copy another rank writes


def _pieces(groups: Sequence[ParamGroup]) -> list[_Piece]:
    out = []
    for g in groups:
        # no_shard: every rank of the group holds every piece; only its rank 0 writes them.
        # HSDP: the replicas hold the same pieces; replica 0 writes them
        writes = ((g.facts.main_weights_sharded or g.comm.rank == 0)
                  and (g.replicate is None or g.replicate.rank == 0))
        for p in g.main_pieces():
            name = g.slots[p.slot_index].name
            out.append(_Piece(name, p.param_offset, g, p.shard_offset,
                              p.shard_offset + p.numel, writes))
    return out


def _param_shapes(groups: Sequence[ParamGroup]) -> dict[str, list[int]]:
    return {s.name: list(s.shape) for g in groups for s in g.slots}


class _SavedPiece(NamedTuple):
    offset: int  # in the parameter's flat order
    numel: int
    key: str  # its key text in the checkpoint


def _saved(reader: ShardedReader, kind: type, state: str | None,
           shapes: Mapping) -> dict[str, list[_SavedPiece]]:
    """parameter -> its saved pieces of ``kind`` (of optimizer state ``state``), each checked to
    lie inside a parameter of this model."""
    pieces: dict[str, list[_SavedPiece]] = {}
    for text, e in reader.entries.items():
        k = parse_key(text, [kind])
        if k is None or (state is not None and k.state != state):
            continue
        shape = shapes.get(k.param)
        if shape is None or k.offset + e.numel > math.prod(shape) or len(e.shape) != 1:
            raise CheckpointError(
                f"{reader.path / e.file}: {text!r} ({e.numel} elements) is not a piece of a "
                f"parameter of this model (its shape: {shape})")
        pieces.setdefault(k.param, []).append(_SavedPiece(k.offset, e.numel, text))
    return pieces


class _Overlap(NamedTuple):
    group: ParamGroup
    dst: slice  # in the group's main / optimizer tensors
    value: torch.Tensor  # the saved elements that land there


def _read_overlaps(reader: ShardedReader, saved: Mapping[str, list[_SavedPiece]],
                   pieces: Sequence[_Piece], what: str) -> list[_Overlap]:
    """Every saved element landing in ``pieces``: only those byte ranges are read."""
    out = []
    for pc in pieces:
        n, covered = pc.hi - pc.lo, 0
        for start, length, key in saved.get(pc.param, ()):
            a, b = max(start, pc.offset), min(start + length, pc.offset + n)
            if a >= b:
                continue
            covered += b - a
            value = reader.read(key, a - start, b - a)
            out.append(_Overlap(pc.group, slice(pc.lo + a - pc.offset, pc.lo + b - pc.offset),
                                value))
        if covered != n:
            raise CheckpointError(
                f"{reader.path}: the saved {what} cover {covered} of the {n} elements of "
                f"{pc.param!r} at offset {pc.offset} this rank needs; the checkpoint is "
                f"incomplete")
    return out


# ------------------------------------------------------------------------------ the model


class _Idle(Protocol):
    def require_idle(self, what: str) -> None: ...


class _Wrapped(Protocol):
    """What ``ModelState`` reads of an ``FSDPModel`` (not imported: it imports this module)."""

    @property
    def param_groups(self) -> Sequence[ParamGroup]: ...

    @property
    def state(self) -> _Idle: ...

    def refresh_model_weights(self) -> None: ...


class ModelState:
    """``FSDPModel``'s part of a checkpoint: the main weights (``FSDPModel.sharded_state()``)."""

    schema = MODEL_SCHEMA

    def __init__(self, model: _Wrapped):
        self.model = model

    def state_entries(self) -> dict[str, torch.Tensor]:
        return {key_text(MainKey(pc.param, pc.offset)): pc.group.main[pc.lo:pc.hi]
                for pc in _pieces(self.model.param_groups) if pc.saved_here}

    def state_fields(self) -> dict[str, Any]:
        return {"params": _param_shapes(self.model.param_groups)}

    def read_state(self, reader: ShardedReader) -> Restore:
        self.model.state.require_idle("loading sharded state")  # before anything is read
        groups = self.model.param_groups
        ours, saved_shapes = _param_shapes(groups), reader.meta.get("params")
        if saved_shapes != ours:
            theirs = saved_shapes if isinstance(saved_shapes, dict) else {}
            diff = sorted(n for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n))
            raise CheckpointError(
                f"{reader.path / META}: parameters differ from this model's (first: "
                f"{diff[:3]}); the checkpoint belongs to another model")
        saved = _saved(reader, MainKey, None, ours)
        overlaps = _read_overlaps(reader, saved, _pieces(groups), "main weights")

        def restore() -> None:
            with torch.no_grad():
                for o in overlaps:
                    o.group.main[o.dst].copy_(o.value)
            self.model.refresh_model_weights()  # MXFP8 planes re-derived from the main weights

        return restore


# -------------------------------------------------------------------------- the optimizer


class OptimizerState:
    """``FSDPOptimizer``'s part of a checkpoint: the inner optimizer's state over the main-weight
    shards (``FSDPOptimizer.sharded_state()``): per-element states by piece, 0-d ones per group."""

    schema = OPTIMIZER_SCHEMA

    def __init__(self, groups: Sequence[ParamGroup], optimizer: torch.optim.Optimizer):
        self.groups, self.optimizer = list(groups), optimizer

    def _states(self, group: ParamGroup) -> dict[str, Any]:
        return self.optimizer.state.get(group.main, {})

    def state_entries(self) -> dict[str, torch.Tensor]:
        out = {}
        for pc in _pieces(self.groups):
            for name, value in self._states(pc.group).items():
                if pc.saved_here and torch.is_tensor(value) and (
                        value.shape == pc.group.main.shape):
                    out[key_text(OptimKey(name, pc.param, pc.offset))] = value[pc.lo:pc.hi]
        if dist.get_rank() == 0:
            for g in self.groups:
                for name, value in self._states(g).items():
                    if torch.is_tensor(value) and value.dim() == 0:
                        out[key_text(OptimScalarKey(name, g.label))] = value.detach().float()
        return out

    def state_fields(self) -> dict[str, Any]:
        return {"optimizer": type(self.optimizer).__name__}

    def read_state(self, reader: ShardedReader) -> Restore:
        ours, theirs = type(self.optimizer).__name__, reader.meta.get("optimizer")
        if theirs != ours:
            raise CheckpointError(
                f"{reader.path / META}: the optimizer state was saved from {theirs!r}, this "
                f"optimizer is {ours!r}; resume with the same optimizer")
        shapes = _param_shapes(self.groups)
        keys = [parse_key(k, [OptimKey, OptimScalarKey]) for k in reader.entries]
        names = sorted({k.state for k in keys if isinstance(k, OptimKey)})
        pieces = _pieces(self.groups)
        per_element = {s: _read_overlaps(reader, _saved(reader, OptimKey, s, shapes), pieces,
                                         f"optimizer states {s!r}") for s in names}
        labels = {g.label: g for g in self.groups}
        scalars = []
        for k in keys:
            if isinstance(k, OptimScalarKey):
                if k.group not in labels:
                    raise CheckpointError(f"{reader.path}: {key_text(k)!r} names no parameter "
                                          f"group of this optimizer ({sorted(labels)})")
                scalars.append((labels[k.group], k.state, reader.read(key_text(k))))

        def restore() -> None:
            for g in self.groups:
                state = self.optimizer.state.setdefault(g.main, {})
                for s in names:
                    state.setdefault(s, torch.zeros_like(g.main))
            for g, s, value in scalars:
                self.optimizer.state[g.main][s] = _placed_scalar(self.optimizer, g.main, value)
            with torch.no_grad():
                for s, overlaps in per_element.items():
                    for o in overlaps:
                        self.optimizer.state[o.group.main][s][o.dst].copy_(o.value)

        return restore


def _placed_scalar(optimizer: torch.optim.Optimizer, main: torch.Tensor,
                   value: torch.Tensor) -> torch.Tensor:
    """A 0-d state (AdamW's ``step``) where ``torch.optim`` keeps it: on the CPU, except for a
    fused or capturable optimizer, whose kernels read it on the parameter's device (as
    ``Optimizer.load_state_dict`` places it; a CPU step fails the fused CUDA AdamW)."""
    group = next(g for g in optimizer.param_groups if any(p is main for p in g["params"]))
    if group.get("fused") or group.get("capturable"):
        return value.to(device=main.device, dtype=torch.float32)
    return value.clone()


# ------------------------------------------------------------------------ save and load parts


def _schema(parts: Sequence[Stateful]) -> dict[str, torch.dtype]:
    return {k: v for p in parts for k, v in p.schema.items()}


def save_parts(path: str | Path, parts: Sequence[Stateful], *, run_id: str, step: int,
               fields: Mapping[str, Any] | None = None,
               group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """COLLECTIVE: write every part's entries and fields (and ``fields``) as one step directory
    (``sharded_files.write_step``: refused on every rank, nothing written, when a value is not
    finite). Returns the meta."""
    tensors: dict[str, torch.Tensor] = {}
    meta_fields = dict(fields or {})
    for part in parts:
        for target, new, what in ((tensors, part.state_entries(), "key"),
                                  (meta_fields, part.state_fields(), "field")):
            if clash := set(target) & set(new):
                raise CheckpointError(f"save_parts: {type(part).__name__} writes the {what}s "
                                      f"{sorted(clash)[:3]}, which an earlier part wrote too")
            target.update(new)
    return write_step(path, tensors, run_id=run_id, step=step, schema=_schema(parts),
                      fields=meta_fields, group=group)


class Pending(NamedTuple):
    """What ``read_parts`` read: the verified meta and every part's restore."""

    meta: dict[str, Any]
    restores: list[Restore]

    def apply(self) -> None:
        for restore in self.restores:
            restore()


def read_parts(path: str | Path, parts: Sequence[Stateful],
               check_meta: Callable[[dict[str, Any]], None] | None = None) -> Pending:
    """Local (no collective): open ``path`` verified with the parts' schemas, run
    ``check_meta(meta)``, and read every part; raises ``CheckpointError``, changing nothing."""
    with ShardedReader(path, _schema(parts)) as reader:
        if check_meta is not None:
            check_meta(reader.meta)
        return Pending(reader.meta, [p.read_state(reader) for p in parts])


def load_parts(path: str | Path, parts: Sequence[Stateful],
               check_meta: Callable[[dict[str, Any]], None] | None = None,
               group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """COLLECTIVE: ``read_parts`` on every rank; any rank's refusal is raised on every rank with
    nothing restored; else every part is restored, in order. Returns the meta."""
    problem, pending = None, None
    try:
        pending = read_parts(path, parts, check_meta)
    except (CheckpointError, TypeError, ValueError) as e:
        problem = str(e)
    agree(problem, group=group)
    assert pending is not None
    pending.apply()
    return pending.meta
