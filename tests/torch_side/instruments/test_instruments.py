"""Step digests and numerics telemetry against full-tensor references, on every rank of an
in-process world (``threaded_world.py``), world sizes 1 and 2, strategies no_shard, optim and
optim_grads_params (the first two marked slow: fast-suite budget); and the digest's chunking in
one process (no group): the sum over any world size's shards is the full tensor's digest.

- ``torch_side.instruments.step_digest``: the distributed digest of every group's gradient,
  main weights, planes and scales equals ``full_tensor_digest`` of the full tensors
  (``full_grads``, ``full_state_dict``, ``gathered_weights``) computed in one process -- so it is
  the same number at every world size and strategy -- and every rank gets it.
- ``torch_side.instruments.numerics_telemetry``: the reduced zero / subnormal counts, the scale
  histograms, the changed-block counts and the amax headroom equal those computed from the full
  gathered planes, scales and bf16(main weights) (every element counted once: replicated buffers
  under ``no_shard`` / ``optim`` are split among the ranks, not counted DP times).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from common.formats import Plane
from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import FSDPOptimizer, ShardingStrategy, fully_shard
from torch_side.fsdp.flat_layout import FlatLayout
from torch_side.instruments.numerics_telemetry import NumericsTelemetry
from torch_side.instruments.rank_share import rank_share
from torch_side.instruments.step_digest import (
    GRAD_TENSORS,
    STATE_TENSORS,
    chunk_sum,
    full_tensor_digest,
    model_digest,
)

T = 32


def _model(ctx, strategy):
    model = fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,), strategy=strategy)
    return model, FSDPOptimizer(model, torch.optim.AdamW, lr=1e-2)


def _backward(ctx, model) -> None:
    x, y = make_batch(7, T * ctx.world_size, ctx.device)
    rows = slice(ctx.rank * T, (ctx.rank + 1) * T)
    mse(model(x[rows]), y[rows]).backward()


def _same_on_every_rank(ctx, value) -> None:
    every = [None] * ctx.world_size
    dist.all_gather_object(every, value)
    assert all(v == every[0] for v in every), every


def _full_values(model) -> dict[str, dict[str, list[torch.Tensor]]]:
    """{group label: {tensor: full per-parameter values}} of the state tensors (collectives)."""
    main = model.full_state_dict()
    out = {}
    with model.gathered_weights() as weights:
        for g in model.param_groups:
            names = [s.name for s in g.layout.slots]
            d = out[g.label] = {"main": [main[n] for n in names]}
            for p in g.planes:
                w = [weights[n] for n in names]
                if g.scale_buffers:
                    d[p.value] = [x.plane(p).data.clone() for x in w]
                    d[f"{p.value}_scale"] = [x.plane(p).scale.clone() for x in w]
                else:
                    d[p.value] = [x.clone() for x in w]
    return out


def _digest_case(ctx, strategy: ShardingStrategy) -> None:
    model, opt = _model(ctx, strategy)
    _backward(ctx, model)
    grads = model_digest(model, GRAD_TENSORS)
    full = model.full_grads()
    trained = [g for g in model.param_groups if g.main_grad is not None]
    assert set(grads) == {g.label for g in trained} and len(trained) < len(model.param_groups)
    for g in trained:
        want = full_tensor_digest([full[s.name] for s in g.layout.slots], g.layout.unit)
        assert grads[g.label] == {"grad": f"{want:016x}"}, (g.label, grads[g.label], want)
    opt.step()
    state = model_digest(model, STATE_TENSORS)
    for label, tensors in _full_values(model).items():
        unit = next(g.layout.unit for g in model.param_groups if g.label == label)
        for t, values in tensors.items():
            if t.endswith("_scale"):  # hashed whole per parameter (one chunk each)
                want = sum(chunk_sum(v.reshape(-1), i, 0, v.numel())
                           for i, v in enumerate(values)) % (1 << 64)
            else:
                want = full_tensor_digest(values, unit)
            assert state[label][t] == f"{want:016x}", (label, t)
    _same_on_every_rank(ctx, (grads, state))


def _block_amax(w: torch.Tensor, plane: Plane) -> torch.Tensor:
    m, k = w.shape
    a = w.to(torch.bfloat16).float().abs()
    if plane is Plane.ROWWISE:
        return a.view(m, k // 32, 32).amax(-1).reshape(-1)
    return a.view(m // 32, 32, k).amax(1).reshape(-1)


def _telemetry_case(ctx, strategy: ShardingStrategy) -> None:
    model, opt = _model(ctx, strategy)
    tel = NumericsTelemetry(model)
    before = _full_values(model)
    _backward(ctx, model)
    opt.step()
    got = tel.collect()
    after, main = _full_values(model), model.full_state_dict()
    assert set(got) == {g.label for g in model.param_groups if g.scale_buffers}
    for g in model.param_groups:
        if not g.scale_buffers:
            continue
        for p in g.planes:
            s, key = got[g.label][p.value], f"{p.value}_scale"
            data = torch.cat([d.reshape(-1) for d in after[g.label][p.value]])
            scales = torch.cat([d.reshape(-1) for d in after[g.label][key]])
            old = torch.cat([d.reshape(-1) for d in before[g.label][key]])
            mag = data & 0x7F
            assert s.elements == data.numel() and s.blocks == scales.numel()
            assert s.zero == int((mag == 0).sum())
            assert s.subnormal == int(((mag > 0) & (mag < 8)).sum())
            hist = torch.bincount(scales.long(), minlength=256).tolist()
            assert s.scale_exponents == {b - 127: c for b, c in enumerate(hist[:255]) if c}
            assert s.changed_blocks == int((scales != old).sum()) > 0
            amax = torch.cat([_block_amax(main[sl.name], p) for sl in g.layout.slots]).double()
            h = math.log2(448) + scales.double() - 127 - torch.log2(amax)
            ok = amax > 0
            assert s.headroom.blocks == int(ok.sum()) and s.headroom.zero_blocks == int((~ok).sum())
            assert math.isclose(s.headroom.mean, float(h[ok].mean()), rel_tol=1e-6)
            assert math.isclose(s.headroom.min, float(h[ok].min()), abs_tol=1e-6)
            assert math.isclose(s.headroom.max, float(h[ok].max()), abs_tol=1e-6)
            assert 0 <= s.headroom.min <= s.headroom.max < 1  # RCEIL: normal blocks
    again = tel.collect()  # no quantization since: no headroom, no changed block
    assert all(s.headroom is None and s.changed_blocks == 0
               for planes in again.values() for s in planes.values())
    tel.close()
    _same_on_every_rank(ctx, got)


STRATEGIES = {"no_shard": ShardingStrategy.NO_SHARD, "optim": ShardingStrategy.OPTIM,
              "zero3": ShardingStrategy.OPTIM_GRADS_PARAMS}
FAST = ("zero3",)  # the other strategies run only under `make test-all` (fast-suite budget)
_STRATEGIES = [s if s in FAST else pytest.param(s, marks=pytest.mark.slow) for s in STRATEGIES]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_digest_is_the_full_tensor_digest(strategy, world_size):
    run_world(world_size, _digest_case, STRATEGIES[strategy])


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("strategy", _STRATEGIES)
def test_telemetry_matches_the_full_planes(strategy, world_size):
    run_world(world_size, _telemetry_case, STRATEGIES[strategy])


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
