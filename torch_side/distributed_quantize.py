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
boundaries (slices may split 32-blocks and rows). The numerics are ``jax_side.mxfp8``'s slice
building blocks; tensors cross into JAX and back through ``bridge`` (zero-copy DLPack).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import torch
import torch.distributed as dist
from jax import lax

import bridge
from jax_side.mxfp8 import BLOCK_SIZE, cast_slice, partial_block_amax, scales_from_amax

__all__ = ["QuantizedShard", "distributed_mxfp8_quantize"]


class QuantizedShard(NamedTuple):
    """One parameter's result: this rank's bytes and the full, replicated scales (all uint8)."""

    rowwise: torch.Tensor  # (n,) e4m3 bytes of the owned flat slice, rowwise scaling
    colwise: torch.Tensor  # (n,) e4m3 bytes of the owned flat slice, columnwise scaling
    rowwise_scale: torch.Tensor  # (M, K/32) E8M0 bytes
    colwise_scale: torch.Tensor  # (M/32, K) E8M0 bytes


def _check_inputs(main_shards, shapes, start_offsets) -> list[tuple[int, int]]:
    if not len(main_shards) == len(shapes) == len(start_offsets):
        raise ValueError(
            f"distributed_mxfp8_quantize: got {len(main_shards)} shards, {len(shapes)} shapes and "
            f"{len(start_offsets)} start offsets; pass one of each per parameter"
        )
    out = []
    for i, (shard, shape) in enumerate(zip(main_shards, shapes, strict=True)):
        shape = tuple(int(d) for d in shape)
        if len(shape) != 2 or shape[0] % BLOCK_SIZE or shape[1] % BLOCK_SIZE:
            raise ValueError(
                f"distributed_mxfp8_quantize: parameter {i} has shape {shape}; MXFP8 needs a 2-D "
                f"(M, K) shape with M % 32 == 0 and K % 32 == 0 (route it to a non-MXFP8 group)"
            )
        if shard is not None and (shard.dtype != torch.float32 or shard.dim() != 1):
            raise TypeError(
                f"distributed_mxfp8_quantize: shard {i} must be a 1-D float32 main-weight slice, "
                f"got dtype {shard.dtype} and shape {tuple(shard.shape)}"
            )
        out.append(shape)
    return out


