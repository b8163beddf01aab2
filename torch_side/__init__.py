"""Torch side: FSDP buffers, communication and training (DESIGN.md 5)."""

from torch_side.distributed_quantize import QuantizedShard, distributed_mxfp8_quantize

__all__ = ["QuantizedShard", "distributed_mxfp8_quantize"]
