"""``torch_side.fsdp.unit_builder``, through ``fully_shard``: which modules become FSDP units, what
they are called, which parameters each owns and how a unit's parameters are grouped.

In process, world size 1 (``single_rank_world``), on ``ToyNet`` (tests/torch_side/toy_models.py:
a frozen ``shift``, ``inp``, ``blocks`` of LayerNorm + MXFP8 MLP, ``head``). Units: the root
(``<root>``) first, then one per ``unit_modules`` match in the model's module order, a list entry
making its modules one unit named by their names joined with ``+``; a parameter belongs to the
innermost unit around it. Groups: by (format, requires_grad, DP group); labels
``unit/format/dp_group[/frozen]``. Misuse is refused before anything is built, naming the entry.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.torch_side.toy_models import MLP, Block, ExpertMLP, ToyNet, make_batch, make_net
from torch_side import ShardingStrategy, WeightFormat, fully_shard
from torch_side.fsdp.param_group import GROUP_LABEL, ROOT_UNIT, UNIT_JOIN

pytestmark = pytest.mark.usefixtures("single_rank_world")

MX, FP32 = WeightFormat.MXFP8_E4M3, WeightFormat.FP32
ROOT_PARAMS = ["shift", "inp.weight", "inp.bias", "head.weight", "head.bias"]


def _block_params(i: int) -> list[str]:
    return [f"blocks.{i}.{n}" for n in ("ln.weight", "ln.bias", "mlp.fc1.weight", "mlp.fc1.bias",
                                        "mlp.fc2.weight")]


def _owned(model) -> dict[str, list[str]]:
    """{unit name: the qualified names of the parameters its groups hold, sorted}."""
    return {u.name: sorted(e.name for g in u.groups for e in g.entries) for u in model.units}


def test_every_matching_module_type_becomes_a_unit_after_the_root():
    net = make_net(0)
    model = fully_shard(net, unit_modules=(Block,))
    assert [u.name for u in model.units] == [ROOT_UNIT, "blocks.0", "blocks.1"]
    assert [u.modules for u in model.units] == [(net,), (net.blocks[0],), (net.blocks[1],)]
    assert _owned(model) == {ROOT_UNIT: sorted(ROOT_PARAMS), "blocks.0": sorted(_block_params(0)),
                             "blocks.1": sorted(_block_params(1))}


def test_an_instance_is_a_unit_and_what_no_unit_owns_stays_with_the_root():
    net = make_net(0)
    model = fully_shard(net, unit_modules=(net.blocks[1],))
    assert _owned(model) == {ROOT_UNIT: sorted(ROOT_PARAMS + _block_params(0)),
                             "blocks.1": sorted(_block_params(1))}


def test_a_list_of_modules_is_one_unit_named_by_its_members_joined():
    net = make_net(0)
    model = fully_shard(net, unit_modules=[(net.blocks[0], net.blocks[1])])
    span = model.units[1]
    assert UNIT_JOIN == "+" and span.name == "blocks.0+blocks.1"
    assert span.modules == (net.blocks[0], net.blocks[1]) and span.module is net.blocks[0]
    assert _owned(model)[span.name] == sorted(_block_params(0) + _block_params(1))
    labels = sorted(g.label for g in span.groups)
    assert labels == ["blocks.0+blocks.1/fp32/dp", "blocks.0+blocks.1/mxfp8_e4m3/dp"]
    assert all(re.fullmatch(GROUP_LABEL, g.label) for g in model.param_groups)


def test_a_parameter_belongs_to_the_innermost_unit_around_it():
    model = fully_shard(make_net(0), unit_modules=(MLP, Block))
    assert [u.name for u in model.units] == [
        ROOT_UNIT, "blocks.0", "blocks.0.mlp", "blocks.1", "blocks.1.mlp"]  # module order
    owned = _owned(model)
    assert owned["blocks.0"] == ["blocks.0.ln.bias", "blocks.0.ln.weight"]
    assert owned["blocks.0.mlp"] == [
        "blocks.0.mlp.fc1.bias", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"]


def test_a_units_parameters_are_grouped_by_format_requires_grad_and_dp_group():
    net = ToyNet(expert_block=True)
    model = fully_shard(net, unit_modules=(Block,), expert_modules=(ExpertMLP,),
                        expert_group=dist.group.WORLD)
    groups = {g.label: (g.format, g.key.requires_grad, [e.name for e in g.entries])
              for g in model.param_groups}
    assert groups == {
        "<root>/fp32/dp/frozen": (FP32, False, ["shift"]),
        "<root>/fp32/dp": (FP32, True, ["inp.weight", "inp.bias", "head.weight", "head.bias"]),
        "blocks.0/fp32/dp": (FP32, True, ["blocks.0.ln.weight", "blocks.0.ln.bias",
                                          "blocks.0.mlp.fc1.bias"]),
        "blocks.0/mxfp8_e4m3/dp": (MX, True, ["blocks.0.mlp.fc1.weight",
                                              "blocks.0.mlp.fc2.weight"]),
        "blocks.1/fp32/dp": (FP32, True, ["blocks.1.ln.weight", "blocks.1.ln.bias"]),
        "blocks.1/fp32/expert_dp": (FP32, True, ["blocks.1.mlp.fc1.bias"]),
        "blocks.1/mxfp8_e4m3/expert_dp": (MX, True, ["blocks.1.mlp.fc1.weight",
                                                     "blocks.1.mlp.fc2.weight"]),
    }


def test_block_scaled_layers_called_directly_read_the_planes_fsdp_injects():
    """An MXFP8 weight is a storage-free placeholder under FSDP; its layer, called on its own,
    still computes what it computed inside the model's forward (a pre-hook injects its planes)."""
    net = make_net(0)
    model = fully_shard(net, unit_modules=(Block,), strategy=ShardingStrategy.NO_SHARD)
    fc1 = net.blocks[0].mlp.fc1
    assert fc1.weight.shape == (96, 64) and fc1.weight.stride() == (0, 0)
    seen = []

    def keep(module, args, out) -> None:
        seen.append((args[0], out))

    handle = fc1.register_forward_hook(keep)
    model(make_batch(2, 32)[0])
    handle.remove()
    ((h, inside),) = seen
    assert torch.equal(fc1(h), inside) and bool(inside.any())
    model.zero_grad()  # the forward had no backward: reset the iteration
    assert all(g.live_buckets() == [] for g in model.param_groups)


