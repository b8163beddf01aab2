"""The Torch side of the parity report: one forward + backward of a Torch GPT twin with every
tensor the report compares, plain or under ``torch_side`` FSDP.

- ``run_torch(model, tokens, targets)`` returns a ``TorchRun``: logits, loss, per-linear-layer
  tensors (``LinearIO``: the layer's input x, output y, output gradient dy and input gradient dx,
  all (T, C) with T = batch * seq tokens) captured by module hooks, and each parameter's gradient.
  Hooks sit on the ``MXFP8Linear`` modules (they see the tensors the bridge op received and
  returned); gradients come from a callable so a sharded wrapper can hand back full gradients.
- ``shard_gpt(model, strategy)``: ``fully_shard`` with one FSDP unit per transformer block (the
  root unit holds embeddings, final norm and LM head). With the default policy every linear weight
  is an MXFP8 parameter and the other parameters stay fp32.
- ``run_sharded(fsdp, tokens, targets)``: ``run_torch`` on the wrapped model; gradients are the
  reduced main grads, all-gathered to full shapes (``full_grads``, a collective).
- ``load_flax_checkpoint(fsdp, flat)``: set an already wrapped model from a Flax checkpoint
  (``models.flax_gpt.flat_params``; same names), requantizing the MXFP8 planes.

Every rank of the sharded report runs the same batch, so the DP average of gradients,
``g/W + ... + g/W``, is exactly ``g`` for W = 2 (halving and adding two equal floats are exact) but
in general only to fp32 rounding (at W = 3, ``3 * fl(g/3)`` need not be ``g``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from apps import environment
from common.kernels import KernelConfig
from models.torch_gpt import Block, TorchGPT, cross_entropy, mxfp8_linears
from torch_side import FSDPModel, ShardingStrategy, fully_shard

__all__ = [
    "LinearIO",
    "TorchRun",
    "full_grads",
    "load_flax_checkpoint",
    "run_sharded",
    "run_torch",
    "shard_gpt",
]


class LinearIO(NamedTuple):
    """One linear layer's tensors (T, C): x (T, in), y (T, out), dy (T, out), dx (T, in)."""

    x: torch.Tensor
    y: torch.Tensor
    dy: torch.Tensor
    dx: torch.Tensor


class TorchRun(NamedTuple):
    logits: torch.Tensor  # (B, S, V) float32
    loss: torch.Tensor  # () float32
    linear_io: dict[str, LinearIO]  # by module name, e.g. "h_0.attn.qkv"
    grads: dict[str, torch.Tensor]  # by parameter name, full (unsharded) shapes


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1, t.shape[-1]).clone()  # (T, C)


def _default_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    if missing:
        raise RuntimeError(f"run_torch: no gradient for {missing} after backward")
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def run_torch(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    *,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
    grads: Callable[[], dict[str, torch.Tensor]] | None = None,
) -> TorchRun:
    """Forward + backward of ``cross_entropy(model(tokens), targets)`` with capture.

    tokens, targets: int64 (B, S). ``forward`` defaults to ``model`` (pass the FSDP wrapper's
    call when wrapped); ``grads`` defaults to reading ``p.grad`` of ``model``'s parameters.
    Gradients are zeroed first, so one call = one micro-batch.
    """
    model.zero_grad(set_to_none=True)
    xs, ys, dys, dxs = {}, {}, {}, {}
    handles = []
    for name, layer in mxfp8_linears(model):

        def fwd_hook(mod, args, out, name=name):
            xs[name], ys[name] = _flat(args[0]), _flat(out)

        def bwd_hook(mod, grad_in, grad_out, name=name):
            dys[name], dxs[name] = _flat(grad_out[0]), _flat(grad_in[0])

        handles.append(layer.register_forward_hook(fwd_hook))
        handles.append(layer.register_full_backward_hook(bwd_hook))
    try:
        logits = (forward or model)(tokens)
        loss = cross_entropy(logits, targets)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    io = {n: LinearIO(xs[n], ys[n], dys[n], dxs[n]) for n in xs}
    grad_dict = grads() if grads is not None else _default_grads(model)
    return TorchRun(logits.detach(), loss.detach(), io, grad_dict)


def shard_gpt(
    model: TorchGPT, strategy: ShardingStrategy | str = ShardingStrategy.OPTIM_GRADS_PARAMS,
    kernels: KernelConfig | None = None,
) -> FSDPModel:
    """Wrap a TorchGPT (same initial values on every rank) with one FSDP unit per block
    (``MXFP8_FSDP_CHECK_COLLECTIVES=1``: with the collective check, ``apps.environment``)."""
    return fully_shard(model, unit_modules=(Block,), strategy=strategy, kernels=kernels,
                       check_collectives=environment.check_collectives())


def load_flax_checkpoint(fsdp: FSDPModel, flat: Mapping[str, object]) -> None:
    """Main weights <- a Flax checkpoint (name -> array, fp32), then FSDP refreshes its model
    weights (MXFP8 planes quantized from bf16 of them). Call on every rank with the same values."""
    state = {n: torch.from_numpy(np.array(a, dtype=np.float32)) for n, a in flat.items()}
    fsdp.load_full_state_dict(state)


def full_grads(fsdp: FSDPModel) -> dict[str, torch.Tensor]:
    """Full fp32 gradient of every parameter from the groups' main grads (a collective)."""
    return fsdp.full_grads()


def run_sharded(fsdp: FSDPModel, tokens: torch.Tensor, targets: torch.Tensor) -> TorchRun:
    """Forward + backward of the wrapped model on (tokens, targets) int64 (B, S), captured."""
    fsdp.zero_grad()
    return run_torch(fsdp.module, tokens, targets, forward=fsdp, grads=lambda: full_grads(fsdp))
