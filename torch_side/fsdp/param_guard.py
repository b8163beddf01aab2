"""A plain optimizer over an ``FSDPModel``'s parameters is refused, not silently useless.

After ``fully_shard`` a module parameter holds working storage only (a view of a weights buffer,
an empty tensor while sharded, or a storage-free MXFP8 placeholder): the trainable values are the
groups' fp32 main weights, and FSDP's hooks move every ``param.grad`` into its own buffers. A
``torch.optim`` optimizer built over ``fsdp.parameters()`` would find no gradient at ``step()``
and do nothing, every step, without a word.

So ``FSDPModel`` marks each parameter it manages (``mark``), and one global optimizer step
pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``, installed once per process)
refuses the step of any optimizer holding a marked parameter, naming it and the fix
(``FSDPOptimizer(fsdp_model, torch.optim.X, ...)``). It is deterministic (the first step raises,
whatever the gradients) and changes nothing else: ``fsdp.parameters()`` still lists the
parameters, so counting them, moving the module or inspecting it work as before. The inner
optimizer of ``FSDPOptimizer`` holds the main-weight shards, which are not marked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["managed_name", "mark"]

_MARK = "_fsdp_managed_param"  # attribute on managed parameters: their qualified name
_installed = False


def managed_name(param: torch.Tensor) -> str | None:
    """The qualified name FSDP manages ``param`` under, or None."""
    return getattr(param, _MARK, None)


def mark(param: torch.nn.Parameter, name: str) -> None:
    """Mark ``param`` as FSDP working storage (and install the step guard once)."""
    setattr(param, _MARK, name)
    _install()


def _refuse_managed(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = managed_name(p)
            if name is None:
                continue
            rank = dist.get_rank() if dist.is_initialized() else 0
            cls = type(optimizer).__name__
            raise TypeError(
                f"rank {rank}: {cls}.step(): parameter {name!r} belongs to an FSDPModel "
                f"(fully_shard): its trainable value is FSDP's fp32 main weight and FSDP's hooks "
                f"consume its .grad, so this optimizer would silently do nothing. Let FSDP build "
                f"the optimizer over its main weights: FSDPOptimizer(fsdp_model, "
                f"torch.optim.{cls}, lr=...)"
            )


def _install() -> None:
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_refuse_managed)
        _installed = True