def _tied() -> nn.Module:
    net = make_net(0)
    net.head.weight = nn.Parameter(torch.zeros(8, 64))
    net.extra = nn.Linear(64, 8)
    net.extra.weight = net.head.weight
    return net


def test_misuse_of_unit_modules_is_refused_by_name():
    net = make_net(0)
    with pytest.raises(TypeError, match="must be a list or tuple"):
        fully_shard(net, unit_modules=Block)
    with pytest.raises(ValueError, match="entry Conv2d matches no module"):
        fully_shard(net, unit_modules=(nn.Conv2d,))
    with pytest.raises(ValueError, match=r"'blocks.0' is in two units \(blocks.0 and blocks.0\+"):
        fully_shard(net, unit_modules=(Block, (net.blocks[0], net.blocks[1])))
    with pytest.raises(ValueError, match="'extra.weight' is the same tensor as 'head.weight'"):
        fully_shard(_tied())


def test_lists_that_cannot_be_one_unit_are_refused_by_name():
    net = make_net(0)
    with pytest.raises(ValueError, match="lists 'blocks.0.mlp' inside its module 'blocks.0'"):
        fully_shard(net, unit_modules=[(net.blocks[0], net.blocks[0].mlp)])
    with pytest.raises(ValueError, match="the wrapped root"):
        fully_shard(net, unit_modules=[(net, net.blocks[0])])
    with pytest.raises(ValueError, match="list is empty"):
        fully_shard(net, unit_modules=[()])
    moe = ToyNet(expert_block=True)
    with pytest.raises(ValueError, match="mixes expert modules with other modules"):
        fully_shard(moe, unit_modules=[(moe.blocks[0], moe.blocks[1].mlp)],
                    expert_modules=(ExpertMLP,), expert_group=dist.group.WORLD)
