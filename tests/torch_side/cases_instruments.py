"""Spawned-rank cases: step digests and numerics telemetry against full-tensor references.

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

import torch
import torch.distributed as dist

from common.formats import Plane
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import FSDPOptimizer, ShardingStrategy, fully_shard
from torch_side.instruments.numerics_telemetry import NumericsTelemetry
from torch_side.instruments.step_digest import (
    GRAD_TENSORS,
    STATE_TENSORS,
    chunk_sum,
    full_tensor_digest,
    model_digest,
)

T = 32
_M = __name__


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


def case_digest_no_shard(ctx):
    _digest_case(ctx, ShardingStrategy.NO_SHARD)


def case_digest_optim(ctx):
    _digest_case(ctx, ShardingStrategy.OPTIM)


def case_digest_zero3(ctx):
    _digest_case(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS)


def case_telemetry_no_shard(ctx):
    _telemetry_case(ctx, ShardingStrategy.NO_SHARD)


def case_telemetry_optim(ctx):
    _telemetry_case(ctx, ShardingStrategy.OPTIM)


def case_telemetry_zero3(ctx):
    _telemetry_case(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS)


STRATEGIES = ("no_shard", "optim", "zero3")
FAST = ("zero3",)  # the other strategies run only under `make test-all` (fast-suite budget)
CASES = {f"{_M}:case_{what}_{s}": (1, 2) for what in ("digest", "telemetry") for s in FAST}
SLOW_CASES = {f"{_M}:case_{what}_{s}": (1, 2) for what in ("digest", "telemetry")
              for s in STRATEGIES if s not in FAST}
