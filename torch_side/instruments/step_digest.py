"""Step digests: 64-bit hashes of a wrapped model's state that do not depend on the world size.

Per parameter group (by its label) and tensor (``DigestTensor``): the fp32 main weights
(``main``), the reduced gradient (``grad``, in the policy's main-grad dtype), the model-weight
planes (``rowwise`` -- the bf16/fp32 weights of a non-MXFP8 group --, ``colwise``) and the E8M0
scales of each MXFP8 plane (``rowwise_scale``, ``colwise_scale``). Padding is never hashed.

**Layout independence.** A group's flat layout starts every parameter and every shard boundary at
a multiple of its unit U (``FlatLayout``: U = lcm(256, row sizes), a property of the group's
parameters, not of the world size). So each parameter's flat elements split into chunks of U
elements (the last one shorter) that no shard ever cuts, at any world size. Each chunk is hashed
with ``blake2b(digest_size=8, salt=(slot, chunk index))`` and a tensor's digest is the sum of its
chunks' hashes modulo 2**64: each rank sums the chunks it accounts for (``rank_share``: its shard,
or its shard's range of a replicated buffer), one ``all_gather`` of those partial sums (8 bytes
per group and tensor per rank) adds them up, and the result is the same number as
``full_tensor_digest`` of the full tensors in one process. The same values at world size 1, 2 or
8, under any strategy, give the same digest; a changed chunk changes it except with probability
2**-64 (the chunk hashes of different positions are independent: the salt). The replicated scales
are hashed whole per parameter by the group's rank 0.

Expert groups hash over their expert-DP group and the sums run over the whole DP group: the
result is deterministic but depends on how experts are placed, so it is comparable between runs
with the same expert layout only.

**Cost.** Every byte hashed goes to the host (a device-to-host copy on GPU) and through blake2b
(~1 GB/s per core): about 10.5 bytes per parameter per step for MXFP8 weights (4 main, 4 grad, 2
planes, 1/16 scales) split over the ranks. A debugging instrument, not for timed runs.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterable, Sequence

import torch

from common.formats import Plane
from torch_side.comm.collectives import Phase
from torch_side.fsdp.fsdp_model import FSDPModel
from torch_side.fsdp.param_group import ParamGroup
from torch_side.instruments.rank_share import rank_share

__all__ = [
    "GRAD_TENSORS",
    "STATE_TENSORS",
    "DigestTensor",
    "Partials",
    "chunk_sum",
    "combine",
    "full_tensor_digest",
    "local_partials",
    "model_digest",
    "tensors_of",
]

_MOD = 1 << 64


class DigestTensor(enum.Enum):
    """A hashed tensor of a group (the keys of a digest record, in this order)."""

    MAIN = "main"
    GRAD = "grad"
    ROWWISE_SCALE = "rowwise_scale"
    ROWWISE = "rowwise"
    COLWISE_SCALE = "colwise_scale"
    COLWISE = "colwise"


GRAD_TENSORS = (DigestTensor.GRAD,)  # before the update (the optimizer consumes them)
STATE_TENSORS = (DigestTensor.MAIN, DigestTensor.ROWWISE_SCALE, DigestTensor.ROWWISE,
                 DigestTensor.COLWISE_SCALE, DigestTensor.COLWISE)
_PLANE = {DigestTensor.ROWWISE: Plane.ROWWISE, DigestTensor.COLWISE: Plane.COLWISE,
          DigestTensor.ROWWISE_SCALE: Plane.ROWWISE, DigestTensor.COLWISE_SCALE: Plane.COLWISE}

# (group label, tensor) -> this rank's partial sum, an int in [0, 2**64)
Partials = dict[tuple[str, DigestTensor], int]


def _chunk_hash(data: bytes | memoryview, slot: int, chunk: int) -> int:
    h = hashlib.blake2b(data, digest_size=8, salt=struct.pack("<QQ", slot, chunk))
    return int.from_bytes(h.digest(), "little")


def chunk_sum(values: torch.Tensor, slot: int, param_offset: int, unit: int) -> int:
    """Sum mod 2**64 of the chunk hashes of ``values``: a 1-D run of parameter ``slot``'s flat
    elements starting at ``param_offset`` (a multiple of ``unit``, the chunk length)."""
    assert param_offset % unit == 0, (param_offset, unit)
    data = values.detach().contiguous().cpu().view(torch.uint8).numpy()
    step = unit * values.element_size()
    view = memoryview(data)
    first = param_offset // unit
    total = 0
    for i, lo in enumerate(range(0, len(data), step)):
        total += _chunk_hash(view[lo:lo + step], slot, first + i)
    return total % _MOD


def full_tensor_digest(values: Sequence[torch.Tensor], unit: int) -> int:
    """The digest of one tensor kind of a group from its full per-parameter values (in slot
    order), in one process: what ``model_digest`` computes distributed, at any world size."""
    return sum(chunk_sum(v.reshape(-1), i, 0, unit) for i, v in enumerate(values)) % _MOD


def tensors_of(g: ParamGroup) -> list[DigestTensor]:
    """The tensors a group has, in ``DigestTensor`` order."""
    out = []
    for t in DigestTensor:
        if t is DigestTensor.GRAD and g.main_grad is None:
            continue
        if t in _PLANE and _PLANE[t] not in g.model:
            continue
        if t.value.endswith("_scale") and not g.scale_buffers:
            continue
        out.append(t)
    return out


def _buffer_sum(g: ParamGroup, buffer: torch.Tensor) -> int:
    return sum(chunk_sum(s.values, s.piece.slot_index, s.piece.param_offset, g.layout.unit)
               for s in rank_share(buffer, g.layout, g.comm.rank)) % _MOD


def _partial(g: ParamGroup, t: DigestTensor) -> int:
    if t is DigestTensor.MAIN:
        return _buffer_sum(g, g.main)
    if t is DigestTensor.GRAD:
        grad = g.main_grad
        assert grad is not None, g.label  # tensors_of lists GRAD only where there is one
        return _buffer_sum(g, grad)
    if t.value.endswith("_scale"):  # replicated: the group's rank 0 hashes them whole
        if g.comm.rank != 0:
            return 0
        return sum(chunk_sum(v.reshape(-1), i, 0, v.numel() or 1)
                   for i, v in enumerate(g.scales[_PLANE[t]])) % _MOD
    return _buffer_sum(g, g.model[_PLANE[t]])


def local_partials(model: FSDPModel, tensors: Iterable[DigestTensor]) -> Partials:
    """This rank's partial sums of ``tensors`` of every group (no collective): take the gradient
    ones before the optimizer step consumes them, the state ones after it."""
    wanted = set(tensors)
    return {(g.label, t): _partial(g, t)
            for g in model.param_groups for t in tensors_of(g) if t in wanted}


def combine(model: FSDPModel, partials: Partials) -> dict[str, dict[str, str]]:
    """COLLECTIVE (every rank of the DP group, the same keys in the same order, e.g. the union of
    ``local_partials`` calls): the digests {group label: {tensor: 16 hex digits}}, on every rank.
    One all_gather of 8 bytes per key and rank."""
    keys = list(partials)
    comm = model.comms["dp"]
    device = model.param_groups[0].device if model.param_groups else torch.device("cpu")
    mine = torch.tensor([v - _MOD if v >= _MOD // 2 else v for v in partials.values()],
                        dtype=torch.int64, device=device)
    every = torch.empty(comm.world_size * len(keys), dtype=torch.int64, device=device)
    comm.all_gather(every, mine, Phase.STATE, "digest")
    sums = every.view(comm.world_size, len(keys)).cpu().tolist()
    out: dict[str, dict[str, str]] = {}
    for j, (label, t) in enumerate(keys):
        total = sum(row[j] for row in sums) % _MOD
        out.setdefault(label, {})[t.value] = f"{total:016x}"
    return out


def model_digest(
    model: FSDPModel, tensors: Iterable[DigestTensor] = STATE_TENSORS
) -> dict[str, dict[str, str]]:
    """COLLECTIVE: ``combine(model, local_partials(model, tensors))``."""
    return combine(model, local_partials(model, tensors))
