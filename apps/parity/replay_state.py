"""Where a replay starts (``apps.parity.replay``): the Torch FSDP model and optimizer, and the
same state as the Flax twin holds it.

- ``ReplaySetup``: the model, formats, optimizer and run length of a replay;
- ``setup_from_checkpoint(path, ...)``: the setup a checkpoint of ``mxfp8-train --save-dir``
  implies (its config with the saved vocabulary, recipe, activations, learning rate and weight
  decay);
- ``build_torch(setup)``: ``fully_shard`` + ``FSDPOptimizer(torch.optim.AdamW, foreach=False)``
  started from the seed's Flax checkpoint or loaded from the training checkpoint (main weights,
  AdamW moments and step count: ``torch_side.fsdp.sharded_state.load_parts``, a collective; the step
  count through ``_ScalarsOfAnyGroups``, since the twin's groups need not be the run's);
- ``full_moments(opt)``: the AdamW moments of every parameter at full shape (rank 0; a
  collective), which with ``FSDPModel.full_state_dict()`` is the Flax twin's starting state.

The twin's formats: MXFP8 linears (or the high-precision control) and fp32 everything else
(``MixedPrecisionPolicy()``), whatever formats the training run used for its other weights: the
Flax twin holds fp32 parameters. So a ``--weights bf16`` run replays as the high-precision
control on fp32 weights, from its fp32 main weights and moments (its bf16 copies are not
modelled). The learning rate is the job's constant ``lr``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from apps.parity.flax_adamw import AdamWConfig, Sqrt
from apps.parity.flax_run import init_flax_params
from apps.parity.torch_run import load_flax_checkpoint, shard_gpt
from apps.training.job import RECIPES, Weights
from common.model_config import PRESETS, GPTConfig
from common.modes import Activations, Compute, LinearMode
from models.flax_gpt import flat_params
from models.torch_gpt import TorchGPT
from torch_side import FSDPModel, FSDPOptimizer, ShardingStrategy
from torch_side.checkpoint.sharded_files import META, CheckpointError, ShardedReader, read_json
from torch_side.comm.collectives import gather_objects
from torch_side.fsdp.sharded_state import OptimScalarKey, key_text, load_parts, parse_key

__all__ = ["ReplaySetup", "TorchSide", "build_torch", "full_moments", "setup_from_checkpoint"]

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class ReplaySetup:
    cfg: GPTConfig
    steps: int = 5
    mode: LinearMode = LinearMode.MXFP8
    activations: Activations = Activations.FP32
    compute: Compute = Compute.UNIT
    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
    adamw: AdamWConfig = AdamWConfig()
    flax_adamw: AdamWConfig | None = None  # None: the same as Torch's (else a deliberate change)
    sqrt: Sqrt = Sqrt.TORCH
    seed: int = 0  # the fresh start's parameters; the batches use seed + 1 + step
    batch_size: int = 2  # sequences per step, the global batch (split across the ranks)
    seq_len: int = 32
    checkpoint: str | None = None  # a step directory of mxfp8-train --save-dir

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"ReplaySetup.steps={self.steps!r}: replay at least one step "
                             f"(an integer >= 1)")
        for f, parse in (("mode", LinearMode.parse), ("activations", Activations.parse),
                         ("compute", Compute.parse), ("strategy", ShardingStrategy.parse),
                         ("sqrt", Sqrt)):
            object.__setattr__(self, f, parse(getattr(self, f)))
        if not 1 <= self.seq_len <= self.cfg.max_seq_len or self.batch_size < 1:
            raise ValueError(
                f"ReplaySetup: need batch_size >= 1 and 1 <= seq_len <= max_seq_len="
                f"{self.cfg.max_seq_len}, got batch_size={self.batch_size}, "
                f"seq_len={self.seq_len}")

    @property
    def flax_hp(self) -> AdamWConfig:
        return self.adamw if self.flax_adamw is None else self.flax_adamw


def _step_dir(path: str | os.PathLike) -> Path:
    from apps.training.checkpoint import resolve  # the training app's reading of --resume

    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"replay --from-checkpoint {p}: no such directory; pass the --save-dir of an "
            f"mxfp8-train run (its latest checkpoint) or one of its step_* directories")
    return resolve(p)


def _number(value: object, *, minimum: float, strict: bool) -> float:
    """A finite JSON number above (``strict``) or at least ``minimum``, as float."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(value)
    if value < minimum or (strict and value == minimum):
        raise ValueError(value)
    return float(value)


