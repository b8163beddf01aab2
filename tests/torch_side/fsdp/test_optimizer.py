"""``torch_side.fsdp.optimizer``: ``FSDPOptimizer`` and ``clip_grad_norm_`` over the fp32 main
weights.

In process, world size 1 (``single_rank_world``), ``ToyNet`` wrapped under ZeRO-3. AdamW steps
through ``FSDPOptimizer`` give the main weights that ``torch.optim.AdamW`` gives plain copies
of the parameters from the same full gradients, byte for byte, and agree with AdamW written out
by hand in float64 to within about 2 fp32 ulps (``HAND_TOLERANCE``); the model weights follow
the step (MXFP8 planes: the oracle's bytes of the new main weights). Frozen parameters are not
stepped. A
step refuses to run mid-iteration or on the partial gradients an aborted backward left.
``grad_norm`` / ``clip_grad_norm_`` match ``torch.nn.utils.clip_grad_norm_`` on the full grads.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from common.formats import Plane
from tests.oracle import mxfp8_ref
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import FSDPOptimizer, GradCheck, ShardingStrategy, clip_grad_norm_, fully_shard

pytestmark = pytest.mark.usefixtures("single_rank_world")

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
# FSDP's fp32 AdamW against the float64 one: about 2 fp32 ulps (2^-23 relative) per element
# (measured: at most ~1 ulp, 1.1e-7 on LayerNorm gains near 1)
HAND_TOLERANCE = {"rtol": 2.4e-7, "atol": 5e-8}


def _wrap(**kw):
    return fully_shard(make_net(0), unit_modules=(Block,),
                       strategy=ShardingStrategy.OPTIM_GRADS_PARAMS, **kw)


def _backward(model, step: int) -> torch.Tensor:
    x, y = make_batch(100 + step, 32)
    loss = mse(model(x), y)
    loss.backward()
    return loss.detach()


def _hand_adamw(p0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """AdamW (decoupled weight decay, bias-corrected moments) written out in float64."""
    lr, (b1, b2), eps, wd = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
    p, m, v = p0.double(), torch.zeros_like(p0, dtype=torch.float64), 0
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        p = p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
    return p


@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True}],
                         ids=["single-tensor", "foreach", "fused"])
def test_adamw_steps_match_torch_byte_for_byte_and_the_hand_written_rule_closely(impl):
    """Each of torch's AdamW implementations (the fused one is what mxfp8-train and the
    benchmark run on CUDA) over the main shards gives its own bytes on plain tensors."""
    model = _wrap()
    opt = FSDPOptimizer(model, torch.optim.AdamW, **ADAMW, **impl)
    initial = model.full_state_dict()
    # the unwrapped parameters, stepped by torch's AdamW from the same full gradients
    plain = {k: v.clone().requires_grad_(k != "shift") for k, v in initial.items()}
    plain_opt = torch.optim.AdamW([p for p in plain.values() if p.requires_grad], **ADAMW,
                                  **impl)
    grads: dict[str, list[torch.Tensor]] = {k: [] for k in initial}
    for step in range(2):
        _backward(model, step)
        for k, g in model.full_grads().items():
            grads[k].append(g)
            plain[k].grad = g
        opt.step()
        plain_opt.step()
        opt.zero_grad()
    after = model.full_state_dict()
    assert after["shift"].equal(initial["shift"]) and grads["shift"] == []  # frozen: not stepped
    for name, p in plain.items():
        if p.requires_grad:
            assert torch.equal(after[name], p.detach()), name
            hand = _hand_adamw(initial[name], grads[name])
            torch.testing.assert_close(after[name].double(), hand, **HAND_TOLERANCE, msg=name)
            assert not torch.equal(after[name], initial[name]), name
    with model.gathered_weights() as weights:  # the model weights were refreshed from main
        for name in ("blocks.0.mlp.fc1.weight", "blocks.1.mlp.fc2.weight"):
            ref = mxfp8_ref.quantize(after[name].to(torch.bfloat16).float().numpy())
            data, scale = weights[name].planes[Plane.COLWISE]
            assert np.array_equal(data.numpy(), ref["colwise_data"]), name
            assert np.array_equal(scale.numpy(), ref["colwise_scale"]), name
        assert torch.equal(weights["head.weight"], after["head.weight"])


def test_the_inner_optimizer_holds_one_main_weight_tensor_per_trained_group():
    model = _wrap()
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    trained = [g for g in model.param_groups if g.key.requires_grad]
    (group,) = opt.optimizer.param_groups
    assert [id(p) for p in group["params"]] == [id(g.main) for g in trained]
    assert len(trained) == len(model.param_groups) - 1  # all but the frozen ``shift``
    with pytest.raises(TypeError, match="expected the FSDPModel returned by fully_shard"):
        FSDPOptimizer(make_net(0), torch.optim.SGD, lr=0.1)


def test_optimizer_state_round_trips_so_the_next_step_is_the_same():
    models = [_wrap(), _wrap()]
    opts = [FSDPOptimizer(m, torch.optim.AdamW, **ADAMW) for m in models]
    _backward(models[0], 0)
    opts[0].step()
    opts[0].zero_grad()
    models[1].load_full_state_dict(models[0].full_state_dict())
    opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))  # (torch's holds live tensors)
    for model, opt in zip(models, opts, strict=True):
        _backward(model, 1)
        opt.step()
    a, b = (m.full_state_dict() for m in models)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_step_is_refused_mid_iteration_and_after_an_aborted_backward():
    model = _wrap(grad_check=GradCheck.FINITE)
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    before = model.full_state_dict()
    with model.gathered_weights():
        with pytest.raises(RuntimeError, match=r"FSDPOptimizer.step\(\): FSDP is in the middle"):
            opt.step()
    x, y = make_batch(3, 32)
    y[0, 0] = float("nan")
    with pytest.raises(FloatingPointError):
        mse(model(x), y).backward()
    with pytest.raises(RuntimeError, match="the last backward was aborted by an exception"):
        opt.step()
    after = model.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing moved
    opt.zero_grad()
    _backward(model, 0)
    opt.step()  # zero_grad made the gradients whole again


def test_divide_grads_divides_the_reduced_gradients_in_place():
    model = _wrap()
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    _backward(model, 0)
    before = model.full_grads()
    opt.divide_grads(4)
    after = model.full_grads()
    assert all(torch.equal(after[k], v / 4) for k, v in before.items())
    for bad in (0, -1.0, "2"):
        with pytest.raises(ValueError, match="expected a number > 0"):
            opt.divide_grads(bad)


def test_grad_norm_and_clipping_match_torch_on_the_full_gradients():
    model = _wrap()
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    _backward(model, 0)
    full = {k: g.clone().requires_grad_() for k, g in model.full_grads().items()}
    for t in full.values():  # torch clips .grad: the full gradients, as gradients of themselves
        t.grad = t.detach().clone()
    want = math.sqrt(sum(float(t.grad.double().square().sum()) for t in full.values()))
    norm = opt.grad_norm()
    assert norm.dtype == torch.float64 and norm.dim() == 0
    assert math.isclose(float(norm), want, rel_tol=1e-6)  # fp32 norms per group, summed in fp64
    max_norm = want / 4  # clips: every gradient scaled by max_norm / (norm + 1e-6)
    got = clip_grad_norm_(opt, max_norm, total_norm=norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(list(full.values()), max_norm)
    assert float(got) == float(norm) and math.isclose(float(ref_norm), want, rel_tol=1e-6)
    grads = model.full_grads()
    for name, t in full.items():
        torch.testing.assert_close(grads[name], t.grad, rtol=1e-6, atol=0)
    assert math.isclose(float(clip_grad_norm_(model, 1e9)), max_norm, rel_tol=1e-5)
    with pytest.raises(ValueError, match="max_norm=0, expected a finite number > 0"):
        clip_grad_norm_(model, 0)
    with pytest.raises(TypeError, match="for an unwrapped module use torch.nn.utils"):
        clip_grad_norm_(make_net(0), 1.0)
