"""Torch side: FSDP buffers, communication and training (DESIGN.md 5).

Public API (user guide: docs/fsdp.md):
- ``fully_shard(module, unit_modules=..., group=..., strategy=..., policy=...) -> FSDPModel``
- ``FSDPOptimizer(fsdp_model, torch.optim.AdamW, lr=...)``
- ``MixedPrecisionPolicy`` / ``WeightFormat`` / ``UnalignedLinear``, ``ShardingStrategy``
- ``distributed_mxfp8_quantize(main_shards, shapes, start_offsets, group)``
- ``FlatLayout`` / ``check_layout``, ``BucketAllocator``, ``WireRecord`` (wire accounting)
"""

from torch_side.bucket_allocator import BucketAllocator
from torch_side.collectives import Collective, Phase, WireRecord
from torch_side.distributed_quantize import QuantizedShard, distributed_mxfp8_quantize
from torch_side.flat_layout import FlatLayout, LayoutError, check_layout
from torch_side.fsdp_unit import GradCheck
from torch_side.fully_shard import FSDPModel, fully_shard
from torch_side.optimizer import FSDPOptimizer
from torch_side.policy import MixedPrecisionPolicy, UnalignedLinear, WeightFormat
from torch_side.strategy import ShardingStrategy

__all__ = [
    "BucketAllocator",
    "Collective",
    "FSDPModel",
    "FSDPOptimizer",
    "FlatLayout",
    "GradCheck",
    "LayoutError",
    "MixedPrecisionPolicy",
    "Phase",
    "QuantizedShard",
    "ShardingStrategy",
    "UnalignedLinear",
    "WeightFormat",
    "WireRecord",
    "check_layout",
    "distributed_mxfp8_quantize",
    "fully_shard",
]
