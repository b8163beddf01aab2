"""``refresh_groups``: the model weights of many groups from their main weights, block-scaled
groups batched.

Every refresh of an ``FSDPModel`` (the optimizer step, the wrap, ``load_full_state_dict`` and
sharded-state loads) goes through here. The host cost of the distributed quantization
(DESIGN.md 5) is a fixed handful of JAX programs, crossings and one collective per call, so a
model's block-scaled groups are quantized together: the groups whose codecs give the same
``WeightCodec.batch_key`` (a ``BlockScaledCodec``: its format and source dtype) and that share
a communicator ("dp" or "expert_dp"), device and kernels form one **batch** (shown for MXFP8,
whose codec runs ``bridge.mxfp8_slices``; another format's ``quantize_images`` does its own
numerics between the same collective):

1. one program computes the packed partial amax of every group of the batch (each group's main
   shard crosses to JAX once), one crossing back;
2. ONE ``all_reduce(MAX)`` of the batch's concatenated packed amax on the communicator, labelled
   ``"*/<format>/<communicator name>/amax"`` (e.g. ``"*/mxfp8_e4m3/dp/amax"``: a group label
   with ``*`` for the unit; numel: the sum of the groups' packed amax), issued when some group of
   the batch holds a sharded main (not with block-atomic shards, whose owners make their blocks'
   scales: step 4 all-gathers those instead, ``BlockScaledCodec.write_images``);
3. one program turns the reduced amax into every group's scales and bytes (one crossing each
   way), as images of each group's buffers;
4. per group, in ``param_groups`` order: its four ``copy_`` (``GroupBuffers.refresh_from``), its
   amax slice to the telemetry observer, and under ZeRO-1/2 the all-gathers of its staged
   shards, exactly as the per-group refresh does.

The bytes are identical to the per-group refresh (``bridge.mxfp8_slices``: each group's part is the
single-group program). A batch of one group, and every codec without a batch key (cast formats, the
``BF16GatherCodec``), refreshes alone (``GroupBuffers.refresh``; its amax all-reduce is labelled
``"<group label>/amax"``). Collective order, the same on every rank: each batch's amax all-reduce
when the walk over the groups (``param_groups`` order) reaches the batch's first group, then each
group's own collectives at its turn. Memory: a batch's images (2 bytes per element of the batch's
main shards, plus scales) live until its last group is written.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch_side.comm.collectives import Phase
from torch_side.fsdp.distributed_quantize import BatchImages
from torch_side.fsdp.param_group import ParamGroup
from torch_side.fsdp.weight_codecs import BlockScaledCodec

__all__ = ["refresh_groups"]


def _batches(groups: Sequence[ParamGroup]) -> dict[int, list[int]]:
    """{index of a batch's first group: indices of its groups}, for batches of two or more."""
    by_key: dict[object, list[int]] = {}
    for i, g in enumerate(groups):
        key = g.refresh_key()
        if key is not None:
            by_key.setdefault(key, []).append(i)
    return {members[0]: members for members in by_key.values() if len(members) > 1}


def _quantize(groups: list[ParamGroup], phase: Phase) -> BatchImages:
    first = groups[0]
    codec = first.codec
    assert isinstance(codec, BlockScaledCodec), codec  # only these give a refresh_key
    ctxs = [g.codec_context() for g in groups]
    label = f"*/{codec.format.value}/{first.comm.name}/amax"  # "*": every unit's group
    return codec.quantize_batch(ctxs, phase, label)


def refresh_groups(groups: Sequence[ParamGroup], phase: Phase) -> None:
    """Model weight buffers (and scales) of ``groups`` from their main weights, block-scaled
    groups in batches (module note). Every rank must pass the same groups in the same order
    (collectives). Every plane of every group must be out of its bucket: all groups are checked
    before any is changed (``ParamGroup.expect_refreshable``)."""
    for g in groups:
        g.expect_refreshable()
    for g in groups:
        # The scale buffers and replicated planes are rewritten in place; their JAX shares stay
        # valid (bridge/shared.py, "Reuse across in-place rewrites"). Locally quantized planes
        # (BF16GatherCodec) would be stale.
        g.drop_quantized()
    batches = _batches(groups)
    pending: dict[int, tuple[BatchImages, int]] = {}  # group index -> (its batch's bytes, slot)
    for i, g in enumerate(groups):
        if i in batches:
            made = _quantize([groups[j] for j in batches[i]], phase)
            pending.update({j: (made, k) for k, j in enumerate(batches[i])})
        if i not in pending:
            g.refresh(phase)
            continue
        made, k = pending.pop(i)
        g.refresh_from(made.images[k], made.amax[k], phase)
