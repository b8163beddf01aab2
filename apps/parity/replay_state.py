"""Where a replay starts (``apps.parity.replay``): the Torch FSDP model and optimizer, and the
same state as the Flax twin holds it.

- ``ReplaySetup``: the model, formats, optimizer and run length of a replay;
- ``setup_from_checkpoint(path, ...)``: the setup a checkpoint of ``mxfp8-train --save-dir``
  implies (its config with the saved vocabulary, recipe, activations, learning rate and weight
  decay);
- ``build_torch(setup)``: ``fully_shard`` + ``FSDPOptimizer(torch.optim.AdamW, foreach=False)``
  started from the seed's Flax checkpoint or loaded from the training checkpoint (main weights,
  AdamW moments and step count: ``torch_side.sharded_state.load_parts``, a collective);
- ``full_moments(opt)``: the AdamW moments of every parameter at full shape (rank 0; a
  collective), which with ``FSDPModel.full_state_dict()`` is the Flax twin's starting state.

The twin's formats: MXFP8 linears (or the high-precision control) and fp32 everything else
(``MixedPrecisionPolicy()``), whatever formats the training run used for its other weights: the
Flax twin holds fp32 parameters. The learning rate is the job's constant ``lr``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from apps.parity.flax_adamw import AdamWConfig, Sqrt
from apps.parity.flax_run import init_flax_params
from apps.parity.torch_run import load_flax_checkpoint, shard_gpt
from common.model_config import PRESETS, GPTConfig
from common.modes import Activations, Compute, LinearMode
from jax_side.models import flat_params
from torch_side import FSDPModel, FSDPOptimizer, ShardingStrategy
from torch_side.models import TorchGPT
from torch_side.sharded_files import META, CheckpointError, read_json
from torch_side.sharded_state import load_parts

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


def setup_from_checkpoint(path: str | os.PathLike, **overrides) -> ReplaySetup:
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
    from apps.training.job import RECIPES, Weights

    cfg = dataclasses.replace(PRESETS[job["config"]], vocab_size=int(params["wte.weight"][0]))
    hp = AdamWConfig(lr=float(job["lr"]), weight_decay=float(job.get("weight_decay", 0.0)))
    fields = dict(cfg=cfg, mode=RECIPES[Weights(job["weights"])].linear_mode,
                  activations=job["activations"], adamw=hp, checkpoint=str(step_dir))
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
        load_parts(setup.checkpoint, [fsdp.sharded_state(), opt.sharded_state(), _NotRestored()])
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
            slot = g.layout.slots[p.slot_index]
            for s in MOMENTS:
                value = state.get(s)
                chunk = (np.zeros(p.numel, np.float32) if value is None else
                         value[p.shard_offset:p.shard_offset + p.numel].detach().cpu().numpy())
                pieces.append((s, slot.name, tuple(slot.shape), p.param_offset, chunk.copy()))
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces, gathered, dst=0)
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
        for slot in g.layout.slots:
            if slot.name == name:
                return tuple(slot.shape)
    raise KeyError(name)
