"""Torch side: FSDP buffers, communication and the Torch GPT twin (DESIGN.md 5).

Public API (user guide: docs/fsdp.md):
- ``fully_shard(module, unit_modules=..., group=..., strategy=..., policy=..., kernels=...,
  init_sync=..., overlap=...)`` -> ``FSDPModel`` (``InitSync``, ``Overlap``: prefetch depth
  and asynchronous gradient reductions);
  ``FSDPOptimizer(fsdp_model, torch.optim.AdamW, lr=...)``; ``clip_grad_norm_(model, max_norm)``
  (global norm over every shard); ``LRScheduler(opt, ScheduleConfig(lr, LRSchedule.COSINE, ...))``
- ``MixedPrecisionPolicy`` / ``WeightFormat`` / ``UnalignedLinear`` / ``GatherMode``,
  ``ShardingStrategy``
- ``distributed_mxfp8_quantize(main_shards, shapes, start_offsets, group)``
- ``FlatLayout`` / ``check_layout``, ``BucketAllocator``, ``WireRecord`` (wire accounting)
- ``CollectiveMismatchError``: raised by ``fully_shard(..., check_collectives=True)`` when the
  ranks are about to run different collectives

The names are loaded on first use (PEP 562), so ``import torch_side.strategy`` or
``import torch_side.policy`` loads torch only: JAX starts when the bridge is first needed.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it (the one place each public name comes from)
_EXPORTS: dict[str, str] = {
    "BucketAllocator": "torch_side.bucket_allocator",
    "CollectiveMismatchError": "torch_side.collective_check",
    "Collective": "torch_side.collectives",
    "Phase": "torch_side.collectives",
    "WireRecord": "torch_side.collectives",
    "QuantizedShard": "torch_side.distributed_quantize",
    "distributed_mxfp8_quantize": "torch_side.distributed_quantize",
    "FlatLayout": "torch_side.flat_layout",
    "LayoutError": "torch_side.flat_layout",
    "LayoutPaddingWarning": "torch_side.flat_layout",
    "LayoutStats": "torch_side.flat_layout",
    "check_layout": "torch_side.flat_layout",
    "GradCheck": "torch_side.fsdp_unit",
    "FSDPModel": "torch_side.fsdp_model",
    "fully_shard": "torch_side.fsdp_model",
    "InitSync": "torch_side.init_sync",
    "Overlap": "torch_side.overlap",
    "FSDPOptimizer": "torch_side.optimizer",
    "clip_grad_norm_": "torch_side.optimizer",
    "LRSchedule": "torch_side.lr_schedule",
    "LRScheduler": "torch_side.lr_schedule",
    "ScheduleConfig": "torch_side.lr_schedule",
    "PlaneState": "torch_side.plane_bucket",
    "precompile": "torch_side.precompiling",
    "GatherMode": "torch_side.policy",
    "MixedPrecisionPolicy": "torch_side.policy",
    "UnalignedLinear": "torch_side.policy",
    "WeightFormat": "torch_side.policy",
    "ShardingStrategy": "torch_side.strategy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # any of _EXPORTS, loaded on first use
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'torch_side' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
