"""Test helper: a wrapped model's optimizer state per parameter, whole, comparable across world
sizes, meshes and shard layouts (test_hsdp.py, test_block_atomic.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["full_optimizer_state"]


def full_optimizer_state(model, opt) -> dict[str, torch.Tensor]:
    """COLLECTIVE over the shard group: {"<param>/<state>": whole value} for per-element states
    (all-gathered, the layout's padding cut) and {"<group label>/<state>": value} for 0-d ones."""
    out = {}
    dp = model.comms["dp"]
    for g in model.param_groups:
        for k, v in opt.optimizer.state.get(g.main, {}).items():
            if v.dim() == 0:
                out[f"{g.label}/{k}"] = v.clone()
                continue
            full = v
            if g.facts.main_weights_sharded and dp.world_size > 1:
                parts = [torch.empty_like(v) for _ in range(dp.world_size)]
                dist.all_gather(parts, v, group=dp.group)
                full = torch.cat(parts)
            for slot in g.slots:
                out[f"{slot.name}/{k}"] = full[slot.start:slot.end].clone()
    return out
