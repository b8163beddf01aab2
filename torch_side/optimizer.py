"""``FSDPOptimizer``: any ``torch.optim`` optimizer over the fp32 main-weight shards.

Each step: hand every group's main grads (fp32, matching its main-weight shard) to the inner
optimizer, step it, then refresh the model weights from the new main weights -- the batched
distributed MXFP8 quantization for MXFP8 groups (one amax all-reduce per group), a cast for the
others, and under ZeRO-1/2 an all-gather of the refreshed shards into the replicated buffers.
Optimizer states live next to the main-weight shards (1/DP per rank when sharded).

A step refuses to run on partial gradients: after a backward that an exception aborted (e.g.
``GradCheck.FINITE``), until ``zero_grad()`` (``FSDPState.grads_incomplete``).
"""

from __future__ import annotations

import torch

from torch_side.fsdp_model import FSDPModel

__all__ = ["FSDPOptimizer"]


class FSDPOptimizer:
    def __init__(self, model: FSDPModel, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        if not isinstance(model, FSDPModel):
            raise TypeError(
                f"FSDPOptimizer: expected the FSDPModel returned by fully_shard, got "
                f"{type(model).__name__}; wrap first: model = fully_shard(model, ...)"
            )
        self.model = model
        self.groups = [g for g in model.param_groups if g.key.requires_grad]
        self.optimizer = optimizer_cls([g.main for g in self.groups], **kwargs)

    def step(self) -> None:
        self.model.state.require_idle("FSDPOptimizer.step()")  # refuse before a weight moves
        state = self.model.state
        state.recover("FSDPOptimizer.step()")
        if state.grads_incomplete:
            raise RuntimeError(
                f"rank {self.model.comms['dp'].rank}: FSDPOptimizer.step(): the last backward "
                f"was aborted by an exception, so the main gradients hold part of a micro-batch "
                f"at most; call zero_grad() (drops them) and redo or skip this step"
            )
        for g in self.groups:
            g.main.grad = g.main_grad_for_optimizer()
        self.optimizer.step()
        for g in self.groups:
            g.main.grad = None
        self.model.refresh_model_weights()

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def state_dict(self) -> dict:
        """The inner optimizer's state (per rank: states of this rank's main-weight shards)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
