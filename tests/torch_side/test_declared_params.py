"""Which parameters are block-scaled is what modules declare (``mxfp8_params()``), answered by the
policy; FSDP checks no layer class. In-process (``single_rank_world``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bridge import LinearMode, MXFP8Linear, mxfp8_linear
from common.formats import BlockScaledParams, block_scaled_params
from torch_side import MixedPrecisionPolicy, WeightFormat, fully_shard

MX, FP32 = WeightFormat.MXFP8_E4M3, WeightFormat.FP32


class Projection(nn.Module):
    """Not an ``MXFP8Linear``: a module of its own that declares its weight block-scaled."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(64, 32) * 0.1)
        self.gain = nn.Parameter(torch.ones(64))

    def mxfp8_params(self) -> tuple[str, ...]:
        return ("proj",)

    def forward(self, x, weight_planes=None):
        return mxfp8_linear(x, self.proj, weight_planes=weight_planes) * self.gain


def _formats(module: nn.Module) -> dict[str, WeightFormat]:
    policy = MixedPrecisionPolicy()
    return {
        f"{m}.{p}": policy.param_format(mod, p, f"{m}.{p}")
        for m, mod in module.named_modules()
        for p, _ in mod.named_parameters(recurse=False)
    }


def test_the_policy_answers_what_modules_declare():
    net = nn.ModuleDict(
        {
            "mx": MXFP8Linear(32, 64),
            "hp": MXFP8Linear(32, 64, mode=LinearMode.HIGH_PRECISION),
            "plain": nn.Linear(32, 64),
            "own": Projection(),
        }
    )
    assert _formats(net) == {
        "mx.weight": MX, "mx.bias": FP32, "hp.weight": FP32, "hp.bias": FP32,
        "plain.weight": FP32, "plain.bias": FP32, "own.proj": MX, "own.gain": FP32,
    }  # fmt: skip
    assert isinstance(net["own"], BlockScaledParams)
    assert not isinstance(net["plain"], BlockScaledParams)


@pytest.mark.parametrize(
    "names,match",
    [(("proj", "gain"), "at most one"), (("nope",), "'nope', which is not an attribute")],
)
def test_bad_declarations_are_refused_clearly(names, match):
    bad = Projection()
    bad.mxfp8_params = lambda: names
    with pytest.raises(ValueError, match=match):
        block_scaled_params(bad)


def test_fsdp_shards_a_declared_parameter_of_any_module_as_mxfp8(single_rank_world):
    torch.manual_seed(0)
    module, x = Projection(), torch.randn(8, 32)
    want = module(x)
    model = fully_shard(module)
    fmts = {e.name: g.key.weight_format for g in model.param_groups for e in g.entries}
    assert fmts == {"proj": MX, "gain": FP32}
    torch.testing.assert_close(model(x), want)  # planes injected; same MXFP8 bytes as unsharded
