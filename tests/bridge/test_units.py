"""Unit compute (``bridge.units``): one JAX program per block and direction.

- bit-identical to the Flax twin on the same bytes (fp32 and bf16 activations; the test process
  rounds bf16 at every op, tests/conftest.py);
- within a stated bound of the per-linear op path (they differ where LayerNorm, attention, GELU
  and the loss run in JAX instead of Torch);
- activation recompute inside the backward program gives the same bits as keeping residuals;
- a user-registered block type; an evaluation forward; the binding that keeps what a unit
  found (and does not keep the model alive); the errors.
FSDP strategies, world sizes and micro-batches: tests/torch_side/test_units_fsdp.py.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import jax
import numpy as np
import pytest
import torch
from torch import nn

from bridge import MXFP8Linear, count_crossings, resolve_for
from bridge.unit_bindings import binding_of
from bridge.units import register_unit, run_unit, set_compute
from common.model_config import TINY
from common.modes import Activations, Compute
from models import gpt_math as gm
from models.flax_gpt import FlaxGPT, cross_entropy, flat_params, nested_params
from models.torch_gpt import TorchGPT
from tests.bridge.residual_refs import recording_residuals
from tests.compiles import COMPILES

B, S = 2, 64  # every test uses these shapes: the programs compile once per process


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, TINY.vocab_size, (B, S), generator=g),
            torch.randint(0, TINY.vocab_size, (B, S), generator=g))


def _loss_and_grads(model, tokens, targets):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow  # compiles the whole Flax model (~30 s per activation mode on 2 cores)
@pytest.mark.parametrize("acts", [Activations.FP32, Activations.BF16])
def test_unit_path_is_bit_identical_to_the_flax_twin(acts):
    model = TorchGPT(TINY, seed=1, activations=acts, compute="unit")
    tokens, targets = _batch(0)
    loss, grads = _loss_and_grads(model, tokens, targets)
    # the kernels the Torch model's CPU programs ran (a GPU machine's default would be Pallas)
    flax = FlaxGPT(TINY, activations=acts, fused_attention=False,
                   kernels=resolve_for(None, torch.device("cpu")))
    cpu = jax.devices("cpu")[0]  # where the Torch model's programs ran (also on a GPU machine)
    params = nested_params({n: jax.device_put(p.detach().numpy(), cpu)
                            for n, p in model.named_parameters()})

    @jax.jit
    def value_and_grad(params, tok, tgt):
        with jax.numpy_dtype_promotion("standard"):  # attention's backward rule (unit_program)
            return jax.value_and_grad(
                lambda p: cross_entropy(flax.apply({"params": p}, tok), tgt))(params)

    want_loss, want = value_and_grad(
        params, jax.device_put(tokens.numpy().astype(np.int32), cpu),
        jax.device_put(targets.numpy().astype(np.int32), cpu))
    assert np.asarray(want_loss).tobytes() == loss.numpy().tobytes()
    for name, g in flat_params(want).items():
        assert np.asarray(g).tobytes() == grads[name].numpy().tobytes(), name


# (relative loss difference, worst relative L2 difference of a parameter's gradient). Observed on
# CPU (tiny GPT, model seed 1, batch seeds 2-4): fp32 <= 9.8e-8 and 2.3e-5 .. 2.4e-2 (one fp32
# rounding difference in LayerNorm or softmax can move an activation or dy element across an
# E4M3 rounding boundary, which changes that element's product in every GEMM reading it); bf16
# <= 1.4e-4 and <= 6.1e-2 (bf16 LayerNorm / GELU / attention outputs round differently).
BOUNDS = {Activations.FP32: (1e-6, 0.05), Activations.BF16: (1e-3, 0.15)}


@pytest.mark.slow
@pytest.mark.parametrize("acts", [Activations.FP32, Activations.BF16])
def test_unit_path_stays_within_the_stated_bound_of_the_op_path(acts):
    tokens, targets = _batch(2)
    unit_loss, unit = _loss_and_grads(
        TorchGPT(TINY, seed=1, activations=acts, compute="unit"), tokens, targets)
    op_loss, op = _loss_and_grads(
        TorchGPT(TINY, seed=1, activations=acts, compute="op"), tokens, targets)
    loss_bound, grad_bound = BOUNDS[acts]
    assert abs(float(unit_loss - op_loss)) <= loss_bound * abs(float(op_loss))
    worst = max(float((unit[n].float() - op[n].float()).norm() / op[n].float().norm())
                for n in op)
    assert worst <= grad_bound, worst
    assert any(not torch.equal(unit[n], op[n]) for n in op)  # two different computations


@pytest.mark.slow
def test_recompute_inside_the_backward_program_gives_the_same_bits():
    tokens, targets = _batch(3)
    keep = _loss_and_grads(TorchGPT(TINY, seed=1, compute="unit"), tokens, targets)
    redo = _loss_and_grads(TorchGPT(TINY, seed=1, compute="unit", recompute=True), tokens,
                           targets)
    assert torch.equal(keep[0], redo[0])
    for n, g in keep[1].items():
        assert torch.equal(g, redo[1][n]), n


def test_residuals_die_with_the_graphs_saved_tensors_not_with_the_loss(monkeypatch):
    """The forward's JAX residuals are freed right after each unit's backward, while the loss
    (and so the graph object) is still referenced -- by reference counts alone, the cyclic
    collector off; a retained graph keeps them for a second backward, which accumulates the
    same gradients again, and a third raises Torch's own error."""
    refs = recording_residuals(monkeypatch)
    tokens, targets = _batch(6)
    model = TorchGPT(TINY, seed=1, compute="unit")
    gc.disable()
    try:
        loss = model(tokens, targets)
        assert len(refs) > 10 and all(r() is not None for r in refs)
        loss.backward(retain_graph=True)
        assert all(r() is not None for r in refs), "a retained graph keeps its residuals"
        once = {n: p.grad.clone() for n, p in model.named_parameters()}
        loss.backward()
        alive = sum(r() is not None for r in refs)
        assert alive == 0, f"{alive} of {len(refs)} residuals outlived the backward"
    finally:
        gc.enable()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, 2 * once[n]), n
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_an_evaluation_forward_gives_the_training_forward_bits_and_keeps_nothing():
    model = TorchGPT(TINY, seed=1, compute="unit")
    tokens, targets = _batch(4)
    with torch.no_grad():
        evaluated = model(tokens, targets)
    assert not evaluated.requires_grad
    assert torch.equal(evaluated, model(tokens, targets).detach())


