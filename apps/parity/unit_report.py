"""The parity report under unit compute: the Torch GPT's loss, every gradient and (under FSDP) the
gathered MXFP8 planes, byte for byte against the Flax twin.

Under ``Compute.UNIT`` each block's forward and backward, and the head with the loss, are JAX
programs running the Flax twin's own functions (``models.gpt_math``), so the linears'
inputs and outputs never reach Torch (the op report's per-linear hooks have nothing to see), and
the expected result is stronger: bit identity of everything the model returns.

``unit_parity_report`` runs TorchGPT (``compute="unit"``) -- plain at world size 1, under
``torch_side`` FSDP on spawned gloo ranks otherwise, every rank on the same batch as in the op
report (the DP average is then exact for W = 1, 2, 4) -- against ``jax.value_and_grad`` of
``FlaxGPT`` on the same parameters, and states bit-identity or the first differing tensor. Under
FSDP the planes the model multiplied with are also compared with ``quantize_weight`` of the fp32
weights on one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
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
from apps.parity.flax_run import Batch, init_flax_params, make_batch
from apps.parity.report import GradExactness
from apps.parity.torch_run import load_flax_checkpoint, shard_gpt
from bridge import jax_work_on
from common.model_config import GPTConfig
from common.modes import Activations, LinearMode
from models.flax_gpt import flat_params
from models.torch_gpt import TorchGPT, load_flat_params
from torch_side.fsdp.strategy import ShardingStrategy

__all__ = ["UnitParityReport", "unit_parity_report"]


@dataclasses.dataclass(frozen=True)
class UnitParityReport:
    config: GPTConfig
    mode: LinearMode
    activations: Activations
    seed: int
    batch_shape: tuple[int, int]
    world_size: int
    compared: tuple[tuple[Kind, int], ...]  # (kind, how many tensors) in comparison order
    mismatches: tuple[Mismatch, ...]
    torch_loss: float
    flax_loss: float

    @property
    def identical(self) -> bool:
        return not self.mismatches

    def verdict(self) -> str:
        n = sum(c for _, c in self.compared)
        if self.identical:
            return (f"verdict: all {n} compared tensors bit-identical (loss, every gradient"
                    f"{', gathered planes' if self.world_size > 1 else ''})")
        return (f"verdict: {len(self.mismatches)}/{n} compared tensors differ; first: "
                f"{self.mismatches[0].describe()}")

    def format(self) -> str:
        c = self.config
        fsdp = f"FSDP on {self.world_size} ranks" if self.world_size > 1 else "no FSDP"
        lines = [
            f"Cross-framework parity, unit compute: TorchGPT (one JAX program per block and "
            f"direction, {fsdp}) vs FlaxGPT (jax.value_and_grad), matmul mode "
            f"{self.mode.value}, activations {self.activations.value}",
            f"config: vocab {c.vocab_size}, layers {c.n_layer}, heads {c.n_head}, d_model "
            f"{c.d_model}, d_ff {c.d_ff} | seed {self.seed} | batch {self.batch_shape}",
            GradExactness.for_world_size(self.world_size).describe(self.world_size),
            f"loss: torch {self.torch_loss:.9g}, flax {self.flax_loss:.9g}",
            "compared byte for byte: " + ", ".join(f"{n} {k.value}" for k, n in self.compared),
        ]
        lines += [f"  differs: {m.describe()}" for m in self.mismatches]
        return "\n".join(lines)


Master = dict[str, np.ndarray]  # fp32 master weights by Torch name


def _flax_side(cfg: GPTConfig, mode: LinearMode, acts: Activations, master: Master,
               batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    run = flax_loss_and_grads(cfg, mode, acts)
    return run({n: np.asarray(a) for n, a in master.items()}, batch.tokens, batch.targets)


def _build(cfg: GPTConfig, mode: LinearMode, acts: Activations, master: Master, batch: Batch,
           loss: torch.Tensor, grads: Mapping[str, torch.Tensor | None],
           planes: Mapping[str, np.ndarray], world: int) -> UnitParityReport:
    flax_loss, flax_grads = _flax_side(cfg, mode, acts, master, batch)
    mism = compare_named(Kind.LOSS, {"": np.float32(loss)}, {"": np.float32(flax_loss)})
    mism += compare_named(Kind.GRAD, grads, flax_grads)
    compared = [(Kind.LOSS, 1), (Kind.GRAD, len(grads))]
    if planes:
        import jax.numpy as jnp

        mism += compare_named(Kind.PLANES, planes,
                              flax_plane_bytes({n: jnp.asarray(master[n]) for n in planes}, planes))
        compared.append((Kind.PLANES, len(planes)))
    return UnitParityReport(cfg, mode, acts, 0, batch.tokens.shape, world, tuple(compared),
                            tuple(mism), float(loss), float(flax_loss))


def _master(cfg: GPTConfig, seed: int) -> Master:
    return {n: np.array(a) for n, a in flat_params(init_flax_params(cfg, seed)).items()}


def _single(cfg: GPTConfig, seed: int, mode: LinearMode, acts: Activations,
            batch: Batch) -> UnitParityReport:
    master = _master(cfg, seed)
    model = TorchGPT(cfg, mode, activations=acts, compute="unit")
    load_flat_params(model, master)
    tokens, targets = (torch.from_numpy(a).long() for a in batch)
    loss = model(tokens, targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    report = _build(cfg, mode, acts, master, batch, loss.detach(), grads, {}, 1)
    return dataclasses.replace(report, seed=seed)


def _rank(cfg: GPTConfig, seed: int, mode: LinearMode, acts: Activations, batch: Batch,
          strategy: ShardingStrategy) -> UnitParityReport | None:
    with jax_work_on("cpu"):
        master = _master(cfg, seed)
        fsdp = shard_gpt(TorchGPT(cfg, mode, seed=seed + 1, activations=acts, compute="unit"),
                         strategy)
        load_flax_checkpoint(fsdp, master)
        tokens, targets = (torch.from_numpy(a).long() for a in batch)
        fsdp.zero_grad()
        loss = fsdp(tokens, targets)
        loss.backward()
        grads = fsdp.full_grads()
        names = list(cfg.linear_shapes()) if mode is LinearMode.MXFP8 else []
        planes = torch_plane_bytes(fsdp, names)
        if dist.get_rank() != 0:
            return None
        report = _build(cfg, mode, acts, master, batch, loss.detach(), grads, planes,
                        dist.get_world_size())
        return dataclasses.replace(report, seed=seed)


def unit_parity_report(
    cfg: GPTConfig, *, seed: int = 0, batch_size: int = 2, seq_len: int = 40,
    mode: LinearMode | str = LinearMode.MXFP8, activations: Activations | str = "fp32",
    world_size: int = 1, strategy: str = "optim_grads_params",
) -> UnitParityReport:
    """Unit compute vs the Flax twin on the CPU (module note): one process at world size 1,
    FSDP on ``world_size`` spawned gloo ranks otherwise."""
    mode, acts = LinearMode.parse(mode), Activations.parse(activations)
    batch = make_batch(cfg, seed, batch_size, seq_len)
    if world_size == 1:
        with jax_work_on("cpu"):
            return _single(cfg, seed, mode, acts, batch)
    from torch_side.launch import run_local_ranks

    return run_local_ranks(_rank, world_size, (cfg, seed, mode, acts, batch, strategy))[0]
