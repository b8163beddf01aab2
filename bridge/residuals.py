"""JAX residuals that live exactly as long as autograd's saved tensors.

A ``torch.autograd.Function`` whose forward keeps JAX arrays for its backward (the MXFP8
linear's colwise planes, a unit program's residuals) hands them to ``save_for_backward`` on an
empty tensor (``holder``) instead of keeping them on ``ctx``. Autograd frees the saved tensors
right after the node's backward unless the graph is retained (``backward(retain_graph=True)``),
and with them the residuals; a backward through a freed graph raises Torch's own "backward
through the graph a second time" error (``saved``), as ``nn.Linear`` does.

On ``ctx`` they lived as long as the graph object: through the rest of the backward, the
optimizer step and -- in a loop ``loss = model(x); loss.backward(); opt.step()``, where ``loss``
keeps its graph until it is reassigned -- the next step's forward too (at 1.3B with 8 x 1024
tokens per step, 11.7 GiB; ``benchmarks/probe_memory.py``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["holder", "saved"]


def holder(like: torch.Tensor, residuals: Any) -> torch.Tensor:
    """An empty tensor on ``like``'s device carrying ``residuals`` (any Python object), for the
    forward's one ``ctx.save_for_backward(...)``."""
    h = like.new_empty(0)
    h.jax_residuals = residuals
    return h


def saved(ctx: Any) -> Any:
    """The residuals a forward saved with ``holder``; Torch's error once the graph was freed."""
    (h,) = ctx.saved_tensors
    return h.jax_residuals
