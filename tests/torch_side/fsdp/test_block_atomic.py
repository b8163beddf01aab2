"""Block-atomic MXFP8 shards (``MixedPrecisionPolicy(shard_layout=ShardLayout.BLOCK_ATOMIC)``,
``torch_side.fsdp.flat_layout``) beside today's LCM layout:

- the layout: no shard boundary splits 32 rows of any parameter of a block-scaled group (GPT
  shapes at world sizes 2-64), where the LCM layout does split columnwise scale blocks;
- training matches the replicated reference with block-atomic shards, every strategy (world 2;
  ZeRO-3 also at 4; at 3 ranks Adam amplifies the rounding of gradients divided by 3 beyond the
  reference's tolerance, in either layout);
- the distributed quantization writes the same bytes in both layouts: the gathered MXFP8 planes
  and scales of one model wrapped both ways are identical, before and after a step; with
  block-atomic shards each rank makes its own blocks' scales and the scale buffers are
  all-gathered (uint8, a 32nd of the shard per plane) instead of all-reducing the fp32 amax,
  unless telemetry reads every block's amax (then reduced, and its report is the same);
- checkpoints convert: saved in one layout at one world size, loaded in the other at another,
  with the same main weights and optimizer state.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from common.model_config import GPT2_124M
from tests.torch_side.fsdp.full_state import full_optimizer_state
from tests.torch_side.test_training_parity import _train_and_compare
from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import (
    Collective,
    FlatLayout,
    FSDPOptimizer,
    MixedPrecisionPolicy,
    ShardingStrategy,
    ShardLayout,
    fully_shard,
)
from torch_side.fsdp.flat_layout import LayoutError, check_layout
from torch_side.fsdp.sharded_state import load_parts, save_parts
from torch_side.instruments.numerics_telemetry import NumericsTelemetry

BLOCK = 32
T = 32


def _split_blocks(layout: FlatLayout) -> list[tuple[str, int]]:
    """(parameter, row) of every shard boundary that falls inside a 32-row block."""
    out = []
    for r in range(1, layout.world_size):
        b = r * layout.shard_numel
        for s in layout.slots:
            if s.start < b < s.end and (b - s.start) % (BLOCK * s.row_size):
                out.append((s.name, (b - s.start) // s.row_size))
    return out


def _gpt_block_group() -> tuple[list[str], list[tuple[int, ...]]]:
    shapes = GPT2_124M.linear_shapes()
    names = [n for n in shapes if n.startswith("h_0.")]
    return names, [tuple(shapes[n]) for n in names]


@pytest.mark.parametrize("world", [2, 3, 4, 8, 16, 64])
def test_block_atomic_boundaries_never_split_a_scale_block(world):
    names, shapes = _gpt_block_group()
    layout = FlatLayout.build(names, shapes, world, row_block=BLOCK)
    assert _split_blocks(layout) == []
    assert layout.unit % (BLOCK * 768) == 0


def test_the_lcm_layout_does_split_scale_blocks_and_the_checker_names_it():
    """Why the option exists: with rows whole only, some boundary cuts a 32-row block; the
    layout checker refuses that layout when it claims whole blocks."""
    names, shapes = _gpt_block_group()
    split = [w for w in (2, 3, 4, 8, 16, 64) if _split_blocks(FlatLayout.build(names, shapes, w))]
    assert split, "the LCM layout kept every scale block whole at every world size"
    lcm = FlatLayout.build(names, shapes, split[0])
    check_layout(lcm)  # rows whole: fine
    with pytest.raises(LayoutError, match="splits a block of 32 rows of (768|3072) elements"):
        check_layout(dataclasses.replace(lcm, row_block=BLOCK))
    check_layout(FlatLayout.build(names, shapes, split[0], row_block=BLOCK))


def test_the_policy_parses_and_refuses_layouts_by_name():
    assert MixedPrecisionPolicy(shard_layout="block_atomic").shard_layout is (
        ShardLayout.BLOCK_ATOMIC)
    with pytest.raises(ValueError, match="shard layout"):
        MixedPrecisionPolicy(shard_layout="blocks")
    with pytest.raises(ValueError, match="row_block must be an int >= 1"):
        FlatLayout.build(["w"], [(32, 32)], 2, row_block=0)


# -------------------------------------------------------------------------- training


@pytest.mark.parametrize(
    ("strategy", "world"),
    [(ShardingStrategy.OPTIM_GRADS_PARAMS, 2),
     pytest.param(ShardingStrategy.OPTIM_GRADS_PARAMS, 4, marks=pytest.mark.slow),
     pytest.param(ShardingStrategy.NO_SHARD, 2, marks=pytest.mark.slow),
     pytest.param(ShardingStrategy.OPTIM, 2, marks=pytest.mark.slow),
     pytest.param(ShardingStrategy.OPTIM_GRADS, 2, marks=pytest.mark.slow)],
    ids=lambda v: v.value if isinstance(v, ShardingStrategy) else f"w{v}",
)
def test_block_atomic_training_matches_the_replicated_reference(strategy, world):
    def case(ctx):
        model = _train_and_compare(ctx, strategy, shard_layout=ShardLayout.BLOCK_ATOMIC)
        for g in model.param_groups:
            if g.blocks is not None:
                assert _split_blocks(g.layout) == [], g.label

    run_world(world, case)


def _wrapped(layout: ShardLayout, seed: int = 0, strategy=ShardingStrategy.OPTIM_GRADS_PARAMS):
    policy = MixedPrecisionPolicy(shard_layout=layout)
    model = fully_shard(make_net(seed), unit_modules=(Block,), policy=policy, strategy=strategy)
    return model, FSDPOptimizer(model, torch.optim.AdamW, lr=1e-2, foreach=False)


def _planes(model) -> dict[str, bytes]:
    out = {}
    with model.gathered_weights() as weights:
        for name, w in weights.items():
            if hasattr(w, "planes"):
                for plane, pd in w.planes.items():
                    out[f"{name}/{plane}/data"] = pd.data.numpy().tobytes()
                    out[f"{name}/{plane}/scale"] = pd.scale.numpy().tobytes()
    return out


def _step(model, opt, seed: int) -> None:
    r = dist.get_rank()
    x, y = make_batch(seed, T * dist.get_world_size())
    mse(model(x[r * T:(r + 1) * T]), y[r * T:(r + 1) * T]).backward()
    opt.step()
    opt.zero_grad()


def test_both_layouts_quantize_to_the_same_bytes():
    def case(ctx):
        lcm, lcm_opt = _wrapped(ShardLayout.LCM)
        atomic, atomic_opt = _wrapped(ShardLayout.BLOCK_ATOMIC)
        assert any(g.layout.unit != h.layout.unit for g, h in
                   zip(lcm.param_groups, atomic.param_groups, strict=True))
        a, b = _planes(lcm), _planes(atomic)
        assert a and a == b, [k for k in a if a[k] != b.get(k)][:3]
        _step(lcm, lcm_opt, 1)
        _step(atomic, atomic_opt, 1)
        a, b = _planes(lcm), _planes(atomic)
        assert a == b, [k for k in a if a[k] != b.get(k)][:3]

    run_world(3, case)


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [((ShardLayout.LCM, 2), (ShardLayout.BLOCK_ATOMIC, 3)),
     ((ShardLayout.BLOCK_ATOMIC, 3), (ShardLayout.LCM, 2))],
    ids=["lcm-w2-to-block_atomic-w3", "block_atomic-w3-to-lcm-w2"],
)
def test_checkpoints_convert_between_layouts_and_world_sizes(saved, loaded, tmp_path):
    path, want = tmp_path / "step_1", {}

    def save(ctx):
        model, opt = _wrapped(saved[0])
        _step(model, opt, 1)
        save_parts(path, [model.sharded_state(), opt.sharded_state()], run_id="layout", step=1)
        full, optim = model.full_state_dict(), full_optimizer_state(model, opt)
        planes = _planes(model)
        if ctx.rank == 0:
            want.update(main=full, optim=optim, planes=planes)

    def load(ctx):
        model, opt = _wrapped(loaded[0], seed=4)
        _step(model, opt, 2)  # other values and optimizer state to overwrite
        load_parts(path, [model.sharded_state(), opt.sharded_state()])
        full = model.full_state_dict()
        assert all(torch.equal(full[n], v) for n, v in want["main"].items())
        optim = full_optimizer_state(model, opt)
        assert all(torch.equal(optim[k], v) for k, v in want["optim"].items()), [
            k for k, v in want["optim"].items() if not torch.equal(optim[k], v)][:3]
        assert _planes(model) == want["planes"]  # the planes re-derived: the same bytes

    run_world(saved[1], save)
    run_world(loaded[1], load)


def test_dataclass_replace_keeps_the_layout():
    policy = dataclasses.replace(MixedPrecisionPolicy(shard_layout="block_atomic"), gather="bf16")
    assert policy.shard_layout is ShardLayout.BLOCK_ATOMIC


# ------------------------------------------------------------- scales travel with their rows


def _records(model, op, suffix: str):
    return [r for r in model.comms["dp"].records if r.op is op and r.label.endswith(suffix)]


def test_owners_make_their_scales_and_all_gather_them_instead_of_reducing_the_amax():
    """Block-atomic ZeRO-3: per refresh and group, no amax all-reduce, one uint8 all-gather of
    each plane's scale buffer (its rank slice: a 32nd of the shard); LCM: the fp32 amax
    all-reduce."""

    def case(ctx):
        lcm, lcm_opt = _wrapped(ShardLayout.LCM)
        atomic, atomic_opt = _wrapped(ShardLayout.BLOCK_ATOMIC)
        for model, opt in ((lcm, lcm_opt), (atomic, atomic_opt)):
            model.clear_wire_log()
            _step(model, opt, 1)
        mx = [g for g in atomic.param_groups if g.blocks is not None]
        assert not _records(atomic, Collective.ALL_REDUCE_MAX, "/amax")
        assert _records(lcm, Collective.ALL_REDUCE_MAX, "/amax")
        for plane in ("rowwise", "colwise"):
            gathers = _records(atomic, Collective.ALL_GATHER, f"/scales/{plane}")
            assert len(gathers) == len(mx), [r.label for r in gathers]
            for r, g in zip(gathers, mx, strict=True):
                assert r.label == f"{g.label}/scales/{plane}" and r.dtype == torch.uint8
                assert r.numel == g.layout.padded_numel // BLOCK
                assert r.bytes_sent == g.layout.shard_numel // BLOCK
            assert not _records(lcm, Collective.ALL_GATHER, f"/scales/{plane}")
        assert _planes(lcm) == _planes(atomic)

    run_world(2, case)


def test_telemetry_reads_every_blocks_amax_in_either_layout():
    """With telemetry attached the amax is reduced again (it summarises every block), and what
    it reports is the same in both layouts."""

    def case(ctx):
        got = []
        for layout in (ShardLayout.LCM, ShardLayout.BLOCK_ATOMIC):
            model, opt = _wrapped(layout)
            tel = NumericsTelemetry(model)
            _step(model, opt, 1)
            got.append({g: {p: v.as_record() for p, v in planes.items()}
                        for g, planes in tel.collect().items()})
            assert _records(model, Collective.ALL_REDUCE_MAX, "/amax")
            tel.close()
        assert got[0] == got[1]

    run_world(2, case)