def _vocab(shape: object) -> int:
    """The vocabulary of ``params['wte.weight']``, a [vocab, n_embd] shape."""
    if not (isinstance(shape, list) and len(shape) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
        raise ValueError(shape)
    return shape[0]


# job field -> (how it is read, what a checkpoint of mxfp8-train holds there)
_JOB_FIELDS: dict[str, tuple[Callable[[Any], object], str]] = {
    "config": (lambda v: PRESETS[v], f"one of {list(PRESETS)}"),
    "weights": (lambda v: RECIPES[Weights(v)].linear_mode,
                f"one of {[w.value for w in Weights]}"),
    "activations": (Activations.parse, f"one of {[a.value for a in Activations]}"),
    "lr": (lambda v: _number(v, minimum=0.0, strict=True), "a finite number > 0"),
    "weight_decay": (lambda v: _number(v, minimum=0.0, strict=False), "a finite number >= 0"),
}


def _job_values(meta_path: Path, job: dict, params: dict) -> dict:
    """The job fields a replay reads, checked: a ``CheckpointError`` names the field, what it
    holds and what was expected (an edited ``meta.json`` raised a bare KeyError)."""
    out = {}
    for name, (read, expected) in _JOB_FIELDS.items():
        value = job.get(name, 0.0 if name == "weight_decay" else None)  # older jobs had no wd
        try:
            out[name] = read(value)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{meta_path}: job field {name!r} holds {str(value)[:80]}, expected {expected}; "
                f"the file was edited or is not mxfp8-train's: restore it, or replay another "
                f"step_* directory") from None
    try:
        out["vocab"] = _vocab(params.get("wte.weight"))
    except ValueError:
        raise CheckpointError(
            f"{meta_path}: params['wte.weight'] holds {str(params.get('wte.weight'))[:80]}, "
            f"expected the embedding's shape [vocab, n_embd]; restore the file") from None
    return out


def setup_from_checkpoint(path: str | os.PathLike, **overrides: Any) -> ReplaySetup:
    """The replay of a training checkpoint: its model and AdamW hyperparameters; ``overrides``
    (steps, sqrt, batch_size, seq_len, compute, strategy, flax_adamw, seed) set the rest."""
    step_dir = _step_dir(path)
    meta = read_json(step_dir / META, "checkpoint metadata")
    job, params = meta.get("job"), meta.get("params")
    if not isinstance(job, dict) or not isinstance(params, dict) or "wte.weight" not in params:
        raise CheckpointError(f"{step_dir / META}: no 'job' or 'params' of a GPT; not a "
                              f"checkpoint of mxfp8-train")
    if meta.get("optimizer") != "AdamW":
        raise CheckpointError(f"{step_dir / META}: optimizer {meta.get('optimizer')!r}; the "
                              f"replay's Flax twin runs AdamW only")
    v = _job_values(step_dir / META, job, params)
    fields = dict(cfg=dataclasses.replace(v["config"], vocab_size=v["vocab"]), mode=v["weights"],
                  activations=v["activations"], checkpoint=str(step_dir),
                  adamw=AdamWConfig(lr=v["lr"], weight_decay=v["weight_decay"]))
    return ReplaySetup(**{**fields, **overrides})


class _NotRestored:
    """A training checkpoint's other per-rank entries (its RNG states): declared, so that the
    reader accepts the files, and left alone (the replay draws no random numbers)."""

    def __init__(self):
        from apps.training.checkpoint import RNG_SCHEMA

        self.schema = RNG_SCHEMA

    def state_entries(self) -> dict:
        return {}

    def state_fields(self) -> dict:
        return {}

    def read_state(self, reader):
        return lambda: None