def test_switching_compute_back_to_op_restores_the_torch_forward():
    model = TorchGPT(TINY, seed=1, compute="unit")
    tokens, targets = _batch(5)
    op_loss = TorchGPT(TINY, seed=1)(tokens, targets)
    model.set_compute("op")
    assert model.compute is Compute.OP and "forward" not in model.h_0.__dict__
    assert torch.equal(model(tokens, targets), op_loss)


def test_what_a_unit_found_is_bound_beside_the_module_and_dies_with_it():
    # one typed binding per block (bridge.unit_bindings), nothing written on the module but its
    # forward; the map holds the binding weakly, so the model and its binding go together
    model = TorchGPT(TINY, seed=1, compute="unit")
    model(*_batch(4)).backward()
    binding = binding_of(model.h_0)
    assert binding is not None and binding.programs and binding.span is None
    assert set(model.h_0.__dict__) - set(nn.Module().__dict__) == {
        "forward", "activations"}  # the UnitForward set_compute installed, the block's own
    refs = weakref.ref(model), weakref.ref(binding)
    del model, binding
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_one_crossing_back_per_unit_and_direction():
    model = TorchGPT(TINY, seed=1, compute="unit")
    tokens, targets = _batch(6)
    units = TINY.n_layer + 1  # the blocks and the head
    with count_crossings() as fwd:
        loss = model(tokens, targets)
    with count_crossings() as bwd:
        loss.backward()
    assert fwd.to_torch == units and bwd.to_torch == units, (fwd, bwd)


