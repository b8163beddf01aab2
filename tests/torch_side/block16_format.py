"""A second block-scaled weight format, registered from the tests alone (issue 31, item 1).

The walkthrough of docs/extending.md ("A weight format"), performed: ``MXFP8_B16`` is MXFP8 with
16-element blocks (E4M3 elements, E8M0 scales, the RCEIL recipe of DESIGN.md 3, one scale per 16
consecutive elements: rowwise (M, K/16), columnwise (M/16, K)). Registering it takes the two
steps the guide names, and nothing else of the library changes:

1. its row of ``common.formats.FORMATS``: ``common.formats.register_format``;
2. its codec: ``Block16Codec``, a ``torch_side.fsdp.weight_codecs.BlockScaledCodec`` whose
   ``quantize_images`` emulates the numerics with the numpy oracle (``tests/oracle/mxfp8_ref``,
   block 16): partial block amax of bf16 of the owned elements, the injected amax reduction,
   scales and cast of the owned elements, in new tensors each call (``fresh_images``: a
   sharded group keeps them as its buffers). It enters ``torch_side.fsdp.weight_codecs.CODECS``.

The linear op and the unit programs read its planes by its ``ScaleBlocks``
(``jax_side.block_scaled``: E4M3 x E8M0 at any block size), so nothing is registered for them.
``registered()`` adds both entries and removes them again, so no other test sees the format;
``quantize_whole`` is the reference: the format quantized whole on one rank; ``OraclePlanes``
hands such planes to an ``MXFP8Linear`` outside FSDP (the replicated reference model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from bridge import MXFP8Linear
from common.formats import ALL_PLANES, FORMATS, FormatSpec, Plane, ScaleBlocks, register_format
from tests.oracle import mxfp8_ref as ref
from torch_side.fsdp.distributed_quantize import BatchImages, GroupImages
from torch_side.fsdp.weight_codecs import CODECS, BlockScaledCodec

VALUE = "mxfp8_b16"
BLOCK = 16
ROW = FormatSpec("uint8", "bfloat16", ALL_PLANES,
                 ScaleBlocks("float8_e4m3fn", "float8_e8m0fnu", BLOCK, 448.0))


def _full_image(main: np.ndarray, piece) -> np.ndarray:
    """The (M, K) tensor holding a piece's owned elements, zeros elsewhere (fp32)."""
    m, k = piece.shape
    x = np.zeros(m * k, np.float32)
    x[piece.start:piece.start + piece.numel] = main[piece.offset:piece.offset + piece.numel]
    return x.reshape(m, k)


class Block16Codec(BlockScaledCodec):
    """``MXFP8_B16``'s numerics, emulated on the host with the numpy oracle (module note)."""

    fresh_images = True  # new tensors per call, kept by nothing else

    def quantize_images(self, mains, pieces, reduce_max, device, layouts, kernels) -> BatchImages:
        src = [m.detach().to(torch.bfloat16).float().cpu().numpy() for m in mains]
        owned = [[_full_image(s, p) for p in ps] for s, ps in zip(src, pieces, strict=True)]
        packed = np.concatenate([a.reshape(-1) for xs in owned for x in xs
                                 for a in ref.block_amax(x, BLOCK)] or [np.zeros(0, np.float32)])
        packed = torch.from_numpy(packed).to(device)
        reduce_max(packed)  # the one all-reduce MAX over the ranks (BlockScaledCodec)
        reduced, at, images, amax = packed.cpu().numpy(), 0, [], []
        for main, xs, ps, layout in zip(mains, owned, pieces, layouts, strict=True):
            first = at
            data = {p: np.zeros(main.numel(), np.uint8) for p in ALL_PLANES}
            scales = {p: np.zeros(layout.total, np.uint8) for p in ALL_PLANES}
            for x, p, offset in zip(xs, ps, layout.offsets, strict=True):
                n = self.blocks.scale_numel(p.shape)
                for k, plane in enumerate(ALL_PLANES):
                    s = ref.scale_bytes(reduced[at + k * n:at + (k + 1) * n]).reshape(
                        self.blocks.scale_shape(p.shape, plane))
                    scales[plane][offset:offset + n] = s.reshape(-1)
                    axis = 1 if plane is Plane.ROWWISE else 0
                    cast = ref.cast_elements(x, np.repeat(s, BLOCK, axis=axis)).reshape(-1)
                    data[plane][p.offset:p.offset + p.numel] = cast[p.start:p.start + p.numel]
                at += 2 * n
            images.append(GroupImages(*(torch.from_numpy(a).to(device) for a in (
                data[Plane.ROWWISE], data[Plane.COLWISE],
                scales[Plane.ROWWISE], scales[Plane.COLWISE]))))
            amax.append(packed[first:at])
        return BatchImages(images, amax)


@contextlib.contextmanager
def registered() -> Iterator[object]:
    """``MXFP8_B16`` in ``FORMATS`` and ``CODECS`` inside the block (yields its format key)."""
    fmt = register_format(VALUE, ROW)
    CODECS[fmt] = Block16Codec
    try:
        yield fmt
    finally:
        del CODECS[fmt], FORMATS[fmt]


def quantize_whole(w: torch.Tensor) -> dict[Plane, tuple[torch.Tensor, torch.Tensor]]:
    """{plane: (data (M, K) uint8, scale uint8)} of ``bf16(w)`` quantized whole on one rank."""
    q = ref.quantize(w.detach().to(torch.bfloat16).float().cpu().numpy(), block=BLOCK)
    return {p: (torch.from_numpy(q[f"{p.value}_data"]), torch.from_numpy(q[f"{p.value}_scale"]))
            for p in ALL_PLANES}


class OraclePlanes:
    """``bridge.MXFP8WeightPlanes`` of a whole weight in ``MXFP8_B16`` (``blocks`` says so)."""

    blocks = ROW.blocks

    def __init__(self, w: torch.Tensor):
        self.shape, self.planes = tuple(w.shape), quantize_whole(w)

    def rowwise(self):
        return self.planes[Plane.ROWWISE]

    def colwise(self):
        return self.planes[Plane.COLWISE]


def read_planes_from_oracle(model: nn.Module) -> list:
    """Make every ``MXFP8Linear`` of a plain (replicated) model read ``OraclePlanes`` of its
    current weight, as FSDP injects its planes; returns the hook handles."""
    def inject(module, args, kwargs):
        return args, {**kwargs, "weight_planes": OraclePlanes(module.weight)}

    return [m.register_forward_pre_hook(inject, with_kwargs=True)
            for m in model.modules() if isinstance(m, MXFP8Linear)]
