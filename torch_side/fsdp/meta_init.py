"""Meta-device initialisation: build the model on ``torch.device("meta")``, shard it, and
materialise only each rank's shard (DESIGN.md 5; PyTorch FSDP2 and Megatron-FSDP v2 do the same).

``fully_shard(model_on_meta, init=rule, device=...)`` allocates FSDP's buffers on ``device`` from
the parameters' shapes alone and fills each rank's fp32 main-weight shard piece by piece with
``rule.fill(name, shape, start, out)``: the elements ``[start, start + out.numel())`` of parameter
``name`` in its row-major order, written into ``out`` (a view of the shard). No rank ever holds a
full parameter, and no collective moves initial values.

**The rule that makes shard-then-init equal init-then-shard**: an ``init`` whose value for an
element is a function of (parameter name, element index) only, never of what was drawn before.
``materialize(module, rule)`` initialises a whole (non-meta) module with the same rule, so a model
initialised whole on one rank and sharded (``fully_shard``'s default broadcast from rank 0) holds
exactly the bytes of the same model sharded first and initialised per shard
(``tests/torch_side/fsdp/test_meta_init.py``, worlds 1-4). ``models.init_rule.GPTInit`` is such a
rule for the GPT. (A sequential ``torch.Generator`` is not: an element's value depends on every
element drawn before it, so a shard cannot be drawn alone -- "init-then-shard is not numerically
equivalent to shard-then-init", as Megatron-FSDP's users found.)

Refused, naming the parameter: a module with meta parameters but no ``init`` (or ``init`` for a
module without them), a module mixing meta and materialised parameters, meta buffers (FSDP does
not own buffers: materialise them first, e.g. ``module.to_empty`` on the buffer's owner).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["ParamInit", "check_meta", "materialize", "stand_in_for_meta"]


@runtime_checkable
class ParamInit(Protocol):
    """Initial values by position: ``fill`` writes elements ``[start, start + out.numel())`` of
    parameter ``name`` (of full ``shape``, row-major) into the fp32 1-D tensor ``out``."""

    def fill(self, name: str, shape: tuple[int, ...], start: int, out: torch.Tensor) -> None: ...


def check_meta(module: nn.Module, init: ParamInit | None) -> bool:
    """Whether ``module``'s parameters are on the meta device (then ``init`` is required);
    a ``ValueError`` naming the parameter or buffer for the refusals of the module note."""
    params = list(module.named_parameters())
    meta = [n for n, p in params if p.is_meta]
    real = [n for n, p in params if not p.is_meta]
    if meta and real:
        raise ValueError(f"fully_shard: parameter {meta[0]!r} is on the meta device but "
                         f"{real[0]!r} is not; build the whole model under "
                         f"`with torch.device('meta'):` or materialise it whole")
    buffers = [n for n, b in module.named_buffers() if b.is_meta]
    if meta and buffers:
        raise ValueError(f"fully_shard: buffer {buffers[0]!r} is on the meta device; FSDP "
                         f"materialises parameters only: give buffers their values first")
    if meta and init is None:
        raise ValueError(f"fully_shard: parameter {meta[0]!r} is on the meta device; pass "
                         f"init= (a torch_side.ParamInit, e.g. models.init_rule.GPTInit) to "
                         f"materialise each rank's shard, or build the model on a real device")
    if init is not None and not meta:
        raise ValueError("fully_shard: init= materialises a model built on the meta device, "
                         "but this model's parameters are real; initialise them yourself (or "
                         "with torch_side.materialize(module, init)) and drop init=")
    if init is not None and not isinstance(init, ParamInit):
        raise TypeError(f"fully_shard: init must have fill(name, shape, start, out), got "
                        f"{type(init).__name__}")
    return bool(meta)


def stand_in_for_meta(module: nn.Module, device: torch.device) -> None:
    """Replace every meta parameter (in every module that holds it: shared ones stay shared) by
    a storage-free stand-in on ``device``: the same shape, dtype and ``requires_grad``, one
    element of memory, values never read. FSDP then builds its groups on ``device`` and gives
    each parameter its working storage as for any model; ``init`` fills the main weights."""
    stand_ins: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for pname, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in stand_ins:
                one = torch.zeros(1, dtype=p.dtype, device=device)
                stand_ins[id(p)] = nn.Parameter(one.as_strided(p.shape, (0,) * p.dim()),
                                                requires_grad=p.requires_grad)
            mod._parameters[pname] = stand_ins[id(p)]


@torch.no_grad()
def materialize(module: nn.Module, init: ParamInit) -> nn.Module:
    """Set every parameter of a real (non-meta) ``module`` to ``init``'s values, whole: the
    init-then-shard twin of ``fully_shard(meta_module, init=init)``. Returns ``module``."""
    for name, p in module.named_parameters():
        if p.is_meta:
            raise ValueError(f"materialize: parameter {name!r} is on the meta device; "
                             f"pass it to fully_shard(..., init=...) instead")
        out = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
        init.fill(name, tuple(p.shape), 0, out)
        p.copy_(out.view(p.shape))
    return module
