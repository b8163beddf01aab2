"""A block type registered from the tests alone (docs/extending.md, "A block type").

``TwoStream`` is a block the library does not know: two differentiable inputs, two outputs,
two MXFP8 linears and a high-precision one. The walkthrough's
steps, here: its Torch module (bias-free ``MXFP8Linear`` layers), its JAX function written once
(``TwoStreamFn``: ``fn(params, linear, x, y) -> (x', y')``), and one registration,
``register_unit(TwoStream, fn_for, inputs=2, outputs=2)``. No library file changes.

Checked against the block's own Torch forward (the per-linear ops), byte for byte -- the block
has only linears and additions, which Torch and JAX compute alike (XLA would contract a product
followed by a sum into one fused multiply-add, which Torch does not): the outputs and
every gradient without FSDP; losses and weights after SGD steps under FSDP at world 1 (in
process), with one unit per block (the FSDP sources, grad sinks and bindings of the unit
programs) and with both blocks as one FSDP unit (blocks of several inputs run their own
programs in it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from bridge import MXFP8Linear
from bridge.unit_bindings import binding_of
from bridge.units import block_type, register_unit, set_compute, unregister_unit
from common.modes import Compute, LinearMode
from torch_side import FSDPOptimizer, fully_shard

D, F = 64, 128  # model and hidden widths (multiples of 32: MXFP8 blocks)


class TwoStream(nn.Module):
    """(x, y) -> (x + down(up(y)), y + mix(x)): two streams that read each other."""

    def __init__(self):
        super().__init__()
        self.up = MXFP8Linear(D, F, bias=False)
        self.down = MXFP8Linear(F, D, bias=False)
        self.mix = MXFP8Linear(D, D, bias=False, mode=LinearMode.HIGH_PRECISION)

    def forward(self, x, y):
        return x + self.down(self.up(y)), y + self.mix(x)


@dataclasses.dataclass(frozen=True)  # hashable: equal blocks share one compiled program
class TwoStreamFn:
    """``TwoStream``'s math for its unit program: each linear by its name (the MXFP8 ones read
    FSDP's planes, ``mix`` its high-precision weight ``params["mix.weight"]``)."""

    def __call__(self, params, linear, x, y):
        return x + linear("down", linear("up", y)), y + linear("mix", x)


class TwoStreamNet(nn.Module):
    def __init__(self, seed: int, blocks: int = 2):
        super().__init__()
        torch.manual_seed(seed)
        self.scale = nn.Parameter(torch.ones(D))  # the root unit's parameter (a Torch op)
        self.blocks = nn.ModuleList(TwoStream() for _ in range(blocks))
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.1)
                else:
                    p.uniform_(0.5, 1.5)

    def forward(self, x, y):
        x = x * self.scale
        for block in self.blocks:
            x, y = block(x, y)
        return x, y


@pytest.fixture(autouse=True)
def two_stream_registered():
    """The registration, undone after each test (a plugin would register once at import)."""
    register_unit(TwoStream, lambda m: TwoStreamFn(), inputs=2, outputs=2)
    yield
    unregister_unit(TwoStream)


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    x, y, wx, wy = (torch.randn(2, 32, D, generator=g) for _ in range(4))
    return x, y, wx, wy


def _loss(model, step: int) -> torch.Tensor:
    x, y, wx, wy = _data(step)
    xo, yo = model(x, y)
    return (xo * wx).sum() + (yo * wy).sum()  # cotangents wx and wy, exactly


def _bytes(t: torch.Tensor) -> list[int]:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).tolist()


def test_the_registration_declares_two_inputs_and_two_outputs():
    entry = block_type(TwoStream())
    assert (entry.module_type, entry.inputs, entry.outputs) == (TwoStream, 2, 2)
    net = TwoStreamNet(seed=0)
    assert set_compute(net, Compute.UNIT) == 2
    with pytest.raises(TypeError, match="registered with inputs=2 but was called with 1"):
        net.blocks[0](torch.zeros(2, 32, D))


def test_a_block_of_two_inputs_and_two_outputs_matches_its_torch_forward():
    got, want = TwoStreamNet(seed=1), TwoStreamNet(seed=1)
    assert set_compute(got, Compute.UNIT) == 2
    x, y, wx, wy = _data(0)
    outs = {}
    for name, model in (("unit", got), ("op", want)):
        xi, yi = x.clone().requires_grad_(), y.clone().requires_grad_()
        xo, yo = model(xi, yi)
        ((xo * wx).sum() + (yo * wy).sum()).backward()
        outs[name] = [xo, yo, xi.grad, yi.grad] + [p.grad for p in model.parameters()]
    assert binding_of(got.blocks[0]).programs, "the unit path ran (and kept what it found)"
    for k, (a, b) in enumerate(zip(outs["unit"], outs["op"], strict=True)):
        assert _bytes(a) == _bytes(b), k


def _train(compute: str, units, steps: int = 2):
    net = TwoStreamNet(seed=2)
    set_compute(net, compute)
    model = fully_shard(net, unit_modules=units(net))
    block = net.blocks[0]  # FSDP bound what the unit programs read: planes, a shared buffer
    assert "weight" in binding_of(block.up).weights and "weight" in binding_of(block.mix).params
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    losses = []
    for step in range(steps):
        loss = _loss(model, step)
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    ran = binding_of(block)  # the unit path keeps what it found in the block's binding
    assert bool(ran and ran.programs) == (compute == "unit")
    return losses, model.full_state_dict()


@pytest.mark.parametrize(
    "units", [lambda net: (TwoStream,), lambda net: [tuple(net.blocks)]],
    ids=["a-unit-per-block", "both-blocks-one-unit"])
def test_it_trains_under_fsdp_through_the_unit_path_as_through_the_ops(single_rank_world, units):
    got_losses, got = _train("unit", units)
    want_losses, want = _train("op", units)
    assert [_bytes(v) for v in got_losses] == [_bytes(v) for v in want_losses]
    assert got.keys() == want.keys()
    for name in got:
        assert _bytes(got[name]) == _bytes(want[name]), name
