"""Distributed-quantization numerics for Torch callers: JAX slice kernels on Torch tensors.

``torch_side.distributed_mxfp8_quantize`` owns the recipe's communication (DESIGN.md 5); the
numerics of its steps 1, 3 and 4 run here, in JAX, on zero-copy views of the Torch main-weight
slices (DESIGN.md 2: ``torch_side`` reaches JAX numerics only through ``bridge``):

- :func:`packed_partial_amax`: step 1, the partial block amax of ``bf16(main)`` of every parameter,
  both planes, packed into one fp32 1-D Torch tensor (the buffer the caller all-reduces with MAX);
- :func:`scales_and_cast`: steps 3-4, the full E8M0 scales from the reduced amax and the cast of
  the owned elements.

Packed layout: ``[row_0 (M0*K0/32), col_0 (M0*K0/32), row_1, col_1, ...]``, each plane's amax in
its scale tensor's row-major order (rowwise (M, K/32), columnwise (M/32, K)).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import torch
from jax import lax

from bridge.dlpack import jax_dtype_for, required_alignment, to_jax, to_torch
from bridge.linear import resolve_for
from common.formats import BLOCK_SIZE
from common.kernels import Backend, KernelConfig
from jax_side.mxfp8 import cast_slice, partial_block_amax, scales_from_amax

__all__ = ["SliceBytes", "packed_partial_amax", "scales_and_cast", "slice_backend"]


class SliceBytes(NamedTuple):
    """One parameter's bytes (all uint8 Torch tensors)."""

    rowwise: torch.Tensor  # (n,) e4m3 bytes of the owned flat slice, rowwise scaling
    colwise: torch.Tensor  # (n,) e4m3 bytes of the owned flat slice, columnwise scaling
    rowwise_scale: torch.Tensor  # (M, K/32) E8M0 bytes
    colwise_scale: torch.Tensor  # (M/32, K) E8M0 bytes


@functools.partial(jax.jit, static_argnames=("shapes", "starts", "backend", "source"))
def _packed_partial_amax(flats, shapes, starts, backend, source):
    parts = []
    for flat, (m, k), start in zip(flats, shapes, starts, strict=True):
        if flat is None:
            parts.append(jnp.zeros((2 * m * k // BLOCK_SIZE,), jnp.float32))
            continue
        amax = partial_block_amax(flat.astype(source), (m, k), start, backend=backend)
        parts += [amax.rowwise.reshape(-1), amax.colwise.reshape(-1)]
    return jnp.concatenate(parts)


@functools.partial(jax.jit, static_argnames=("shapes", "starts", "backend", "source"))
def _scales_and_cast(flats, packed_amax, shapes, starts, backend, source):
    scale_bytes = lax.bitcast_convert_type(
        scales_from_amax(packed_amax, backend=backend), jnp.uint8
    )
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
                flat.astype(source), (m, k), start, rowwise_scale=row_s,
                colwise_scale=col_s, backend=backend,
            )
            row_b = lax.bitcast_convert_type(cast.rowwise, jnp.uint8)
            col_b = lax.bitcast_convert_type(cast.colwise, jnp.uint8)
        out.append((row_b, col_b, row_s, col_s))
    return out


def slice_backend(kernels: KernelConfig | None, device: torch.device) -> Backend:
    """The backend whose slice kernels run: the configured quantize backend, except that ``te``
    (whole tensors only) quantizes slices with ``xla``, the reference it is spliced from."""
    backend = resolve_for(kernels, device).backend
    return Backend.XLA if backend is Backend.TE else backend


def _share(t: torch.Tensor | None):
    """JAX view of a main-weight slice: zero-copy when contiguous and aligned, else a copy.

    The views are only read inside these calls: every result is copied back before returning.
    """
    if t is None:
        return None
    t = t.detach()
    aligned = t.data_ptr() % required_alignment(t.device.type) == 0
    return to_jax(t, copy=not (t.is_contiguous() and aligned))


def _torch_copy(a, device: torch.device) -> torch.Tensor:
    # copy=True: results outlive the call and are written into FSDP buffers by the caller.
    t = to_torch(a, copy=True)
    return t if t.device == device else t.to(device)


def packed_partial_amax(
    main_shards: Sequence[torch.Tensor | None],
    shapes: Sequence[tuple[int, int]],
    starts: Sequence[int],
    device: torch.device,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Step 1: fp32 1-D packed partial amax of bf16(main) (layout in the module docstring).

    main_shards[i]: 1-D fp32 flat slice ``[starts[i], starts[i] + n)`` of the (M, K) = shapes[i]
    parameter, or None (zeros). Returned on ``device``, ready for ``all_reduce(MAX)``.
    kernels: whose slice kernels run (``slice_backend``); source_dtype: what the fp32 shards are
    rounded to before quantizing (bf16: DESIGN.md 3).
    """
    flats = tuple(_share(s) for s in main_shards)
    packed = _packed_partial_amax(
        flats, tuple(shapes), tuple(starts), slice_backend(kernels, device),
        jax_dtype_for(source_dtype),
    )
    return _torch_copy(packed, device)


def scales_and_cast(
    main_shards: Sequence[torch.Tensor | None],
    packed_amax: torch.Tensor,
    shapes: Sequence[tuple[int, int]],
    starts: Sequence[int],
    device: torch.device,
    *,
    kernels: KernelConfig | None = None,
    source_dtype: torch.dtype = torch.bfloat16,
) -> list[SliceBytes]:
    """Steps 3-4: full E8M0 scales from the reduced packed amax, cast of the owned elements.

    Bytes are 1-D of each slice's length (empty for None); scales are the full tensors.
    """
    flats = tuple(_share(s) for s in main_shards)
    per_param = _scales_and_cast(
        flats, to_jax(packed_amax), tuple(shapes), tuple(starts), slice_backend(kernels, device),
        jax_dtype_for(source_dtype),
    )
    return [SliceBytes(*(_torch_copy(a, device) for a in arrays)) for arrays in per_param]
