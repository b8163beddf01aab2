"""``FSDPOptimizer``: any ``torch.optim`` optimizer over the fp32 main-weight shards.

Each step: hand every group's main grads (fp32, matching its main-weight shard) to the inner
optimizer, step it, then refresh the model weights from the new main weights -- the batched
distributed MXFP8 quantization for MXFP8 groups (one amax all-reduce per communicator for all of
them: ``torch_side.fsdp.batched_refresh``), a cast for the
others, and under ZeRO-1/2 an all-gather of the refreshed shards into the replicated buffers.
Optimizer states live next to the main-weight shards (1/DP per rank when sharded).

A step refuses to run on partial gradients: after a backward that an exception aborted (e.g.
``GradCheck.FINITE``), until ``zero_grad()`` (``FSDPState.grads_incomplete``).

``grad_norm()`` is the global L2 norm of the reduced gradients (one all-reduce of one float64):
every gradient element of the model counted once, whatever the strategy. Where ``main`` holds a
1/DP shard (``optim``, ``optim_grads``, ``optim_grads_params``) each rank adds the squares of its
shard of ``main_grad_for_optimizer()``; where it holds the full replicated gradient (``no_shard``)
only rank 0 of the group's DP group adds it. Expert groups do the same over their expert-DP
group; the expert-DP groups partition the DP ranks (each holds its own experts), so one sum over
the DP group adds every expert once too. ``divide_grads(n)`` divides the reduced gradients in
their own dtype (fp32 in the training app): a caller that ran backward on a sum of token losses
takes the mean there, after the MXFP8 GEMMs, instead of scaling the loss before backward (which
changes dy's MXFP8 bytes unless the factor is a power of two).

``clip_grad_norm_(model_or_optimizer, max_norm)`` is ``torch.nn.utils.clip_grad_norm_`` for the
reduced gradients: the same global norm (every element once, whatever the strategy; padding holds
zeros and adds nothing), then every group's main grad scaled in place by
``max_norm / (norm + 1e-6)`` when that is below 1, on every rank alike. It returns the norm before
clipping. A caller that already has the step's norm passes it (``total_norm=``), so a step costs
one all-reduce for logging and clipping together. A non-finite norm leaves the gradients as they
are (torch would scale them all to NaN) or raises with ``error_if_nonfinite=True``: the caller's
non-finite handling decides (``mxfp8-train`` skips or stops the step before any update).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_side.comm.collectives import Collective, Phase
from torch_side.fsdp.fsdp_model import FSDPModel
from torch_side.fsdp.param_group import ParamGroup
from torch_side.fsdp.sharded_state import OptimizerState

__all__ = ["FSDPOptimizer", "clip_grad_norm_"]


class FSDPOptimizer:
    def __init__(self, model: FSDPModel, optimizer_cls: type[torch.optim.Optimizer],
                 **kwargs: Any):
        if not isinstance(model, FSDPModel):
            raise TypeError(
                f"FSDPOptimizer: expected the FSDPModel returned by fully_shard, got "
                f"{type(model).__name__}; wrap first: model = fully_shard(model, ...)"
            )
        self.model = model
        self.groups = [g for g in model.param_groups if g.key.requires_grad]
        self.optimizer = optimizer_cls([g.main for g in self.groups], **kwargs)

    def _check_grads_complete(self, what: str) -> None:
        _check_grads_complete(self.model, what)

    def grad_norm(self) -> torch.Tensor:
        """COLLECTIVE: the global L2 norm of the reduced gradients over every shard, group and
        rank (module note), a float64 0-d tensor, the same on every rank. NaN or Inf when a
        gradient is (an fp32 shard norm above ~1.8e19 reads as Inf too)."""
        self._check_grads_complete("FSDPOptimizer.grad_norm()")
        return _global_norm(self.model, self.groups)

    def divide_grads(self, divisor: float) -> None:
        """Divide the reduced gradients by ``divisor`` (> 0), in their dtype (module note)."""
        if not (isinstance(divisor, int | float) and divisor > 0):
            raise ValueError(
                f"FSDPOptimizer.divide_grads: divisor={divisor!r}, expected a number > 0 (e.g. "
                f"the tokens whose summed loss the backward ran on)"
            )
        for g in self.groups:
            _grad(g).div_(divisor)

    def step(self) -> None:
        self._check_grads_complete("FSDPOptimizer.step()")
        for g in self.groups:
            g.main.grad = g.main_grad_for_optimizer()
        self.optimizer.step()
        for g in self.groups:
            g.main.grad = None
        self.model.refresh_model_weights()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``FSDPModel.zero_grad``: the main grads zeroed (and their memory given back with
        ``set_to_none``, as Torch's optimizers drop ``.grad``)."""
        self.model.zero_grad(set_to_none)

    def sharded_state(self) -> OptimizerState:
        """This optimizer's part of a sharded checkpoint (``torch_side.fsdp.sharded_state``): the
        inner optimizer's state over the main-weight pieces this rank holds, by parameter name
        and offset (loadable at any world size), and its 0-d states (step counts) per group."""
        return OptimizerState(self.groups, self.optimizer)

    def state_dict(self) -> dict:
        """The inner optimizer's state (per rank: states of this rank's main-weight shards)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def _check_grads_complete(model: FSDPModel, what: str) -> None:
    state = model.state
    state.require_idle(what)  # refuse before anything moves (recovers an aborted backward)
    if state.grads_incomplete:
        raise RuntimeError(
            f"rank {model.comms['dp'].rank}: {what}: the last backward "
            f"was aborted by an exception, so the main gradients hold part of a micro-batch "
            f"at most; call zero_grad() (drops them) and redo or skip this step"
        )


def _grad(g: ParamGroup) -> torch.Tensor:
    """The reduced gradient of a group that takes gradients (the only groups used here)."""
    grad = g.main_grad
    assert grad is not None, g.label
    return grad


def _global_norm(model: FSDPModel, groups: Sequence[ParamGroup]) -> torch.Tensor:
    """The global L2 norm of ``groups``' reduced gradients (module note); one all-reduce."""
    dp = model.comms["dp"]
    device = groups[0].main.device if groups else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for g in groups:
        if not g.facts.main_weights_sharded and g.comm.rank != 0:
            continue  # a replicated gradient: its group's rank 0 counts it
        total += torch.linalg.vector_norm(g.main_grad_for_optimizer()).double() ** 2
    dp.all_reduce(total, Collective.ALL_REDUCE_SUM, Phase.OPTIMIZER, "grad_norm")
    return total.sqrt().squeeze(0)


