"""``torch_side.fsdp.param_group``: group keys and labels, and what one ``ParamGroup`` holds.

In process, world size 1 (``single_rank_world``). A group is the parameters of one unit sharing
a ``GroupKey`` (device, format, requires_grad, DP group); its label, ``unit/format/dp_group``
(``/frozen`` without gradients), matches ``GROUP_LABEL``, the pattern checkpoints allow. The
groups of a wrapped ``ToyNet`` hold their parameters' fp32 values as main weights, their model
weights in the format's planes (MXFP8: the oracle's bytes of bf16(main); fp32: the values), plane
states that follow the strategy and ``unshard`` / ``reshard``, and module parameters that are
views, empty tensors or storage-free placeholders as the codec says.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from common.formats import Plane, RegisteredFormat, WeightFormat
from tests.oracle import mxfp8_ref
from tests.torch_side.toy_models import Block, make_net
from torch_side import ShardingStrategy, fully_shard
from torch_side.comm.collectives import Phase
from torch_side.fsdp.param_group import GROUP_LABEL, ROOT_UNIT, GroupKey, PlaneState

MX, FP32 = WeightFormat.MXFP8_E4M3, WeightFormat.FP32
B16 = RegisteredFormat("mxfp8_b16")  # a key as register_format makes (labels need no table row)
CPU = torch.device("cpu")
ZERO3, NO_SHARD = ShardingStrategy.OPTIM_GRADS_PARAMS, ShardingStrategy.NO_SHARD


@pytest.fixture(scope="module")
def wrapped(single_rank_world):
    """{strategy: (the wrapped ToyNet, an unwrapped copy of its initial values)}."""
    return {s: (fully_shard(make_net(0), unit_modules=(Block,), strategy=s), make_net(0))
            for s in (NO_SHARD, ZERO3)}


def _group(model, label: str):
    (g,) = [g for g in model.param_groups if g.label == label]
    return g


def _initial(ref, name: str) -> torch.Tensor:
    return ref.get_parameter(name).detach()


@pytest.mark.parametrize(
    "key,unit,label",
    [
        (GroupKey(CPU, MX, True, "dp"), "blocks.0", "blocks.0/mxfp8_e4m3/dp"),
        (GroupKey(CPU, FP32, True, "dp"), "", "<root>/fp32/dp"),
        (GroupKey(CPU, FP32, False, "dp"), "", "<root>/fp32/dp/frozen"),
        (GroupKey(CPU, MX, True, "expert_dp"), "moe.experts.1",
         "moe.experts.1/mxfp8_e4m3/expert_dp"),
        (GroupKey(CPU, B16, True, "dp"), "h_0+h_1", "h_0+h_1/mxfp8_b16/dp"),
    ],
)
def test_a_group_key_labels_its_group_in_a_unit_as_checkpoints_allow(key, unit, label):
    assert key.label(unit) == label
    assert re.fullmatch(GROUP_LABEL, label)
    assert ROOT_UNIT == "<root>"


@pytest.mark.parametrize("bad", ["blocks.0/MXFP8/dp", "blocks.0/fp32", "a b/fp32/dp",
                                 "blocks.0+/fp32/dp", "/fp32/dp", "u/fp32/dp/frozen/x"])
def test_the_label_pattern_refuses_what_no_group_key_makes(bad):
    assert re.fullmatch(GROUP_LABEL, bad) is None


def test_keys_with_any_difference_are_different_groups():
    keys = {GroupKey(CPU, MX, True, "dp"), GroupKey(CPU, FP32, True, "dp"),
            GroupKey(CPU, MX, False, "dp"), GroupKey(CPU, MX, True, "expert_dp"),
            GroupKey(CPU, MX, True, "dp")}
    assert len(keys) == 4


def test_a_group_holds_its_entries_and_their_fp32_values_as_main_weights(wrapped):
    model, ref = wrapped[NO_SHARD]
    g = _group(model, "blocks.1/mxfp8_e4m3/dp")
    assert g.key == GroupKey(CPU, MX, True, "dp") and g.format == MX
    assert [(e.name, e.shape, e.dtype) for e in g.entries] == [
        ("blocks.1.mlp.fc1.weight", (96, 64), torch.float32),
        ("blocks.1.mlp.fc2.weight", (64, 96), torch.float32)]
    assert g.planes == (Plane.ROWWISE, Plane.COLWISE) and g.main.dtype == torch.float32
    covered = {i: 0 for i in range(len(g.entries))}
    for p in g.main_pieces():  # world 1: every element of every parameter, once
        want = _initial(ref, g.entries[p.slot_index].name).reshape(-1)
        got = g.main[p.shard_offset : p.shard_offset + p.numel]
        assert torch.equal(got, want[p.param_offset : p.param_offset + p.numel])
        covered[p.slot_index] += p.numel
    assert covered == {0: 96 * 64, 1: 64 * 96}


def test_the_mxfp8_planes_are_the_oracles_bytes_of_bf16_main(wrapped):
    model, ref = wrapped[NO_SHARD]
    g = _group(model, "blocks.0/mxfp8_e4m3/dp")
    for i, e in enumerate(g.entries):
        want = mxfp8_ref.quantize(_initial(ref, e.name).to(torch.bfloat16).float().numpy())
        for plane in g.planes:
            data, scale = g.plane_views(i, plane)
            assert tuple(data.shape) == e.shape and data.dtype == torch.uint8
            assert np.array_equal(data.numpy(), want[f"{plane.value}_data"]), (e.name, plane)
            assert np.array_equal(scale.numpy(), want[f"{plane.value}_scale"]), (e.name, plane)


def test_replicated_groups_are_their_buffers_and_parameters_view_them(wrapped):
    model, ref = wrapped[NO_SHARD]
    g = _group(model, "blocks.0/fp32/dp")
    assert g.planes == (Plane.ROWWISE,)
    assert g.state == {Plane.ROWWISE: PlaneState.REPLICATED}
    full = g.full_buffer(Plane.ROWWISE)
    for e in g.entries:  # a view of the weights buffer, holding the value
        assert torch.equal(e.param, _initial(ref, e.name))
        assert full.data_ptr() <= e.param.data_ptr() < full.data_ptr() + full.nbytes
    mx = _group(model, "blocks.0/mxfp8_e4m3/dp")
    for e in mx.entries:  # a storage-free placeholder of the parameter's shape
        assert tuple(e.param.shape) == e.shape and e.param.stride() == (0, 0)
    with pytest.raises(AssertionError, match="has no colwise plane; its planes are"):
        g.full_buffer(Plane.COLWISE)


def test_zero3_planes_are_sharded_until_unshard_and_again_after_reshard(wrapped):
    model, ref = wrapped[ZERO3]
    g = _group(model, "blocks.1/fp32/dp")
    assert g.state == {Plane.ROWWISE: PlaneState.SHARDED} and g.live_buckets() == []
    assert all(e.param.numel() == 0 for e in g.entries)  # no full values here while sharded
    g.unshard([Plane.ROWWISE], Phase.STATE)
    try:
        assert g.state == {Plane.ROWWISE: PlaneState.UNSHARDED}
        assert g.live_buckets() == ["rowwise"]
        for e in g.entries:
            assert torch.equal(e.param, _initial(ref, e.name))
    finally:
        g.reshard()
    assert g.state == {Plane.ROWWISE: PlaneState.SHARDED} and g.live_buckets() == []
    assert all(e.param.numel() == 0 for e in g.entries)
    mx = _group(model, "blocks.1/mxfp8_e4m3/dp")
    mx.unshard([Plane.COLWISE], Phase.BACKWARD)  # one plane only
    assert mx.state == {Plane.ROWWISE: PlaneState.SHARDED, Plane.COLWISE: PlaneState.UNSHARDED}
    mx.reshard()
    assert mx.live_buckets() == []


def test_groups_without_gradients_have_no_main_grad_and_others_a_zeroed_fp32_one(wrapped):
    model, _ = wrapped[ZERO3]
    frozen = _group(model, "<root>/fp32/dp/frozen")
    assert frozen.key.requires_grad is False and frozen.main_grad is None
    g = _group(model, "<root>/fp32/dp")
    grad = g.main_grad_for_optimizer()
    assert grad.dtype == torch.float32 and grad.shape == g.main.shape and not grad.any()
