"""``GroupWeights``: the main-weight side of ``ParamGroup``'s public surface (a base class of it).

What the optimizer, the state dicts, the refresh of the model weights and the telemetry ask of a
group's persistent buffers, answered from its private ``GroupBuffers`` (``_buffers``):

- ``main`` (the fp32 main weight shard, the optimizer's parameter; on ``ParamGroup``),
  ``main_pieces``, ``load_main_from``, ``full_main``;
- the refresh of the model weight buffers from ``main``: ``refresh`` (one group alone), or
  ``refresh_key`` / ``codec_context`` / ``refresh_from`` for ``torch_side.fsdp.batched_refresh``,
  which quantizes groups with equal keys together;
- ``observe_amax``: who sees each refresh's reduced block amax (``numerics_telemetry``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from common.kernels import KernelConfig
from torch_side.comm.collectives import Communicator, Phase
from torch_side.fsdp.distributed_quantize import GroupImages
from torch_side.fsdp.flat_layout import OwnedPiece
from torch_side.fsdp.group_buffers import GroupBuffers
from torch_side.fsdp.meta_init import ParamInit
from torch_side.fsdp.weight_codecs import CodecContext, WeightCodec

__all__ = ["GroupWeights"]


class GroupWeights:
    label: str
    codec: WeightCodec
    comm: Communicator
    device: torch.device
    kernels: KernelConfig | None
    _buffers: GroupBuffers

    def main_pieces(self) -> list[OwnedPiece]:
        """Pieces of parameters held in ``main`` (offsets into ``main``)."""
        return self._buffers.pieces()

    def load_main_from(self, full_values: list[torch.Tensor]) -> None:
        """main <- fp32 of the owned parts of each parameter's full value (one per slot)."""
        self._buffers.load_main(full_values)

    def load_main_pieces(self, init: ParamInit) -> None:
        """main <- ``init``'s values of the owned pieces of each parameter (a model built on the
        meta device: ``torch_side.fsdp.meta_init``)."""
        self._buffers.load_main_pieces(init)

    def full_main(self, phase: Phase = Phase.STATE) -> torch.Tensor:
        """The full padded fp32 main weights (all-gathered when sharded)."""
        return self._buffers.full_main(phase)

    def refresh(self, phase: Phase) -> None:
        """Model weight buffers (and scales) from ``main``, this group alone (the caller makes
        sure no plane is in its bucket: ``torch_side.fsdp.batched_refresh``)."""
        self._buffers.refresh(phase)

    def refresh_key(self) -> Hashable | None:
        """Groups with equal keys are quantized together (``torch_side.fsdp.batched_refresh``);
        None: the group refreshes alone."""
        key = self.codec.batch_key()
        return None if key is None else (key, id(self.comm), self.device, self.kernels)

    def codec_context(self) -> CodecContext:
        """The view of the group's buffers a batched quantization reads (``WeightCodec``)."""
        return self._buffers.codec_context()

    def refresh_from(self, images: GroupImages, amax: torch.Tensor, phase: Phase) -> None:
        """``refresh`` from the bytes a batched quantization made (``GroupBuffers``)."""
        self._buffers.refresh_from(images, amax, phase)

    def observe_amax(self, observer: Callable[[torch.Tensor], None] | None) -> None:
        """Show each later refresh's reduced packed block amax to ``observer`` (None: stop)."""
        self._buffers.amax_observer = observer
