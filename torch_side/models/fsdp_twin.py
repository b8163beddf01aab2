"""The Torch GPT twin under ``torch_side`` FSDP: wrap, run with capture, read full gradients.

- ``shard_gpt(model, strategy)``: ``fully_shard`` with one FSDP unit per transformer block (the
  root unit holds embeddings, final norm and LM head). With the default policy every linear
  weight is an MXFP8 parameter (its model weights are the rowwise/columnwise planes, quantized
  from bf16 of the fp32 main weights by the distributed recipe) and the other parameters stay fp32.
- ``run_sharded(fsdp, tokens, targets)``: one forward + backward with the capture of
  ``capture.run_torch``; gradients are the reduced main grads, all-gathered to full shapes.
- ``full_grads(fsdp)``: {parameter name: full fp32 gradient} (a collective: call on every rank).
- ``load_flax_checkpoint(fsdp, flat)``: set an already wrapped model from a Flax checkpoint
  (``jax_side.models.flat_params``; same names), requantizing the MXFP8 planes.

Every rank runs the same batch here, so the DP average of gradients, ``g/W + ... + g/W``, is
exactly ``g`` for W = 2 (halving and adding two equal floats are exact): the sharded gradients
must equal the unsharded model's bit for bit, and the parity report compares them to Flax.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from torch_side import FSDPModel, ShardingStrategy, fully_shard
from torch_side.collectives import Phase
from torch_side.models.capture import TorchRun, run_torch
from torch_side.models.gpt import Block, TorchGPT

__all__ = ["full_grads", "load_flax_checkpoint", "run_sharded", "shard_gpt"]


def shard_gpt(
    model: TorchGPT, strategy: ShardingStrategy | str = ShardingStrategy.OPTIM_GRADS_PARAMS
) -> FSDPModel:
    """Wrap a TorchGPT (same initial values on every rank) with one FSDP unit per block."""
    return fully_shard(model, unit_modules=(Block,), strategy=strategy)


def load_flax_checkpoint(fsdp: FSDPModel, flat: Mapping[str, object]) -> None:
    """Main weights <- a Flax checkpoint (name -> array, fp32), then FSDP refreshes its model
    weights (MXFP8 planes quantized from bf16 of them). Call on every rank with the same values."""
    state = {n: torch.as_tensor(np.asarray(a, dtype=np.float32)) for n, a in flat.items()}
    fsdp.load_full_state_dict(state)


def full_grads(fsdp: FSDPModel) -> dict[str, torch.Tensor]:
    """Full fp32 gradient of every parameter from the groups' main grads (all-gathered shards)."""
    out: dict[str, torch.Tensor] = {}
    for g in fsdp.param_groups:
        if g.main_grad is None:
            continue
        grad = g.main_grad
        if g.facts.grads_sharded:
            full = torch.empty(g.layout.padded_numel, dtype=grad.dtype, device=grad.device)
            g.comm.all_gather(full, grad, Phase.STATE, f"{g.label}/main_grad")
            grad = full
        for s in g.layout.slots:
            out[s.name] = grad[s.start : s.end].view(s.shape).float().clone()
    return out


def run_sharded(fsdp: FSDPModel, tokens: torch.Tensor, targets: torch.Tensor) -> TorchRun:
    """Forward + backward of the wrapped model on (tokens, targets) int64 (B, S), captured."""
    fsdp.zero_grad()
    return run_torch(fsdp.module, tokens, targets, forward=fsdp, grads=lambda: full_grads(fsdp))
