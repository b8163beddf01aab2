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

Saved-tensor hooks see the holder like any saved tensor:

- ``torch.utils.checkpoint(..., use_reentrant=False)`` drops it at the forward (so the residuals
  go at once) and its recomputation saves a new one, with residuals made again, which the
  backward reads: under activation checkpointing nothing is held from the first forward;
- ``torch.autograd.graph.save_on_cpu()`` keeps it as it is (the holder is an empty CPU tensor,
  which ``.cpu()`` returns unchanged): the JAX residuals stay where they are, on the device;
- a hook that hands back a different tensor (a copy) loses the residuals: ``saved`` then raises
  an error that says so (no silent recomputation, no wrong result).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["holder", "saved"]

_ATTR = "jax_residuals"


def holder(residuals: Any) -> torch.Tensor:
    """An empty CPU tensor carrying ``residuals`` (any Python object), for the forward's one
    ``ctx.save_for_backward(...)``."""
    h = torch.empty(0)
    setattr(h, _ATTR, residuals)
    return h


def saved(ctx: Any) -> Any:
    """The residuals a forward saved with ``holder``; Torch's error once the graph was freed, and
    a clear one when a saved-tensor hook replaced the holder (module note)."""
    (h,) = ctx.saved_tensors
    if not hasattr(h, _ATTR):
        raise RuntimeError(
            f"{type(ctx).__name__}: the JAX residuals this op saved for backward are gone: a "
            f"saved-tensor hook (torch.autograd.graph.saved_tensors_hooks, e.g. save_on_cpu("
            f"pin_memory=True)) handed back a copy of the tensor that carries them. Run the op "
            f"outside that hook (torch.autograd.graph.disable_saved_tensors_hooks), or use "
            f"activation recompute (unit compute: recompute=True; torch.utils.checkpoint with "
            f"use_reentrant=False) instead of offloading"
        )
    return getattr(h, _ATTR)
