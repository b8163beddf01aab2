"""``torch_side.fsdp.state_dict``: full main weights, their load, full gradients and gathered
weights.

In process, world size 1 (``single_rank_world``), on the groups of a wrapped ``ToyNet``
(``model.param_groups``). ``full_state_dict`` gives every parameter's fp32 main weight by its
qualified name; ``load_full_state_dict`` takes such a dict back -- bit for bit, and the model
weights follow (the oracle's MXFP8 bytes of the new values) -- after checking every name, shape
and dtype, and refuses a wrong one with an error that names it, before anything is written.
``full_grads`` gives the reduced gradients as fp32; ``gathered_weights`` the unsharded model
weights inside a ``with`` (block-scaled ones as ``TorchMXFP8Tensor``), resharded after it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge import TorchMXFP8Tensor
from common.formats import MXFP8_BLOCKS, Plane
from tests.oracle import mxfp8_ref
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import MixedPrecisionPolicy, ShardingStrategy, fully_shard
from torch_side.fsdp import state_dict as sd

pytestmark = pytest.mark.usefixtures("single_rank_world")

STRATEGIES = [ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM,
              ShardingStrategy.OPTIM_GRADS_PARAMS]
MX_WEIGHTS = [f"blocks.{i}.mlp.{fc}.weight" for i in (0, 1) for fc in ("fc1", "fc2")]


def _wrap(strategy=ShardingStrategy.OPTIM_GRADS_PARAMS, **kw):
    return fully_shard(make_net(0), unit_modules=(Block,), strategy=strategy, **kw)


def _params(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in make_net(seed).named_parameters()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_state_dict_is_every_parameters_fp32_value_by_name(strategy):
    model = _wrap(strategy)
    full = sd.full_state_dict(model.param_groups)
    want = _params(0)
    assert sorted(full) == sorted(want)  # the frozen ``shift`` too
    for name, value in want.items():
        assert full[name].dtype == torch.float32 and torch.equal(full[name], value), name
    full["inp.weight"].zero_()  # a copy: the model keeps its values
    assert torch.equal(sd.full_state_dict(model.param_groups)["inp.weight"], want["inp.weight"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_load_round_trips_bit_for_bit_and_the_model_weights_follow(strategy):
    model = _wrap(strategy)
    new = _params(9)
    new["head.bias"] = new["head.bias"].to(torch.bfloat16)  # any float dtype: converted to fp32
    sd.load_full_state_dict(model.param_groups, new)
    full = sd.full_state_dict(model.param_groups)
    assert all(torch.equal(full[k], v.float()) for k, v in new.items())
    with sd.gathered_weights(model.param_groups) as weights:
        for name in MX_WEIGHTS:
            ref = mxfp8_ref.quantize(new[name].to(torch.bfloat16).float().numpy())
            for plane in (Plane.ROWWISE, Plane.COLWISE):
                data, scale = weights[name].planes[plane]
                assert np.array_equal(data.numpy(), ref[f"{plane.value}_data"]), (name, plane)
                assert np.array_equal(scale.numpy(), ref[f"{plane.value}_scale"])
        assert torch.equal(weights["blocks.1.ln.weight"], new["blocks.1.ln.weight"])


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda s: s.pop("head.bias"), KeyError, r"missing parameters \['head.bias'\]"),
        (lambda s: s.update(extra=torch.zeros(1)), KeyError, r"unexpected \['extra'\]"),
        (lambda s: s.update({"inp.weight": torch.zeros(64, 15)}), ValueError,
         r"'inp.weight' has shape \(64, 15\) in the state dict but \(64, 16\) in the model"),
        (lambda s: s.update({"inp.bias": [0.0] * 64}), TypeError,
         "'inp.bias' is a list, expected a torch.Tensor of shape"),
        (lambda s: s.update({"inp.bias": torch.zeros(64, dtype=torch.int32)}), TypeError,
         "'inp.bias' has dtype torch.int32; expected a floating-point tensor"),
    ],
    ids=["missing", "unexpected", "shape", "not-a-tensor", "integer"],
)
def test_a_load_refuses_wrong_names_shapes_and_dtypes_before_writing_anything(
    change, error, match
):
    model = _wrap()
    state = _params(9)
    state["blocks.0.ln.weight"] = torch.full((64,), 3.0)  # a good value that must not land
    change(state)
    with pytest.raises(error, match=match):
        sd.load_full_state_dict(model.param_groups, state)
    full = sd.full_state_dict(model.param_groups)
    assert all(torch.equal(full[k], v) for k, v in _params(0).items())


def test_state_keys_split_into_parameters_and_buffers_and_buffer_shapes_are_checked():
    model = _wrap()
    model.module.register_buffer("count", torch.zeros(2))
    params, buffers = sd.split_state_keys(model.param_groups, model.module)
    assert params == set(_params(0)) and buffers == {"count"}
    sd.check_buffers(model.module, {"count": torch.ones(2)})
    with pytest.raises(ValueError, match=r"buffer 'count' is \(3,\) in the state dict but has "
                                         r"shape \(2,\) in the model; nothing was loaded"):
        sd.check_buffers(model.module, {"count": torch.ones(3)})


def test_full_grads_are_the_reduced_gradients_as_fp32_of_parameters_that_take_them():
    by_dtype = {dt: _wrap(policy=MixedPrecisionPolicy(main_grad_dtype=dt))
              for dt in (torch.float32, torch.bfloat16)}
    x, y = make_batch(5, 32)
    for model in by_dtype.values():
        mse(model(x), y).backward()
    grads = {dt: sd.full_grads(m.param_groups) for dt, m in by_dtype.items()}
    trained = sorted(n for n, p in make_net(0).named_parameters() if p.requires_grad)
    assert sorted(grads[torch.float32]) == trained and "shift" not in trained
    for name, g in grads[torch.float32].items():  # bf16 main grads: the fp32 ones rounded
        assert g.dtype == grads[torch.bfloat16][name].dtype == torch.float32
        assert bool(g.any()), name
        assert torch.equal(grads[torch.bfloat16][name], g.to(torch.bfloat16).float()), name


def test_gathered_weights_are_the_unsharded_model_weights_inside_the_with_only():
    model = _wrap(ShardingStrategy.OPTIM_GRADS_PARAMS)
    with sd.gathered_weights(model.param_groups) as weights:
        assert sorted(weights) == sorted(_params(0))
        assert all(g.live_buckets() for g in model.param_groups)  # every group gathered
        w = weights["blocks.0.mlp.fc1.weight"]
        assert isinstance(w, TorchMXFP8Tensor)
        assert (w.shape, w.dtype, w.blocks) == ((96, 64), torch.bfloat16, MXFP8_BLOCKS)
        assert set(w.planes) == {Plane.ROWWISE, Plane.COLWISE}
        assert not isinstance(weights["head.weight"], TorchMXFP8Tensor)
        assert torch.equal(weights["head.weight"], _params(0)["head.weight"])
    assert weights == {}  # views of freed buckets are not kept
    assert all(g.live_buckets() == [] for g in model.param_groups)