class _ScalarsOfAnyGroups:
    """A checkpoint reader (``ShardedReader``'s ``path``, ``meta``, ``entries``, ``read``) that
    offers the 0-d optimizer states under the replay's own group labels.

    The 0-d states (AdamW's step count) are saved per parameter group, ``optim_scalar/<state>/
    <group label>``, and a label names its group's format: a ``--weights bf16`` run (or MXFP8
    with bf16 activations) saved ``<root>/bf16/dp``, while the replay's Torch twin holds every
    weight that is not an MXFP8 linear weight in fp32 (module note). The per-element states are
    keyed by parameter and read as saved, whatever the grouping; a 0-d state must hold one value
    in every saved group (it does: one optimizer step count), which every group of the twin
    then takes."""

    def __init__(self, reader: ShardedReader, labels: list[str]):
        self.path, self.meta, self._reader = reader.path, reader.meta, reader
        self.entries, self._source = {}, {}
        saved: dict[str, list[str]] = {}
        for text, entry in reader.entries.items():
            key = parse_key(text, [OptimScalarKey])
            if key is None:
                self.entries[text] = entry
            else:
                saved.setdefault(key.state, []).append(text)
        for state, keys in saved.items():
            values = {reader.read(k).item() for k in keys}
            if len(values) != 1:
                raise CheckpointError(
                    f"{reader.path}: the saved groups hold different {state!r} values "
                    f"{sorted(values)}; the replay's groups are not the run's and take one value")
            for label in labels:
                alias = key_text(OptimScalarKey(state, label))
                self.entries[alias], self._source[alias] = reader.entries[keys[0]], keys[0]

    def read(self, key: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        return self._reader.read(self._source.get(key, key), start, count)


class _ReplayOptimizerState:
    """The optimizer's checkpoint part, read through ``_ScalarsOfAnyGroups`` (load only)."""

    def __init__(self, opt: FSDPOptimizer):
        self._part, self._labels = opt.sharded_state(), [g.label for g in opt.groups]
        self.schema = self._part.schema

    def state_entries(self) -> dict:
        return {}

    def state_fields(self) -> dict:
        return {}

    def read_state(self, reader):
        return self._part.read_state(_ScalarsOfAnyGroups(reader, self._labels))


class TorchSide(NamedTuple):
    fsdp: FSDPModel
    opt: FSDPOptimizer


def build_torch(setup: ReplaySetup, device: str = "cpu") -> TorchSide:
    """COLLECTIVE: the Torch FSDP model and optimizer at the replay's starting state."""
    model = TorchGPT(setup.cfg, setup.mode, seed=setup.seed + 1, device=device,
                     activations=setup.activations, compute=setup.compute)
    fsdp = shard_gpt(model, setup.strategy)  # the default policy: fp32 non-MXFP8 weights
    opt = FSDPOptimizer(fsdp, torch.optim.AdamW, foreach=False, **setup.adamw.torch_kwargs())
    if setup.checkpoint is None:
        flat = {n: np.array(a) for n, a in flat_params(init_flax_params(setup.cfg,
                                                                           setup.seed)).items()}
        load_flax_checkpoint(fsdp, flat)
    else:
        load_parts(setup.checkpoint,
                   [fsdp.sharded_state(), _ReplayOptimizerState(opt), _NotRestored()])
    return TorchSide(fsdp, opt)


def optimizer_step_count(opt: FSDPOptimizer) -> int:
    """Completed AdamW steps (0 before the first); the same in every group."""
    counts = {int(opt.optimizer.state.get(g.main, {}).get("step", torch.zeros(())).item())
              for g in opt.groups}
    if len(counts) != 1:
        raise CheckpointError(f"the optimizer's groups have different step counts {counts}; "
                              f"the checkpoint is inconsistent")
    return counts.pop()


def full_moments(opt: FSDPOptimizer) -> dict[str, dict[str, np.ndarray]] | None:
    """COLLECTIVE: {"exp_avg": {name: full fp32 array}, "exp_avg_sq": ...} on rank 0 (None on
    the others); zeros before the first step."""
    pieces = []
    for g in opt.groups:
        state = opt.optimizer.state.get(g.main, {})
        for p in g.main_pieces():
            slot = g.slots[p.slot_index]
            for s in MOMENTS:
                value = state.get(s)
                chunk = (np.zeros(p.numel, np.float32) if value is None else
                         value[p.shard_offset:p.shard_offset + p.numel].detach().cpu().numpy())
                pieces.append((s, slot.name, tuple(slot.shape), p.param_offset, chunk.copy()))
    gathered = gather_objects(pieces, "the optimizer moments' gather")
    if gathered is None:
        return None
    out: dict[str, dict[str, np.ndarray]] = {s: {} for s in MOMENTS}
    for rank_pieces in gathered:
        for s, name, shape, offset, chunk in rank_pieces:
            full = out[s].setdefault(name, np.zeros(int(np.prod(shape)), np.float32))
            full[offset:offset + chunk.size] = chunk
    return {s: {n: a.reshape(_shape(opt, n)) for n, a in d.items()} for s, d in out.items()}


def _shape(opt: FSDPOptimizer, name: str) -> tuple[int, ...]:
    for g in opt.groups:
        for slot in g.slots:
            if slot.name == name:
                return tuple(slot.shape)
    raise KeyError(name)
