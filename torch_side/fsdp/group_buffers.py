"""``GroupBuffers``: the persistent buffers of one parameter group and their pieces.

Tensors owned (DESIGN.md 5 glossary; every buffer uses the group's ``FlatLayout``):

- **main weight** (``main``): fp32, the rank's shard (or the full buffer under ``no_shard``);
  the optimizer updates it. ``pieces()`` says which parts of which parameters it holds.
- **model weight buffers** (``model[plane]``), one per plane of the group's format
  (``common.formats.FORMATS``): MXFP8 has a rowwise and a **columnwise** (transpose) plane of
  uint8 bytes, fp32/bf16 one (rowwise) plane holding the weights. The rank's shard under ZeRO-3,
  else the full replicated buffer.
- **scale tensors** (``scales[plane][i]``, shaped by the format's ``ScaleBlocks``; MXFP8:
  rowwise (M, K/32), columnwise (M/32, K), uint8): full and replicated, recomputed identically by
  every rank at each quantization (with block-atomic shards each rank computes its own blocks'
  and the buffers are all-gathered: ``flat_layout``'s note); views of one flat buffer per plane
  (``scale_buffers``, parameter i at ``scale_offsets[i]``).
- **main grad** (``main_grad``): the reduced gradient, shard (ZeRO-2/3) or full, policy dtype;
  None for a group that takes no gradients.

The temporary buckets (all-gathered planes, staged gradients) are not here: ``PlaneBucket`` and
``GradReducer`` own them. ``refresh`` rewrites the model weights and scales from ``main``
through the group's ``WeightCodec``, which sees only a ``CodecContext`` of these buffers;
``refresh_from`` writes bytes that a batched quantization of several groups made
(``torch_side.fsdp.batched_refresh``). A codec whose images are its own each call
(``BlockScaledCodec.fresh_images``: MXFP8) has them kept, not copied, where only the gathers read
the buffers: ZeRO-3's model shards are rebound to the images, ZeRO-1/2's staged gathers send
them (docs/fsdp.md, "Batched refresh").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from common.formats import Plane
from common.kernels import KernelConfig
from torch_side.comm.collectives import Communicator, Phase
from torch_side.fsdp.distributed_quantize import GroupImages
from torch_side.fsdp.flat_layout import FlatLayout, OwnedPiece
from torch_side.fsdp.meta_init import ParamInit
from torch_side.fsdp.strategy import StrategyFacts
from torch_side.fsdp.weight_codecs import BlockScaledCodec, CodecContext, WeightCodec

__all__ = ["GroupBuffers"]


class GroupBuffers:
    def __init__(
        self,
        label: str,
        layout: FlatLayout,
        facts: StrategyFacts,
        codec: WeightCodec,
        comm: Communicator,
        main_grad_dtype: torch.dtype | None,
        device: torch.device,
        kernels: KernelConfig | None = None,
    ):
        """main_grad_dtype: the policy's main-grad dtype, or None for a group without grads."""
        self.label, self.layout, self.facts, self.codec = label, layout, facts, codec
        self.comm, self.device, self.kernels = comm, device, kernels
        self.main = torch.zeros(
            self._local(facts.main_weights_sharded), dtype=torch.float32, device=device
        )
        n = self._local(facts.model_weights_sharded)
        self.model: dict[Plane, torch.Tensor] = {
            p: torch.zeros(n, dtype=codec.buffer_dtype, device=device) for p in codec.planes
        }
        self.main_grad: torch.Tensor | None = None
        if main_grad_dtype is not None:
            self.main_grad = torch.zeros(
                self._local(facts.grads_sharded), dtype=main_grad_dtype, device=device
            )
        # block-atomic shards: scales laid out like the group / block size (flat_layout's note)
        rb = layout.row_block
        placed = (None if rb == 1 else
                  ([s.start // rb for s in layout.slots], layout.padded_numel // rb))
        scales = codec.make_scales([s.shape for s in layout.slots], device, placed)
        self.scales, self.scale_buffers, self.scale_offsets = (
            scales.views, scales.buffers, scales.offsets
        )
        # Set by torch_side.instruments.numerics_telemetry: sees each refresh's reduced block amax.
        self.amax_observer: Callable[[torch.Tensor], None] | None = None

    def _local(self, sharded: bool) -> int:
        return self.layout.shard_numel if sharded else self.layout.padded_numel

    def pieces(self) -> list[OwnedPiece]:
        """Pieces of parameters held in ``main`` (offsets into ``main``)."""
        if self.facts.main_weights_sharded:
            return self.layout.owned(self.comm.rank)
        return [OwnedPiece(i, 0, s.start, s.numel) for i, s in enumerate(self.layout.slots)]

    def _main_grad(self) -> torch.Tensor:
        if self.main_grad is None:
            raise AssertionError(f"group {self.label!r} takes no gradients (no main_grad)")
        return self.main_grad

    def grad_for_optimizer(self) -> torch.Tensor:
        """The part of ``main_grad`` that matches ``main`` (fp32 view or copy)."""
        g = self._main_grad()
        if self.facts.main_weights_sharded and not self.facts.grads_sharded:
            lo, hi = self.layout.shard_range(self.comm.rank)
            g = g[lo:hi]
        return g if g.dtype == torch.float32 else g.float()

    def load_main(self, full_values: list[torch.Tensor]) -> None:
        """main <- fp32 of the owned parts of each parameter's full value (one per slot)."""
        for p in self.pieces():
            src = full_values[p.slot_index].detach().reshape(-1)
            self.main[p.shard_offset : p.shard_offset + p.numel].copy_(
                src[p.param_offset : p.param_offset + p.numel].to(torch.float32)
            )

    def load_main_pieces(self, init: ParamInit) -> None:
        """main <- ``init``'s values of the owned pieces, written in place (nothing full)."""
        for p in self.pieces():
            slot = self.layout.slots[p.slot_index]
            init.fill(slot.name, tuple(slot.shape), p.param_offset,
                      self.main[p.shard_offset : p.shard_offset + p.numel])

    def codec_context(self) -> CodecContext:
        """The narrow view of these buffers that ``WeightCodec.fill`` works on."""
        return CodecContext(
            label=self.label,
            main=self.main,
            shapes=[s.shape for s in self.layout.slots],
            owned=self.pieces(),
            scales=self.scales,
            comm=self.comm,
            main_sharded=self.facts.main_weights_sharded,
            kernels=self.kernels,
            amax_observer=self.amax_observer,
            scale_buffers=self.scale_buffers,
            scale_offsets=self.scale_offsets,
            scale_shard=self._scale_shard(),
        )

    def _scale_shard(self) -> tuple[int, int] | None:
        """This rank's slice of each scale buffer under block-atomic shards of a sharded main
        (its own blocks' scales, ``CodecContext.scale_shard``); None otherwise."""
        rb = self.layout.row_block
        if (rb == 1 or not self.facts.main_weights_sharded
                or not isinstance(self.codec, BlockScaledCodec)):
            return None
        lo, hi = self.layout.shard_range(self.comm.rank)
        return lo // rb, hi // rb

    def refresh(self, phase: Phase) -> None:
        """Model weight buffers (and scales) from ``main``; all-gathered where replicated."""
        if _adopts(self):  # the codec's own quantization, its images then kept (refresh_from)
            assert isinstance(self.codec, BlockScaledCodec), self.codec
            made = self.codec.quantize_batch([self.codec_context()], phase, f"{self.label}/amax")
            self.refresh_from(made.images[0], made.amax[0], phase)
            return
        targets = self._targets()
        self.codec.fill(self.codec_context(), targets, phase)
        self._publish(targets, phase)

    def refresh_from(self, images: GroupImages, amax: torch.Tensor, phase: Phase) -> None:
        """``refresh`` of a block-scaled group whose bytes a batched quantization made
        (``torch_side.fsdp.batched_refresh``): the codec's copies (and the telemetry's amax slice),
        then the all-gathers where replicated, as ``refresh`` does. Where the group adopts its
        images (``_adopts``), the planes' images are not copied: under ZeRO-3 they become the
        model buffers, under ZeRO-1/2 they are what each rank's staged gather sends."""
        assert isinstance(self.codec, BlockScaledCodec), self.codec  # batched: block-scaled
        adopt = _adopts(self)
        targets: dict[Plane, torch.Tensor | None] = (
            dict.fromkeys(self.codec.planes) if adopt else dict(self._targets()))
        written = self.codec.write_images(self.codec_context(), images, amax, targets, phase)
        if adopt:
            for p, t in written.items():
                _check_image(self, p, t)
                if not self._staged():
                    self.model[p] = t  # the old buffer goes when nothing else holds it
        self._publish(written, phase)

    def _staged(self) -> bool:
        return self.facts.main_weights_sharded and not self.facts.model_weights_sharded

    def _targets(self) -> dict[Plane, torch.Tensor]:
        """Local targets: the model buffers themselves, or shard staging areas then gathered."""
        staged = self._staged()
        return {
            p: torch.zeros_like(self.main, dtype=self.codec.buffer_dtype) if staged
            else self.model[p]
            for p in self.codec.planes
        }

    def _publish(self, targets: Mapping[Plane, torch.Tensor], phase: Phase) -> None:
        if self._staged():
            for p in self.codec.planes:
                label = f"{self.label}/{'model' if p is Plane.ROWWISE else p.value}"
                self.comm.all_gather(self.model[p], targets[p], phase, label)

    def full_main(self, phase: Phase = Phase.STATE) -> torch.Tensor:
        """The full padded fp32 main weights (all-gathered when sharded)."""
        if not self.facts.main_weights_sharded:
            return self.main.clone()
        full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        self.comm.all_gather(full, self.main, phase, f"{self.label}/main")
        return full

    def full_main_grad(self, phase: Phase = Phase.STATE) -> torch.Tensor:
        """The full padded reduced gradient (all-gathered when sharded), in its policy dtype."""
        grad = self._main_grad()
        if not self.facts.grads_sharded:
            return grad.clone()
        full = torch.empty(self.layout.padded_numel, dtype=grad.dtype, device=self.device)
        self.comm.all_gather(full, grad, phase, f"{self.label}/main_grad")
        return full


def _adopts(b: GroupBuffers) -> bool:
    """Whether a refresh keeps the codec's images instead of copying them
    (``BlockScaledCodec.fresh_images``): for buffers that only the gathers read, ZeRO-3's model
    shards (``PlaneBucket`` reads ``model`` at each gather) and ZeRO-1/2's staging areas.
    Replicated buffers are written in place: module parameters (fp32/bf16 formats) and JAX's
    shares (``PlaneBucket.shared_data``) point at them."""
    return (isinstance(b.codec, BlockScaledCodec) and b.codec.fresh_images
            and (b.facts.model_weights_sharded or b._staged()))


def _check_image(b: GroupBuffers, plane: Plane, t: torch.Tensor) -> None:
    """An image kept as a buffer must be laid out as that buffer (1-D, ``main``'s length,
    contiguous, the codec's buffer dtype, on ``main``'s device: ``cuda:0`` where the group
    was given ``cuda``)."""
    n, dtype, device = b.main.numel(), b.codec.buffer_dtype, b.main.device
    if (t.dim() != 1 or t.numel() != n or t.dtype != dtype or t.device != device
            or not t.is_contiguous()):
        raise RuntimeError(
            f"group {b.label!r}: {type(b.codec).__name__}.quantize_images returned a "
            f"{plane.value} image of shape {tuple(t.shape)}, {t.dtype} on {t.device} "
            f"(contiguous: {t.is_contiguous()}); a group keeps its images as its buffers, "
            f"which needs a contiguous 1-D {dtype} tensor of {n} elements on {device}. "
            f"Return images laid out like the main weights, or set the codec's "
            f"fresh_images = False to have them copied"
        )
