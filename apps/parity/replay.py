"""Multi-step cross-framework replay: Torch FSDP and the Flax twin train N steps side by side.

``replay(setup)`` (``python -m apps.parity --steps N [--from-checkpoint DIR]``) starts both
stacks from the same state -- the seed's Flax checkpoint, or a checkpoint of ``mxfp8-train
--save-dir`` (main weights, AdamW moments and step count; ``replay_state``) -- and runs, per step
on the same batch:

- Torch: ``torch_side.fully_shard`` + ``FSDPOptimizer(torch.optim.AdamW, foreach=False)``, the
  batch split across the ranks; forward + backward of the mean token loss, the optimizer step,
  the MXFP8 planes re-derived by FSDP's distributed quantization;
- Flax: ``FlaxGPT`` (``jax.value_and_grad`` of the mean token loss over the whole batch, one
  jitted program), ``flax_adamw`` (Torch's AdamW arithmetic, op for op), the planes by
  ``jax_side.linear.quantize_weight`` of the new main weights;

and compares byte for byte, in this order: the loss, every parameter's gradient, every main
weight after the update, both AdamW moments, every MXFP8 weight's planes and scales. The report
(``ReplayReport``) names the first step and tensor where the stacks diverge, or states that N
steps were bit-identical. After a divergence both keep running on their own state (the later
steps show how it spreads).

What equality to expect. World size 1, ``Compute.UNIT``: every step bit-identical (the unit
programs run the Flax twin's functions; AdamW is the same arithmetic; ``Sqrt.TORCH``).
``Compute.OP``: the loss differs at step 1 (LayerNorm, attention, GELU and the loss are Torch
kernels there). World size W > 1: each rank runs B / W sequences, and FSDP's gradient is the mean
of the ranks' mean-loss gradients, reduced in fp32 in another order than the single program's
sum over the batch: gradients (and the loss, averaged over ranks) differ by fp32 rounding from
step 1, so the report there is the size of the differences per step, not identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist

from apps.parity.bytes_compare import (
    Kind,
    Mismatch,
    compare_named,
    flax_loss_and_grads,
    flax_plane_bytes,
    torch_plane_bytes,
)
from apps.parity.flax_adamw import AdamWState, adamw_step
from apps.parity.flax_run import Batch, make_batch
from apps.parity.replay_state import (
    ReplaySetup,
    TorchSide,
    build_torch,
    full_moments,
    optimizer_step_count,
)
from bridge import jax_work_on
from common.modes import LinearMode
from torch_side.comm.collectives import Collective, all_reduce_on

__all__ = ["FlaxState", "ReplayReport", "StepResult", "replay", "replay_on_rank"]


class StepResult(NamedTuple):
    step: int  # 1-based, counted from the replay's start
    torch_loss: float
    flax_loss: float
    mismatches: tuple[Mismatch, ...]  # in comparison order (module note)

    @property
    def identical(self) -> bool:
        return not self.mismatches


@dataclasses.dataclass(frozen=True)
class ReplayReport:
    setup: ReplaySetup
    world_size: int
    start_step: int  # optimizer steps completed before the replay (0 from a seed)
    steps: tuple[StepResult, ...]

    @property
    def first_divergence(self) -> tuple[StepResult, Mismatch] | None:
        for s in self.steps:
            if s.mismatches:
                return s, s.mismatches[0]
        return None

    def verdict(self) -> str:
        first = self.first_divergence
        n = len(self.steps)
        if first is None:
            return (f"verdict: {n} step(s) bit-identical (loss, every gradient, main weight, "
                    f"AdamW moment and MXFP8 plane)")
        step, m = first
        layer = m.name.rsplit(".", 1)[0] if m.name else "(model output)"
        return (f"verdict: the stacks diverge at step {step.step} (of {n}), layer {layer}, "
                f"{m.describe()}; {len(step.mismatches)} tensor(s) differ in that step")

    def format(self) -> str:
        s = self.setup
        head = [
            f"Cross-framework replay: Torch FSDP ({s.strategy.value}, world size "
            f"{self.world_size}, compute {s.compute.value}) + torch.optim.AdamW vs FlaxGPT + "
            f"its AdamW (sqrt: {s.sqrt.value}), matmul mode {s.mode.value}, activations "
            f"{s.activations.value}",
            f"config: vocab {s.cfg.vocab_size}, layers {s.cfg.n_layer}, d_model "
            f"{s.cfg.d_model} | start: "
            f"{'checkpoint ' + s.checkpoint if s.checkpoint else f'seed {s.seed}'} (optimizer "
            f"step {self.start_step}) | batch ({s.batch_size}, {s.seq_len}) per step | AdamW "
            f"lr {s.adamw.lr:g}, weight decay {s.adamw.weight_decay:g}"
            + ("" if s.flax_adamw is None else f" (Flax side: lr {s.flax_hp.lr:g}, weight "
                                               f"decay {s.flax_hp.weight_decay:g})"),
            "",
            f"{'step':>4} {'torch loss':>12} {'flax loss':>12}  first differing tensor "
            f"(differing tensors)",
        ]
        rows = []
        for r in self.steps:
            first = "identical" if r.identical else (
                f"{r.mismatches[0].describe()} ({len(r.mismatches)})")
            rows.append(f"{r.step:>4} {r.torch_loss:>12.7f} {r.flax_loss:>12.7f}  {first}")
        return "\n".join(head + rows)


class FlaxState(NamedTuple):
    params: dict[str, jax.Array]  # fp32 main weights by Torch name
    adamw: AdamWState


def _mxfp8_names(setup: ReplaySetup) -> list[str]:
    if setup.mode is not LinearMode.MXFP8:
        return []
    return list(setup.cfg.linear_shapes())


def _rank_batch(setup: ReplaySetup, step: int) -> tuple[Batch, list[torch.Tensor]]:
    """The step's global batch and this rank's rows of it."""
    batch = make_batch(setup.cfg, setup.seed + 1 + step, setup.batch_size, setup.seq_len)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = slice(rank * setup.batch_size // world, (rank + 1) * setup.batch_size // world)
    mine = [torch.from_numpy(a[rows]).long() for a in batch]
    return batch, mine


_TorchOut = tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor],
                  dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]


def _torch_step(side: TorchSide, tokens: torch.Tensor, targets: torch.Tensor,
                mxfp8_names: list[str]) -> _TorchOut | None:
    """COLLECTIVE: one training step; returns rank 0's view (loss averaged over the ranks,
    full gradients, main weights, moments, planes) or None on the other ranks."""
    fsdp, opt = side
    fsdp.zero_grad()
    loss = fsdp(tokens, targets)
    loss.backward()
    total = loss.detach().clone()
    all_reduce_on(total, Collective.ALL_REDUCE_SUM, "the replayed step's loss")
    grads = fsdp.full_grads()
    opt.step()
    main = fsdp.full_state_dict()
    moments = full_moments(opt)
    planes = torch_plane_bytes(fsdp, mxfp8_names)
    if moments is None:  # not rank 0
        return None
    return float(total) / dist.get_world_size(), grads, main, moments, planes


def _compare(setup: ReplaySetup, torch_out: _TorchOut, flax_loss: jax.Array,
             flax_grads: dict[str, jax.Array], flax: FlaxState,
             names: list[str]) -> tuple[list[Mismatch], float]:
    loss, grads, main, moments, planes = torch_out
    flax_loss = np.float32(flax_loss)
    out = compare_named(Kind.LOSS, {"": np.float32(loss)}, {"": flax_loss})
    out += compare_named(Kind.GRAD, grads, flax_grads)
    out += compare_named(Kind.MAIN, main, flax.params)
    out += compare_named(Kind.EXP_AVG, moments["exp_avg"], flax.adamw.exp_avg)
    out += compare_named(Kind.EXP_AVG_SQ, moments["exp_avg_sq"], flax.adamw.exp_avg_sq)
    out += compare_named(Kind.PLANES, planes, flax_plane_bytes(flax.params, names))
    return out, float(flax_loss)


def _start_flax(side: TorchSide) -> FlaxState | None:
    """COLLECTIVE: the Flax twin's state, from the Torch side's full state (rank 0)."""
    main = side.fsdp.full_state_dict()
    moments = full_moments(side.opt)
    step = optimizer_step_count(side.opt)
    if moments is None:  # not rank 0
        return None
    as_jax = {k: {n: jnp.asarray(a) for n, a in d.items()} for k, d in moments.items()}
    params = {n: jnp.asarray(t.numpy()) for n, t in main.items()}
    return FlaxState(params, AdamWState(step, as_jax["exp_avg"], as_jax["exp_avg_sq"]))


def replay_on_rank(setup: ReplaySetup, device: str = "cpu",
                   perturb: Callable[[FlaxState], FlaxState] | None = None
                   ) -> ReplayReport | None:
    """COLLECTIVE (every rank of an initialised process group): the replay; rank 0 returns the
    report. ``perturb``: changes the Flax side's starting state (tests of the divergence finder).
    """
    with jax_work_on(device):
        side = build_torch(setup, device)
        flax = _start_flax(side)
        start = optimizer_step_count(side.opt)
        if flax is not None and perturb is not None:
            flax = perturb(flax)
        names = _mxfp8_names(setup)
        value_and_grad = flax_loss_and_grads(setup.cfg, setup.mode, setup.activations)
        results = []
        for k in range(setup.steps):
            batch, (tokens, targets) = _rank_batch(setup, k)
            torch_out = _torch_step(side, tokens.to(device), targets.to(device), names)
            if flax is None or torch_out is None:  # not rank 0 (both are None there)
                continue
            loss, grads = value_and_grad(flax.params, batch.tokens, batch.targets)
            params, adamw = adamw_step(flax.params, grads, flax.adamw, setup.flax_hp,
                                       setup.sqrt)
            flax = FlaxState(params, adamw)
            mismatches, flax_loss = _compare(setup, torch_out, loss, grads, flax, names)
            results.append(StepResult(k + 1, torch_out[0], flax_loss, tuple(mismatches)))
    if flax is None:
        return None
    return ReplayReport(setup, dist.get_world_size(), start, tuple(results))


def replay(setup: ReplaySetup, world_size: int = 1, device: str = "cpu") -> ReplayReport:
    """The replay at ``world_size`` ranks: in this process for 1 (a one-rank gloo group unless a
    process group exists already), else on spawned ranks (``torch_side.launch``)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"replay: world_size={world_size!r}, expected an integer >= 1")
    if world_size > 1:
        from torch_side.launch import run_local_ranks

        return run_local_ranks(replay_on_rank, world_size, (setup, device), device=device)[0]
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(f"replay: world_size=1 inside a process group of "
                             f"{dist.get_world_size()} ranks; call replay_on_rank on each rank")
        return _rank0(replay_on_rank(setup, device))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        return _rank0(replay_on_rank(setup, device))
    finally:
        dist.destroy_process_group()


def _rank0(report: ReplayReport | None) -> ReplayReport:
    assert report is not None  # one rank: rank 0, which returns the report
    return report
