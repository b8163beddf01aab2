"""Step digests and numerics telemetry on spawned ranks (cases_instruments.py), world sizes 1
and 2, strategies no_shard, optim and optim_grads_params; and the digest's chunking in one
process (no group): the sum over any world size's shards is the full tensor's digest."""

from __future__ import annotations

import pytest
import torch

from tests.torch_side import cases_instruments as ci
from tests.torch_side.conftest import check_case
from torch_side.fsdp.flat_layout import FlatLayout
from torch_side.instruments.rank_share import rank_share
from torch_side.instruments.step_digest import chunk_sum, full_tensor_digest

_STRATEGIES = [s if s in ci.FAST else pytest.param(s, marks=pytest.mark.slow)
               for s in ci.STRATEGIES]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_digest_is_the_full_tensor_digest(spawned, strategy, world_size):
    check_case(spawned, ci, getattr(ci, f"case_digest_{strategy}"), world_size)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_telemetry_matches_the_full_planes(spawned, strategy, world_size):
    check_case(spawned, ci, getattr(ci, f"case_telemetry_{strategy}"), world_size)


SHAPES = [(96, 64), (64,), (64, 96), (8, 64), (3,)]


def _sharded_digest(values, world_size: int, *, replicated: bool) -> int:
    """The digest the ranks of a world would sum: each rank hashes the pieces it accounts for,
    from its shard (or its range of the replicated full buffer)."""
    layout = FlatLayout.build([str(i) for i in range(len(values))], SHAPES, world_size)
    full = torch.zeros(layout.padded_numel)
    for s, v in zip(layout.slots, values, strict=True):
        full[s.start:s.end] = v.reshape(-1)
    total = 0
    for r in range(world_size):
        buf = full if replicated else full[slice(*layout.shard_range(r))]
        for sp in rank_share(buf, layout, r):
            total += chunk_sum(sp.values, sp.piece.slot_index, sp.piece.param_offset,
                               layout.unit)
    return total % (1 << 64), layout.unit


def test_a_digest_does_not_depend_on_the_world_size_or_the_strategy():
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=g) for s in SHAPES]
    want, unit = _sharded_digest(values, 1, replicated=False)
    assert want == full_tensor_digest(values, unit)
    for world in (2, 3, 4, 8):
        assert _sharded_digest(values, world, replicated=False)[0] == want, world
        assert _sharded_digest(values, world, replicated=True)[0] == want, world
    values[3][5, 7] = torch.nextafter(values[3][5, 7], torch.tensor(1.0))  # one ulp, one element
    assert _sharded_digest(values, 4, replicated=False)[0] != want
    swapped = [values[0], values[2].reshape(96, 64), values[1]]  # position matters (the salt)
    assert full_tensor_digest(swapped, unit) != full_tensor_digest(values[:3], unit)


def test_telemetry_refuses_bf16_gathered_groups_by_name(single_rank_world):
    from tests.torch_side.toy_models import make_net
    from torch_side import MixedPrecisionPolicy, fully_shard
    from torch_side.instruments.numerics_telemetry import NumericsTelemetry

    net = make_net(0)
    model = fully_shard(net, unit_modules=(type(net.blocks[0]),),
                        policy=MixedPrecisionPolicy(gather="bf16"))
    with pytest.raises(ValueError, match=r"gather bf16 weights.*--gather mxfp8"):
        NumericsTelemetry(model)
