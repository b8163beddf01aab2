"""Torch side: FSDP buffers and communication (DESIGN.md 5).

Folders by job: ``fsdp/`` the FSDP core, ``comm/`` the wire (the only torch.distributed
collectives), ``checkpoint/`` sharded checkpoint files, ``instruments/`` telemetry and digests,
``launch.py`` the local launcher and per-rank bootstrap. The GPT twins are ``models``.

Public API (user guide: docs/fsdp.md):
- ``fully_shard(module, unit_modules=..., group=..., strategy=..., policy=..., kernels=...,
  init_sync=..., overlap=..., init=..., device=..., mesh=...)`` -> ``FSDPModel`` (``InitSync``,
  ``Overlap``: prefetch depth and asynchronous gradient reductions; ``init``: a ``ParamInit``
  that materialises each rank's shard of a model built on the meta device, ``materialize``
  its whole-model twin; ``mesh``: a 2-D (replicate, shard) ``DeviceMesh`` for HSDP,
  ``torch_side.fsdp.hybrid_mesh``);
  ``FSDPOptimizer(fsdp_model, torch.optim.AdamW, lr=...)``; ``clip_grad_norm_(model, max_norm)``
  (global norm over every shard)
- ``MixedPrecisionPolicy`` / ``WeightFormat`` / ``UnalignedLinear`` / ``GatherMode`` /
  ``ShardLayout`` (block-atomic MXFP8 shards), ``ShardingStrategy``
- ``distributed_mxfp8_quantize(main_shards, shapes, start_offsets, group)``
- ``FlatLayout`` / ``check_layout``, ``BucketAllocator``, ``WireRecord`` (wire accounting)
- ``CollectiveMismatchError``: raised by ``fully_shard(..., check_collectives=True)`` when the
  ranks are about to run different collectives

The names are loaded on first use (PEP 562), so ``import torch_side.fsdp.strategy`` or
``import torch_side.fsdp.policy`` loads torch only: JAX starts when the bridge is first needed.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it (the one place each public name comes from)
_EXPORTS: dict[str, str] = {
    "BucketAllocator": "torch_side.fsdp.bucket_allocator",
    "CollectiveMismatchError": "torch_side.comm.collective_check",
    "Collective": "torch_side.comm.collectives",
    "Phase": "torch_side.comm.collectives",
    "WireRecord": "torch_side.comm.collectives",
    "QuantizedShard": "torch_side.fsdp.distributed_quantize",
    "distributed_mxfp8_quantize": "torch_side.fsdp.distributed_quantize",
    "FlatLayout": "torch_side.fsdp.flat_layout",
    "LayoutError": "torch_side.fsdp.flat_layout",
    "LayoutPaddingWarning": "torch_side.fsdp.flat_layout",
    "LayoutStats": "torch_side.fsdp.flat_layout",
    "check_layout": "torch_side.fsdp.flat_layout",
    "GradCheck": "torch_side.fsdp.fsdp_unit",
    "FSDPModel": "torch_side.fsdp.fsdp_model",
    "fully_shard": "torch_side.fsdp.fsdp_model",
    "InitSync": "torch_side.fsdp.init_sync",
    "ParamInit": "torch_side.fsdp.meta_init",
    "materialize": "torch_side.fsdp.meta_init",
    "Overlap": "torch_side.fsdp.overlap",
    "FSDPOptimizer": "torch_side.fsdp.optimizer",
    "clip_grad_norm_": "torch_side.fsdp.optimizer",
    "PlaneState": "torch_side.fsdp.plane_bucket",
    "precompile": "torch_side.fsdp.precompiling",
    "GatherMode": "torch_side.fsdp.policy",
    "MixedPrecisionPolicy": "torch_side.fsdp.policy",
    "UnalignedLinear": "torch_side.fsdp.policy",
    "WeightFormat": "torch_side.fsdp.policy",
    "ShardingStrategy": "torch_side.fsdp.strategy",
    "ShardLayout": "torch_side.fsdp.flat_layout",
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