def clip_grad_norm_(
    target: FSDPModel | FSDPOptimizer,
    max_norm: float,
    *,
    total_norm: torch.Tensor | float | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """COLLECTIVE (unless ``total_norm`` is given): clip the reduced gradients of an
    ``FSDPModel`` (or of an ``FSDPOptimizer``'s model) to global L2 norm ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does on unsharded gradients (module note). Returns the
    norm before clipping (float64, 0-d, the same on every rank)."""
    model = target.model if isinstance(target, FSDPOptimizer) else target
    if not isinstance(model, FSDPModel):
        raise TypeError(
            f"clip_grad_norm_: expected the FSDPModel returned by fully_shard or its "
            f"FSDPOptimizer, got {type(target).__name__}; for an unwrapped module use "
            f"torch.nn.utils.clip_grad_norm_"
        )
    if isinstance(max_norm, bool) or not (
        isinstance(max_norm, int | float) and math.isfinite(max_norm) and max_norm > 0
    ):
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm!r}, expected a finite number > 0")
    _check_grads_complete(model, "clip_grad_norm_()")
    groups = [g for g in model.param_groups if g.key.requires_grad]
    if total_norm is None:
        total_norm = _global_norm(model, groups)
    total_norm = torch.as_tensor(total_norm, dtype=torch.float64)
    norm = float(total_norm)
    if not math.isfinite(norm):
        if error_if_nonfinite:
            raise RuntimeError(
                f"clip_grad_norm_: the global gradient norm is {norm}, so the gradients cannot "
                f"be clipped; skip this step (zero_grad()) or pass error_if_nonfinite=False"
            )
        return total_norm  # left as they are: the caller's non-finite handling decides
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:  # torch scales by min(coef, 1): a factor of 1 changes nothing
        for g in groups:
            _grad(g).mul_(coef)
    return total_norm
