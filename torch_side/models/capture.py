"""One forward + backward of a Torch GPT twin, with every tensor the parity report compares.

``run_torch(model, tokens, targets)`` returns a ``TorchRun``: logits, loss, per-linear-layer
tensors (``LinearIO``: the layer's input x, output y, output gradient dy and input gradient dx, all
(T, C) with T = batch * seq tokens) captured by module hooks, and each parameter's gradient.

Works for the plain model and for an FSDP-wrapped one: hooks sit on the ``MXFP8Linear`` modules
(they see the tensors the bridge op received and returned), and parameter gradients are taken
from a callable so a sharded wrapper can hand back unsharded gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from torch_side.models.gpt import cross_entropy, mxfp8_linears

__all__ = ["LinearIO", "TorchRun", "run_torch"]


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