# ------------------------------------------------------------------ a block type a user registers


@dataclasses.dataclass(frozen=True)
class _ResMLPFn:
    """The user's JAX function: x + down(gelu(up(norm(x))))."""

    eps: float

    def __call__(self, params, linear, x):
        h = gm.layer_norm(x, params["norm.weight"], params["norm.bias"], self.eps)
        return x + gm.mlp(h, fc=lambda t: linear("up", t), proj=lambda t: linear("down", t))


class _ResMLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.norm = nn.LayerNorm(d, eps=1e-5)
        self.up = MXFP8Linear(d, f, bias=False)
        self.down = MXFP8Linear(f, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(nn.functional.gelu(self.up(h), approximate="tanh"))


register_unit(_ResMLP, lambda m: _ResMLPFn(m.norm.eps))


def test_a_registered_block_type_runs_as_a_unit_and_matches_its_torch_forward():
    torch.manual_seed(0)
    model = nn.Sequential(_ResMLP(64, 128), _ResMLP(64, 128))
    x = torch.randn(B, 32, 64, requires_grad=True)
    want = model(x)
    want.square().sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    assert set_compute(model, Compute.UNIT) == 2
    got = model(x)
    got.square().sum().backward()
    got_grads = [p.grad for p in model.parameters()] + [x.grad]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


def test_the_unit_programs_compile_once_for_all_blocks():
    model = TorchGPT(TINY, seed=7, compute="unit")
    tokens, targets = _batch(8)
    model(tokens, targets).backward()  # compiles (or finds) the programs of these shapes
    before = COMPILES.count
    model.zero_grad()
    model(tokens, targets).backward()
    assert COMPILES.count == before


# ------------------------------------------------------------------------------------- errors


def test_a_linear_with_a_bias_is_refused_by_name():
    class Biased(_ResMLP):
        def __init__(self):
            super().__init__(64, 128)
            self.up = MXFP8Linear(64, 128, bias=True)

    register_unit(Biased, lambda m: _ResMLPFn(1e-5))
    with pytest.raises(ValueError, match="'up' is an MXFP8Linear with a bias"):
        run_unit(Biased(), _ResMLPFn(1e-5), torch.randn(32, 64))


def test_bad_compute_settings_are_refused():
    with pytest.raises(ValueError, match="linear_impl=torch"):
        TorchGPT(TINY, compute="unit", linear_impl="torch")
    with pytest.raises(ValueError, match="torch.utils.checkpoint"):
        TorchGPT(TINY, compute="op", recompute=True)
    with pytest.raises(ValueError, match="unknown compute granularity 'units'"):
        TorchGPT(TINY, compute="units")
    with pytest.raises(ValueError, match="targets of shape"):
        TorchGPT(TINY, compute="unit")(*_batch(0)[:1], torch.zeros(B, S + 1, dtype=torch.long))


@pytest.mark.gpu
def test_on_the_gpu_the_unit_path_stays_within_the_bound_of_the_op_path():
    """bf16 activations with cuDNN attention (unit) against SDPA (op), on CUDA."""
    tokens, targets = (t.cuda() for t in _batch(2))
    unit_loss, unit = _loss_and_grads(
        TorchGPT(TINY, seed=1, activations="bf16", compute="unit", device="cuda"), tokens,
        targets)
    op_loss, op = _loss_and_grads(
        TorchGPT(TINY, seed=1, activations="bf16", compute="op", device="cuda"), tokens, targets)
    loss_bound, grad_bound = BOUNDS[Activations.BF16]
    assert abs(float(unit_loss - op_loss)) <= loss_bound * abs(float(op_loss))
    worst = max(float((unit[n].float() - op[n].float()).norm() / op[n].float().norm())
                for n in op)
    assert worst <= grad_bound, worst
