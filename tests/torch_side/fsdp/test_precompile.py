"""``torch_side.precompile`` / ``bridge.compile_ahead`` on a plain (unsharded) model, in process.

The FSDP cases (world sizes 1 and 2, ZeRO-3 and ZeRO-2 with recompute, compared with the
replicated reference) are in test_training_parity.py (``test_precompiled_training_matches_*``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

from bridge import compile_ahead
from bridge.compile_ahead import active
from common.model_config import GPTConfig
from common.modes import LinearMode
from models.torch_gpt import TorchGPT, cross_entropy
from tests.compiles import COMPILES
from torch_side import precompile


def _model(mode: LinearMode, d_ff: int, recompute: bool = False) -> TorchGPT:
    # d_ff values no other test uses: every program of these models is new to the process
    cfg = GPTConfig(vocab_size=96, max_seq_len=32, n_layer=2, n_head=2, d_model=64, d_ff=d_ff)
    model = TorchGPT(cfg, mode, seed=3)
    if recompute:
        for block in model.blocks:
            forward = block.forward
            block.forward = lambda x, f=forward: torch.utils.checkpoint.checkpoint(
                f, x, use_reentrant=False
            )
    return model


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(seed))


def _train(model, pre: bool, steps: int = 2):
    """(loss, programs compiled by the step, gradients) per step; SGD in between."""
    report = None
    if pre:
        dry = _tokens(99)
        report = precompile(model, lambda: cross_entropy(model(dry), dry))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i in range(steps):
        before = COMPILES.count
        tokens = _tokens(i)
        loss = cross_entropy(model(tokens), tokens)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        out.append((loss.detach(), COMPILES.count - before, grads))
    return report, out


@pytest.mark.parametrize(
    ("mode", "d_ff", "recompute"),
    [(LinearMode.MXFP8, 224, False), (LinearMode.MXFP8, 288, True),
     (LinearMode.HIGH_PRECISION, 224, False)],
    ids=["mxfp8", "mxfp8-recompute", "high-precision"],
)
def test_precompile_compiles_every_program_and_changes_nothing(mode, d_ff, recompute):
    report, pre = _train(_model(mode, d_ff, recompute), pre=True)
    # 4 distinct linear shapes (qkv, proj, fc, fc2 ... lm_head: qkv is (192, 64), fc (d_ff, 64))
    assert report.programs >= 8 and report.calls > report.programs, report
    assert report.wall_s > 0 and report.compile_s > 0
    assert [n for _, n, _ in pre] == [0, 0], "the steps after precompile compiled programs"
    _, plain = _train(_model(mode, d_ff, recompute), pre=False)
    for (la, _, ga), (lb, _, gb) in zip(pre, plain, strict=True):
        assert torch.equal(la, lb)
        assert all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))


def test_precompile_no_grad_forward_compiles_the_evaluation_programs_too():
    model = _model(LinearMode.MXFP8, 320)
    dry = _tokens(7)
    report = precompile(model, lambda: cross_entropy(model(dry), dry), no_grad_forward=True)
    before = COMPILES.count
    with torch.no_grad():
        model(_tokens(8))  # evaluation: forward programs that keep no x colwise plane
    cross_entropy(model(_tokens(9)), _tokens(9)).backward()
    assert COMPILES.count == before, "evaluation or training compiled after precompile"
    assert report.programs >= 12, report  # 4 shapes x (eval forward, forward, backward)


def test_precompile_restores_rng_and_clears_grads():
    model = _model(LinearMode.MXFP8, 224)
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    dry = _tokens(1)
    precompile(model, lambda: cross_entropy(model(dry), dry))
    assert torch.equal(torch.rand(4), want), "precompile consumed Torch's RNG"
    assert all(p.grad is None for p in model.parameters())
    assert active() is None


def test_precompile_refuses_a_model_holding_grads():
    model = _model(LinearMode.MXFP8, 224)
    tokens = _tokens(0)
    cross_entropy(model(tokens), tokens).backward()
    with pytest.raises(ValueError, match="holds gradients"):
        precompile(model, lambda: cross_entropy(model(tokens), tokens))
    assert all(p.grad is not None for p in model.parameters()), "the user's grads were touched"


def test_precompile_bad_loss_fn_leaves_nothing_behind():
    model = _model(LinearMode.MXFP8, 224)
    tokens = _tokens(0)
    with pytest.raises(TypeError, match="scalar tensor that requires grad"):
        precompile(model, lambda: model(tokens))  # logits, not a loss
    assert active() is None
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="must be callable"):
        precompile(model, 3)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        precompile(object(), lambda: None)


def test_compile_ahead_blocks_do_not_nest_and_workers_are_checked():
    with compile_ahead(), pytest.raises(RuntimeError, match="do not nest"):
        with compile_ahead():
            pass
    assert active() is None
    with pytest.raises(ValueError, match="max_workers"):
        with compile_ahead(max_workers=0):
            pass


class _Unlowerable:
    """Traces like the identity, fails to lower: a program that cannot compile."""

    def __init__(self):
        self.__qualname__ = "unlowerable_program"

    def __call__(self, x):
        return x

    def lower(self, *args, **kwargs):
        raise RuntimeError("no lowering for this program")


def test_compile_ahead_reports_a_failed_program_by_name():
    with pytest.raises(RuntimeError, match="unlowerable_program failed to compile ahead"):
        with compile_ahead() as ahead:
            out = ahead.call(_Unlowerable(), jnp.ones(4))
            assert out.shape == (4,)
    with pytest.raises(TypeError, match="not a jitted function"):
        with compile_ahead() as ahead:
            ahead.call(lambda x: x, jnp.ones(4))


def test_compile_ahead_dedupes_programs_and_returns_abstract_results():
    f = jax.jit(lambda x, *, scale: x * scale, static_argnames=("scale",))
    ones = jnp.ones((3, 32))  # uncommitted
    put = jax.device_put(jnp.ones((5, 32)), jax.devices()[0])  # committed (as to_jax's arrays)
    with compile_ahead() as ahead:
        a = ahead.call(f, ones, scale=2)
        ahead.call(f, jnp.zeros((3, 32)), scale=2)  # same program
        ahead.call(f, ones, scale=3)  # another static value: another program
        ahead.call(f, put, scale=3)
    report = ahead.wait()
    assert isinstance(a, jax.ShapeDtypeStruct) and a.shape == (3, 32)
    assert (report.programs, report.calls) == (3, 4), report
    before = COMPILES.count
    y, z = f(ones, scale=3), f(put, scale=3)
    assert COMPILES.count == before, "the jit calls did not find the programs compiled ahead"
    assert float(y[0, 0]) == 3.0 and float(z[0, 0]) == 3.0


def test_the_package_name_is_the_function_whatever_was_imported_first():
    """``torch_side.precompile`` is the function even after its module was imported (the module
    is ``torch_side.fsdp.precompiling``: a submodule of the function's name would replace it)."""
    import importlib

    import torch_side

    importlib.import_module("torch_side.fsdp.precompiling")
    assert callable(torch_side.precompile) and torch_side.precompile is precompile
