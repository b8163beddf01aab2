"""Which elements of a group buffer a rank accounts for, so that a sum over ranks counts every
parameter element exactly once whatever the strategy (telemetry counts, step digests).

A group buffer (``main``, ``main_grad``, a model-weight plane) is either the rank's shard
(``layout.shard_numel`` elements) or the full replicated buffer (``layout.padded_numel``). In
both cases rank r accounts for the pieces of its shard range, ``layout.owned(r)``: read from
the shard itself, or from the same range of the full buffer. So the ranks split a replicated
buffer among themselves (as they would shard it) instead of each counting all of it, and the
padding between parameters is never read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torch_side.fsdp.flat_layout import FlatLayout, OwnedPiece

__all__ = ["SharePiece", "rank_share"]


class SharePiece(NamedTuple):
    piece: OwnedPiece  # slot_index and param_offset: where the elements sit in the parameter
    values: torch.Tensor  # 1-D view of the buffer: the piece's elements


def rank_share(buffer: torch.Tensor, layout: FlatLayout, rank: int) -> list[SharePiece]:
    """The pieces of ``buffer`` (shard or full, 1-D) that ``rank`` accounts for (module note)."""
    if buffer.numel() == layout.shard_numel:
        base = 0
    elif buffer.numel() == layout.padded_numel:
        base = layout.shard_range(rank)[0]
    else:
        raise AssertionError(
            f"buffer of {buffer.numel()} elements is neither a shard ({layout.shard_numel}) nor "
            f"the full buffer ({layout.padded_numel}) of its layout"
        )
    return [
        SharePiece(p, buffer[base + p.shard_offset : base + p.shard_offset + p.numel])
        for p in layout.owned(rank)
    ]
