"""Torch buffers shared with JAX once per lifetime, and weight planes that live inside them.

``SharedBuffer(t)`` holds a Torch buffer and, from its first use, the zero-copy JAX view of it
(``to_jax``): every later reader gets the same JAX array, so a buffer that many linear layers read
(an FSDP bucket holding a whole unit's planes, a group's scale buffer) crosses the bridge once per
lifetime instead of once per layer and plane. The owner (FSDP) drops the ``SharedBuffer`` when the
buffer is freed or rewritten; the ownership rules of ``bridge/dlpack.py`` apply unchanged (the JAX
view keeps the storage alive; Torch does not overwrite it while JAX work reading it is pending).

Reuse across in-place rewrites. A share may outlive Torch rewriting its buffer in place (FSDP
rewrites a group's scale buffers and replicated planes at every optimizer step and keeps their
shares). That is safe on CUDA because every JAX program that reads a share also takes a freshly
imported input in the same call (the activation ``x`` in a forward, ``dy`` in a backward, the main
shard in a refresh): the import records an event on Torch's current stream and JAX's stream waits
for it, and the program cannot start before its inputs are defined, so it runs after every Torch
write enqueued before that import -- the rewrite included. The reverse order holds as before:
Torch reads a program's results only through ``to_torch``, which waits for the program, so a
rewrite never races a program that read the old values. A caller that runs a JAX program on
shares alone must import one fresh input (or synchronise) first.

``SharedTensor`` says where one high-precision parameter sits in such a buffer (a unit program
reads it by offset, ``to_flat_tensor``). ``SharedPlane`` says where one weight's plane sits in
two such buffers; ``to_flat_plane`` turns it
into the ``jax_side.linear.FlatPlane`` the jitted linear cuts the plane out of.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import torch

from bridge.dlpack import to_jax
from common.formats import MXFP8_BLOCKS, Plane, ScaleBlocks
from jax_side.linear import FlatPlane
from jax_side.unit_program import FlatTensor

__all__ = ["SharedBuffer", "SharedPlane", "SharedTensor", "to_flat_plane", "to_flat_tensor"]


class SharedBuffer:
    """A 1-D Torch buffer and its JAX view, made on first use and then reused."""

    __slots__ = ("_jax", "import_refs", "tensor")

    def __init__(self, tensor: torch.Tensor):
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(
                f"SharedBuffer: expected a contiguous 1-D buffer, got shape {tuple(tensor.shape)} "
                f"strides {tuple(tensor.stride())}"
            )
        self.tensor = tensor
        self._jax = None
        # References to ``tensor``'s TensorImpl that the JAX view holds (its DLPack export),
        # measured around the import; a pool that reuses the buffer subtracts them to see
        # whether anyone else holds it.
        self.import_refs = 0

    def jax(self) -> jax.Array:
        if self._jax is None:
            t = self.tensor
            before = t._use_count()
            self._jax = to_jax(t)
            self.import_refs = t._use_count() - before
        return self._jax

    @property
    def shared(self) -> bool:
        """Whether the JAX view exists (the buffer has crossed the bridge)."""
        return self._jax is not None


class SharedPlane(NamedTuple):
    """One block-scaled plane of an (N, K) weight inside shared buffers (offsets in elements)."""

    data: SharedBuffer  # uint8 buffer: the (N, K) plane at data_offset, row-major
    data_offset: int
    scale: SharedBuffer  # uint8 buffer: the compact scales at scale_offset
    scale_offset: int
    shape: tuple[int, int]
    plane: Plane
    blocks: ScaleBlocks = MXFP8_BLOCKS  # the weight's format (FSDP: its group's)


def to_flat_plane(p: SharedPlane) -> FlatPlane:
    """The JAX side of a ``SharedPlane`` (the buffers' JAX views; no copy, no per-call crossing
    once the buffers are shared)."""
    return FlatPlane(p.data.jax(), p.scale.jax(), p.data_offset, p.scale_offset, p.shape, p.plane,
                     p.blocks)


class SharedTensor(NamedTuple):
    """One high-precision parameter inside a shared buffer (offset in elements)."""

    data: SharedBuffer  # the buffer (the parameter's dtype): the parameter at offset, row-major
    offset: int
    shape: tuple[int, ...]


def to_flat_tensor(t: SharedTensor) -> FlatTensor:
    """The JAX side of a ``SharedTensor`` (no per-call crossing once the buffer is shared)."""
    return FlatTensor(t.data.jax(), t.offset, tuple(t.shape))