@functools.partial(jax.jit, static_argnames=("shapes", "starts"))
def _packed_partial_amax(flats, shapes, starts):
    """Concatenated partial amax of bf16(main) of all parameters, fp32 1-D.

    flats: tuple of 1-D fp32 slices or None (static structure); layout of the result:
    [row_0 (M0*K0/32), col_0 (M0*K0/32), row_1, col_1, ...].
    """
    parts = []
    for flat, (m, k), start in zip(flats, shapes, starts, strict=True):
        if flat is None:
            parts.append(jnp.zeros((2 * m * k // BLOCK_SIZE,), jnp.float32))
            continue
        amax = partial_block_amax(flat.astype(jnp.bfloat16), (m, k), start)
        parts += [amax.rowwise.reshape(-1), amax.colwise.reshape(-1)]
    return jnp.concatenate(parts)


@functools.partial(jax.jit, static_argnames=("shapes", "starts"))
def _scales_and_cast(flats, packed_amax, shapes, starts):
    """Per parameter: (rowwise bytes, colwise bytes, rowwise scale, colwise scale), all uint8.

    packed_amax: the all-reduced result of ``_packed_partial_amax`` (same layout). Bytes are 1-D
    of the slice length (empty for None); scales are the full (M, K/32) and (M/32, K) tensors.
    """
    scale_bytes = lax.bitcast_convert_type(scales_from_amax(packed_amax), jnp.uint8)
    out, offset = [], 0
    for flat, (m, k), start in zip(flats, shapes, starts, strict=True):
        n_scale = m * k // BLOCK_SIZE
        row_s = scale_bytes[offset : offset + n_scale].reshape(m, k // BLOCK_SIZE)
        col_s = scale_bytes[offset + n_scale : offset + 2 * n_scale].reshape(m // BLOCK_SIZE, k)
        offset += 2 * n_scale
        if flat is None:
            row_b = col_b = jnp.zeros((0,), jnp.uint8)
        else:
            cast = cast_slice(
                flat.astype(jnp.bfloat16), (m, k), start, rowwise_scale=row_s, colwise_scale=col_s
            )
            row_b = lax.bitcast_convert_type(cast.rowwise, jnp.uint8)
            col_b = lax.bitcast_convert_type(cast.colwise, jnp.uint8)
        out.append((row_b, col_b, row_s, col_s))
    return out


def distributed_mxfp8_quantize(
    main_shards: Sequence[torch.Tensor | None],
    shapes: Sequence[tuple[int, int]],
    start_offsets: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> list[QuantizedShard]:
    """Quantize sharded fp32 main weights to MXFP8 with one amax all-reduce for the whole batch.

    main_shards[i]: this rank's 1-D fp32 slice of parameter i -- flat row-major elements
    ``[start_offsets[i], start_offsets[i] + numel)`` of the (M, K) = shapes[i] tensor -- or None
    when this rank owns none of it. group: the (expert-)DP process group; every rank of it must
    call with the same shapes. Returns per parameter a :class:`QuantizedShard`: rowwise and
    columnwise bytes of the owned slice (uint8, 1-D, the slice's length; empty for None) and the
    full rowwise (M, K/32) and columnwise (M/32, K) E8M0 scale bytes, identical on every rank.
    """

    def all_reduce_max(packed: torch.Tensor) -> None:
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)

    device = next((s.device for s in main_shards if s is not None), None) or _group_device(group)
    return quantize_with_reducer(main_shards, shapes, start_offsets, all_reduce_max, device)


def quantize_with_reducer(
    main_shards: Sequence[torch.Tensor | None],
    shapes: Sequence[tuple[int, int]],
    start_offsets: Sequence[int],
    all_reduce_max: Callable[[torch.Tensor], None],
    device: torch.device,
) -> list[QuantizedShard]:
    """``distributed_mxfp8_quantize`` with the amax all-reduce injected.

    all_reduce_max(packed) must replace the 1-D fp32 packed partial amax by its elementwise max
    over the group, in place (FSDP passes its logging communicator; a no-op when every rank holds
    whole parameters, as under ``no_shard``). device: where the packed buffer lives.
    """
    shapes = _check_inputs(main_shards, shapes, start_offsets)
    flats = tuple(None if s is None else _share(s) for s in main_shards)
    starts = tuple(int(s) for s in start_offsets)
    packed_jax = _packed_partial_amax(flats, tuple(shapes), starts)
    packed = bridge.to_torch(packed_jax, copy=True)
    if packed.device != device:
        packed = packed.to(device)
    all_reduce_max(packed)
    per_param = _scales_and_cast(flats, bridge.to_jax(packed), tuple(shapes), starts)
    return [QuantizedShard(*(_to_torch(a, device) for a in arrays)) for arrays in per_param]


def _share(t: torch.Tensor):
    """JAX view of a main-weight slice: zero-copy when it is contiguous and aligned, else a copy.

    The view is only read inside this call: every result is copied back before returning.
    """
    t = t.detach()
    aligned = t.data_ptr() % bridge.required_alignment(t.device.type) == 0
    return bridge.to_jax(t, copy=not (t.is_contiguous() and aligned))


def _group_device(group) -> torch.device:
    """Where a rank that owns nothing keeps its amax buffer: NCCL needs it on the current GPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_torch(a, device: torch.device) -> torch.Tensor:
    # copy=True: the results outlive this call and are written into FSDP buffers by the caller.
    t = bridge.to_torch(a, copy=True)
    return t if t.device == device else t.to(device)
