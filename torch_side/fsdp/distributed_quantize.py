"""Batched distributed MXFP8 quantization of sharded fp32 main weights (DESIGN.md 5).

Every rank holds a flat slice of each parameter's fp32 main weight (or nothing). The recipe:

1. each rank computes the partial block amax of ``bf16(main)`` over the elements it owns, for both
   planes (rowwise 1x32 blocks along K, columnwise 32x1 blocks along M), into ONE packed
   zero-initialised fp32 buffer for the whole batch of parameters;
2. one ``all_reduce(MAX)`` of that buffer over the group (amax values are >= 0, so ranks that own
   nothing contribute zeros and still join the collective);
3. every rank turns the reduced amax into the full compact E8M0 scale tensors;
4. every rank casts only its own elements into rowwise and columnwise bytes.

The result is byte-identical to quantizing the whole ``bf16(main)`` on one rank, for any shard
boundaries (slices may split 32-blocks and rows). Steps 1, 3 and 4 are numerics and run in JAX
through ``bridge.mxfp8_slices`` (``jax_side.mxfp8``'s slice building blocks on zero-copy views);
this module owns the packing contract and the collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from bridge.mxfp8_slices import (
    GroupImages,
    Piece,
    ScaleLayout,
    SliceBytes,
    amax_numel,
    batched_partial_amax,
    batched_quantize_images,
    batched_scales_and_cast_images,
    packed_partial_amax,
    scales_and_cast,
    scales_and_cast_images,
)
from bridge.shared import SharedBuffer
from common.formats import check_mxfp8_shape
from common.kernels import KernelConfig
from torch_side.comm.collectives import Collective, all_reduce_on

__all__ = [
    "AmaxReduction",
    "BatchImages",
    "GroupImages",
    "Piece",
    "QuantizedShard",
    "ScaleLayout",
    "distributed_mxfp8_quantize",
    "quantize_batch_into_images",
    "quantize_into_images",
    "quantize_with_reducer",
]


# One parameter's result: this rank's rowwise / colwise bytes of its flat slice (uint8, 1-D) and the
# full, replicated rowwise (M, K/32) / columnwise (M/32, K) E8M0 scale bytes.
QuantizedShard = SliceBytes


def _check_inputs(main_shards: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]],
                  start_offsets: Sequence[int]) -> list[tuple[int, int]]:
    if not len(main_shards) == len(shapes) == len(start_offsets):
        raise ValueError(
            f"distributed_mxfp8_quantize: got {len(main_shards)} shards, {len(shapes)} shapes and "
            f"{len(start_offsets)} start offsets; pass one of each per parameter"
        )
    out = []
    for i, (shard, shape) in enumerate(zip(main_shards, shapes, strict=True)):
        shape = check_mxfp8_shape(
            shape, f"distributed_mxfp8_quantize: parameter {i} (route it to a non-MXFP8 group)"
        )
        if shard is not None and (shard.dtype != torch.float32 or shard.dim() != 1):
            raise TypeError(
                f"distributed_mxfp8_quantize: shard {i} must be a 1-D float32 main-weight slice, "
                f"got dtype {shard.dtype} and shape {tuple(shard.shape)}"
            )
        out.append(shape)
    return out


def distributed_mxfp8_quantize(
    main_shards: Sequence[torch.Tensor | None],
    shapes: Sequence[tuple[int, int]],
    start_offsets: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    kernels: KernelConfig | None = None,
) -> list[QuantizedShard]:
    """Quantize sharded fp32 main weights to MXFP8 with one amax all-reduce for the whole batch.

    main_shards[i]: this rank's 1-D fp32 slice of parameter i -- flat row-major elements
    ``[start_offsets[i], start_offsets[i] + numel)`` of the (M, K) = shapes[i] tensor -- or None
    when this rank owns none of it. group: the (expert-)DP process group; every rank of it must
    call with the same shapes. Returns per parameter a :class:`QuantizedShard`: rowwise and
    columnwise bytes of the owned slice (uint8, 1-D, the slice's length; empty for None) and the
    full rowwise (M, K/32) and columnwise (M/32, K) E8M0 scale bytes, identical on every rank.
    kernels: whose slice kernels run (None: the device default; every backend is byte-identical).
    The slices are gathered into one buffer first (a copy), so that they cross to JAX at once.
    """
    shapes = _check_inputs(main_shards, shapes, start_offsets)

    def all_reduce_max(packed: torch.Tensor) -> None:
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            all_reduce_on(packed, Collective.ALL_REDUCE_MAX,
                          "distributed_mxfp8_quantize's amax all-reduce", group)

    device = next((s.device for s in main_shards if s is not None), None) or _group_device(group)
    owned = [s for s in main_shards if s is not None and s.numel()]
    buffer = (
        torch.cat([s.detach().reshape(-1) for s in owned])
        if owned else torch.zeros(1, dtype=torch.float32, device=device)
    )
    pieces, offset = [], 0
    for shard, shape, start in zip(main_shards, shapes, start_offsets, strict=True):
        n = 0 if shard is None else shard.numel()
        pieces.append(Piece(shape, int(start), offset, n))
        offset += n
    return quantize_with_reducer(buffer, pieces, all_reduce_max, device, kernels=kernels)


def quantize_with_reducer(
    buffer: torch.Tensor,
    pieces: Sequence[Piece],
    all_reduce_max: Callable[[torch.Tensor], None],
    device: torch.device,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> list[QuantizedShard]:
    """``distributed_mxfp8_quantize`` on slices held in one fp32 ``buffer`` (e.g. an FSDP group's
    main shard), with the amax all-reduce injected.

    pieces[i]: where parameter i's slice sits in ``buffer`` (``Piece(shape, start, offset,
    numel)``; numel 0 when this rank owns none of it). all_reduce_max(packed) must replace the 1-D
    fp32 packed partial amax by its elementwise max over the group, in place (FSDP passes its
    logging communicator; a no-op when every rank holds whole parameters, as under
    ``no_shard``). device: where the packed buffer lives. source_dtype: the high-precision dtype
    the planes are quantized from (the format's ``source_dtype``: bf16 for MXFP8, DESIGN.md 3).
    The buffer crosses to JAX once for both numerics steps.
    """
    shared = SharedBuffer(buffer)
    kw = {"kernels": kernels, "source_dtype": source_dtype}
    packed = packed_partial_amax(shared, pieces, device, **kw)
    all_reduce_max(packed)
    return scales_and_cast(shared, packed, pieces, device, **kw)


def quantize_into_images(
    buffer: torch.Tensor,
    pieces: Sequence[Piece],
    all_reduce_max: Callable[[torch.Tensor], None],
    device: torch.device,
    scales: ScaleLayout,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_with_reducer`` returning the bytes as images of the caller's buffers (rowwise
    and columnwise shards laid out like ``buffer``, then the two scale buffers laid out by
    ``scales``): FSDP's refresh copies them with four ``copy_`` calls per group, whatever its
    number of parameters (``bridge.mxfp8_slices.scales_and_cast_images``)."""
    shared = SharedBuffer(buffer)
    kw = {"kernels": kernels, "source_dtype": source_dtype}
    packed = packed_partial_amax(shared, pieces, device, **kw)
    all_reduce_max(packed)
    return scales_and_cast_images(shared, packed, pieces, scales, device, **kw)


class BatchImages(NamedTuple):
    """``quantize_batch_into_images``'s result, one entry per buffer of the batch."""

    images: list[GroupImages]  # buffer j's four images (views of one packed tensor)
    amax: list[torch.Tensor]  # buffer j's slice of the reduced packed amax (views of one tensor)


def quantize_batch_into_images(
    buffers: Sequence[torch.Tensor],
    pieces: Sequence[Sequence[Piece]],
    all_reduce_max: Callable[[torch.Tensor], None],
    device: torch.device,
    scales: Sequence[ScaleLayout],
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
    one_pass: bool = False,
) -> BatchImages:
    """``quantize_into_images`` of several buffers at once (``pieces[j]``, ``scales[j]``: buffer
    j's), e.g. every MXFP8 group of an FSDP model on one communicator: one program for the partial
    amax of all of them, ONE ``all_reduce_max`` of the concatenated packed amax, one program for
    every buffer's scales and bytes. Each buffer crosses to JAX once; the bytes are identical to
    ``quantize_into_images`` of each buffer alone (amax and scales are per block; the reduction
    is elementwise).

    ``one_pass``, for a batch whose reduction changes no amax (``AmaxReduction.identity``): the
    packed amax and the bytes from ONE program that reads each piece once where the kernels can
    (``bridge.mxfp8_slices.batched_quantize_images``), then the reduction called once with that
    amax (its collective, if any, still issued). Same bytes."""
    shared = [SharedBuffer(b) for b in buffers]
    kw = {"kernels": kernels, "source_dtype": source_dtype}
    if one_pass:
        images, packed = batched_quantize_images(shared, pieces, scales, device, **kw)
        all_reduce_max(packed)
    else:
        packed = batched_partial_amax(shared, pieces, device, **kw)
        all_reduce_max(packed)
        images = batched_scales_and_cast_images(shared, packed, pieces, scales, device, **kw)
    return BatchImages(images, _split_amax(packed, pieces))


def _split_amax(packed: torch.Tensor, pieces: Sequence[Sequence[Piece]]) -> list[torch.Tensor]:
    """Each buffer's slice of the batch's packed amax (views, buffer order)."""
    amax, at = [], 0
    for ps in pieces:
        n = amax_numel(ps)
        amax.append(packed[at:at + n])
        at += n
    return amax


class AmaxReduction:
    """The amax reduction a ``BlockScaledCodec`` injects into ``quantize_images``: call it once
    with the packed partial amax (in place: its maximum over the ranks, or nothing). ``identity``
    says the call cannot change a value -- one rank, every rank holding whole parameters, or
    block-atomic owners whose scales are all-gathered -- so a codec may make the amax and the
    cast in one pass over the main weights before calling it (``MXFP8Codec``)."""

    def __init__(self, reduce: Callable[[torch.Tensor], None], identity: bool) -> None:
        self._reduce, self.identity = reduce, identity

    def __call__(self, packed: torch.Tensor) -> None:
        self._reduce(packed)


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a rank that owns nothing keeps its amax buffer: NCCL needs it on the current GPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
