"""``TorchMXFP8Tensor``: the Torch-side mirror of ``jax_side.mxfp8.MXFP8Tensor``, and its transfer.

Layout (DESIGN.md 4) for a logical (M, K) tensor, identical on both sides:
- rowwise plane: data (M, K), blocks 1x32 along K; scale (M, K // 32).
- colwise plane: data (M, K), same *not transposed* layout, blocks 32x1 along M; scale (M // 32, K).

Both classes hold the planes as one mapping ``planes: {Plane: PlaneData(data, scale)}`` with only
the planes present (``rowwise_data`` ... ``colwise_scale`` remain as read-only conveniences, None
for an absent plane). Torch side: data is float8_e4m3fn **or uint8** (FSDP buffers are uint8),
scales are float8_e8m0fnu **or uint8**. JAX side: float8_e4m3fn / float8_e8m0fnu. A uint8 plane is
reinterpreted with ``Tensor.view(dtype)`` (same bytes, same pointer) before it crosses DLPack, so
``to_jax_mxfp8`` / ``to_torch_mxfp8`` are zero-copy for every plane (ownership note:
``bridge/dlpack.py``).

``MXFP8WeightPlanes`` is the protocol ``mxfp8_linear`` takes weights through, so that FSDP can hand
over planes lazily: the op calls ``rowwise()`` in forward and ``colwise()`` only in backward, and
holds no reference to the returned tensors after the call that uses them.

Other block-scaled formats (``common.formats.ScaleBlocks`` other than ``MXFP8_BLOCKS``: a format
registered by a user) travel through the same classes with their ``blocks`` given: the shapes
checked are then the format's (``blocks.data_shape``, ``blocks.scale_shape``). Such planes are
not an ``MXFP8Tensor`` (``to_jax_mxfp8`` refuses them); JAX reads them as
``jax_side.linear.FlatPlane`` (``bridge.mxfp8_linear`` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np
import torch
from jax.typing import DTypeLike

from bridge.capabilities import Fp8Transport
from bridge.dlpack import to_jax, to_torch
from common.formats import (
    MXFP8_BLOCKS,
    Plane,
    PlaneData,
    PlaneFields,
    ScaleBlocks,
    check_mxfp8_shape,
)
from jax_side.mxfp8 import MXFP8Tensor

__all__ = [
    "MXFP8WeightPlanes",
    "TorchMXFP8Tensor",
    "planes_to_jax",
    "to_jax_mxfp8",
    "to_torch_mxfp8",
]

_DATA_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
_HP_DTYPES = {torch.float32: np.dtype(jnp.float32), torch.bfloat16: np.dtype(jnp.bfloat16)}


@runtime_checkable
class MXFP8WeightPlanes(Protocol):
    """Lazy provider of a weight's MXFP8 planes (Torch tensors, uint8 or native float8).

    ``shape`` is the logical (N, K). ``rowwise()`` -> (data (N, K), scale (N, K/32));
    ``colwise()`` -> (data (N, K), scale (N/32, K)). Each call may all-gather; callers must not
    keep the returned tensors beyond the computation that reads them.

    A provider may also offer ``shared(plane) -> bridge.shared.SharedPlane`` (FSDP does): the
    plane inside buffers already shared with JAX, which ``mxfp8_linear`` then prefers (no
    per-call crossing for the weight); and ``blocks``, the planes' ``ScaleBlocks`` when they
    are not MXFP8's (shapes above: ``blocks.scale_shape``).
    """

    shape: tuple[int, int]

    def rowwise(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def colwise(self) -> tuple[torch.Tensor, torch.Tensor]: ...


def check_plane(
    owner: str, shape: tuple[int, int], plane: Plane, data: torch.Tensor, scale: torch.Tensor,
    blocks: ScaleBlocks = MXFP8_BLOCKS,
) -> None:
    """Raise a clear error unless (data, scale) is a valid ``plane`` of a logical ``shape`` in
    the format of ``blocks``."""
    want_data, want_scale = blocks.data_shape(shape), blocks.scale_shape(shape, plane)
    for what, t, want, dtypes in (
        ("data", data, want_data, _DATA_DTYPES),
        ("scale", scale, want_scale, _SCALE_DTYPES),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{owner}: {plane.value} {what} must be a torch.Tensor, got {type(t).__name__}"
            )
        if tuple(t.shape) != want or t.dtype not in dtypes:
            raise ValueError(
                f"{owner}: {plane.value} {what} of a logical {shape} {_name(blocks)} tensor must "
                f"have shape "
                f"{want} and dtype in {[str(d) for d in dtypes]}, got shape {tuple(t.shape)} dtype "
                f"{t.dtype} (DESIGN.md 4: planes are (M, K), not transposed; scales compact)"
            )
    if data.device != scale.device:
        raise ValueError(
            f"{owner}: {plane.value} data is on {data.device} but its scale is on {scale.device}"
        )


def _name(blocks: ScaleBlocks) -> str:
    return "MXFP8" if blocks == MXFP8_BLOCKS else f"block-scaled ({blocks.block_size}-element)"


def _check_shape(shape: Sequence[int], blocks: ScaleBlocks) -> tuple[int, int]:
    if blocks == MXFP8_BLOCKS:
        return check_mxfp8_shape(shape, "TorchMXFP8Tensor")
    dims = tuple(int(d) for d in shape)
    problem = blocks.shape_problem(dims)
    if problem is not None:
        raise ValueError(f"TorchMXFP8Tensor of blocks {blocks}: {problem}")
    m, k = dims  # shape_problem refuses anything but 2-D
    return (m, k)


@dataclasses.dataclass(frozen=True)
class TorchMXFP8Tensor(PlaneFields):
    """Block-scaled planes of a logical (M, K) tensor held by Torch, MXFP8 unless ``blocks``
    says otherwise; see the module docstring."""

    planes: Mapping[Plane, PlaneData]  # only the planes present
    shape: tuple[int, int]
    dtype: torch.dtype  # dtype of the high-precision tensor that was quantized
    blocks: ScaleBlocks = MXFP8_BLOCKS  # the format of the planes

    def __post_init__(self):
        object.__setattr__(self, "shape", _check_shape(self.shape, self.blocks))
        if self.dtype not in _HP_DTYPES:
            raise ValueError(
                f"TorchMXFP8Tensor: dtype (of the quantized source) must be torch.float32 or "
                f"torch.bfloat16, got {self.dtype}"
            )
        if not isinstance(self.planes, Mapping):
            raise TypeError(
                f"TorchMXFP8Tensor: planes must be a mapping {{Plane: PlaneData(data, scale)}}, "
                f"got {type(self.planes).__name__}"
            )
        planes = {Plane.parse(p): PlaneData(*v) for p, v in self.planes.items()}
        for plane, (data, scale) in planes.items():
            if data is None or scale is None:
                raise ValueError(
                    f"TorchMXFP8Tensor{self.shape}: {plane.value} data and scale must both be "
                    f"given (leave an absent plane out of the mapping)"
                )
            check_plane("TorchMXFP8Tensor", self.shape, plane, data, scale, self.blocks)
        object.__setattr__(self, "planes", {p: planes[p] for p in Plane if p in planes})

    def has_plane(self, plane: Plane | str) -> bool:
        return Plane.parse(plane) in self.planes

    def plane(self, plane: Plane | str) -> PlaneData:
        plane = Plane.parse(plane)
        if plane not in self.planes:
            raise ValueError(
                f"this TorchMXFP8Tensor of shape {self.shape} has no {plane.value} plane"
            )
        return self.planes[plane]

    def rowwise(self) -> PlaneData:
        return self.plane(Plane.ROWWISE)

    def colwise(self) -> PlaneData:
        return self.plane(Plane.COLWISE)


def _as_native(t: torch.Tensor, native: torch.dtype) -> torch.Tensor:
    return t.view(native) if t.dtype == torch.uint8 else t  # same bytes, same pointer


def planes_to_jax(
    shape: tuple[int, int],
    dtype: torch.dtype,
    planes: Mapping[Plane, tuple[torch.Tensor, torch.Tensor]],
    *,
    transport: Fp8Transport | str | None = None,
) -> MXFP8Tensor:
    """Zero-copy ``MXFP8Tensor`` over Torch planes ({Plane: (data, scale)}), validated."""
    pairs = {p: PlaneData(*pair) for p, pair in planes.items()}
    return to_jax_mxfp8(TorchMXFP8Tensor(pairs, shape, dtype), transport=transport)


def to_jax_mxfp8(
    tt: TorchMXFP8Tensor, *, transport: Fp8Transport | str | None = None
) -> MXFP8Tensor:
    """Zero-copy: every present plane of ``tt`` as a JAX float8 array at the same address."""
    if not isinstance(tt, TorchMXFP8Tensor):
        raise TypeError(f"to_jax_mxfp8: expected a TorchMXFP8Tensor, got {type(tt).__name__}")
    if tt.blocks != MXFP8_BLOCKS:
        raise ValueError(
            f"to_jax_mxfp8: the planes are in blocks {tt.blocks}, not MXFP8's; JAX reads them as "
            f"jax_side.linear.FlatPlane (jax_side.block_scaled), not as an MXFP8Tensor"
        )
    planes = {
        p: PlaneData(
            to_jax(_as_native(data, torch.float8_e4m3fn), transport=transport),
            to_jax(_as_native(scale, torch.float8_e8m0fnu), transport=transport),
        )
        for p, (data, scale) in tt.planes.items()
    }
    return MXFP8Tensor(planes, tt.shape, _HP_DTYPES[tt.dtype])


def _torch_hp_dtype(dtype: DTypeLike) -> torch.dtype:
    for td, nd in _HP_DTYPES.items():
        if np.dtype(dtype) == nd:
            return td
    raise ValueError(f"to_torch_mxfp8: source dtype {dtype} is not float32 or bfloat16")


def to_torch_mxfp8(
    t: MXFP8Tensor, *, transport: Fp8Transport | str | None = None
) -> TorchMXFP8Tensor:
    """Zero-copy: every present plane of ``t`` as a native-float8 Torch tensor at the same address.

    Use ``.view(torch.uint8)`` on a plane for the byte view FSDP buffers use.
    """
    if not isinstance(t, MXFP8Tensor):
        raise TypeError(f"to_torch_mxfp8: expected an MXFP8Tensor, got {type(t).__name__}")
    planes = {
        p: PlaneData(*(to_torch(a, transport=transport) for a in pair))
        for p, pair in t.planes.items()
    }
    return TorchMXFP8Tensor(planes, shape=t.shape, dtype=_torch_hp_dtype(t.dtype))
