"""TorchGPT: parameter names and shapes (shared with FlaxGPT), linear layers are the bridge op,
checkpoint loading with clear errors, and the capture used by the parity report."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apps.parity.torch_run import run_torch
from bridge import MXFP8Linear
from common import GPTConfig, LinearMode
from models.torch_gpt import TorchGPT, cross_entropy, load_flat_params, mxfp8_linears
from tests.compiles import COMPILES

CFG = GPTConfig(vocab_size=64, max_seq_len=64, n_layer=2, n_head=2, d_model=64, d_ff=64)


def test_names_shapes_and_linear_layers():
    model = TorchGPT(CFG)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for name, shape in CFG.linear_shapes().items():
        assert shapes.pop(name) == shape
    assert shapes == {
        "wte.weight": (64, 64),
        "wpe.weight": (64, 64),
        "ln_f.weight": (64,),
        "ln_f.bias": (64,),
        **{
            f"h_{i}.{ln}.{p}": (64,)
            for i in range(2)
            for ln in ("ln_1", "ln_2")
            for p in ("weight", "bias")
        },
    }
    layers = dict(mxfp8_linears(model))
    assert sorted(n + ".weight" for n in layers) == sorted(CFG.linear_shapes())
    assert all(
        isinstance(m, MXFP8Linear) and m.bias is None and m.mode is LinearMode.MXFP8
        for m in layers.values()
    )
    hp = TorchGPT(CFG, LinearMode.HIGH_PRECISION)
    assert all(m.mode is LinearMode.HIGH_PRECISION for _, m in mxfp8_linears(hp))


def test_same_seed_same_weights():
    a, b = TorchGPT(CFG, seed=3), TorchGPT(CFG, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_load_flat_params_copies_and_checks():
    model = TorchGPT(CFG)
    flat = {n: np.full(tuple(p.shape), 0.5, np.float32) for n, p in model.named_parameters()}
    load_flat_params(model, flat)
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    flat["wte.weight"][0, 0] = 7.0
    assert float(model.wte.weight.detach()[0, 0]) == 0.5  # a copy, not a view
    with pytest.raises(KeyError, match=r"missing \['lm_head.weight'\]"):
        load_flat_params(model, {n: a for n, a in flat.items() if n != "lm_head.weight"})
    with pytest.raises(ValueError, match="ln_f.bias has shape"):
        load_flat_params(model, {**flat, "ln_f.bias": np.zeros(3, np.float32)})


def test_sequence_longer_than_max_is_refused():
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        TorchGPT(CFG)(torch.zeros(1, 65, dtype=torch.long))


def test_capture_sees_every_linear_with_token_major_shapes():
    """21 tokens (not a multiple of 32): every linear's x, y, dy, dx is captured as (21, C)."""
    model = TorchGPT(CFG, seed=1)
    tokens = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    run = run_torch(model, tokens, tokens.roll(-1, dims=1))
    assert run.logits.shape == (3, 7, 64) and run.loss.shape == ()
    for name, layer in mxfp8_linears(model):
        io = run.linear_io[name]
        assert io.x.shape == io.dx.shape == (21, layer.in_features)
        assert io.y.shape == io.dy.shape == (21, layer.out_features)
    assert run.grads.keys() == dict(model.named_parameters()).keys()
    assert all(
        bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0) for g in run.grads.values()
    )
    # the captured lm_head output is the logits
    assert torch.equal(run.linear_io["lm_head"].y, run.logits.reshape(21, 64))


def _steps_compiles(n_layer: int, steps: int = 2) -> list[int]:
    cfg = GPTConfig(vocab_size=96, max_seq_len=32, n_layer=n_layer, n_head=2, d_model=64,
                    d_ff=160)  # shapes no other test uses: every program here is compiled anew
    model = TorchGPT(cfg, LinearMode.MXFP8, seed=1)
    out = []
    for i in range(steps):
        before = COMPILES.count
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        cross_entropy(model(tokens), tokens).backward()
        out.append(COMPILES.count - before)
    return out


def test_linears_of_equal_shape_compile_once():
    """A 4-layer model compiles exactly as many programs as a 2-layer one (the extra layers'
    linears reuse them), and a second step compiles nothing."""
    two = _steps_compiles(2)
    four = _steps_compiles(4)
    assert two[1] == 0 and four[1] == 0, (two, four)
    assert four[0] == 0, ("the 4-layer model's linears have the 2-layer model's shapes", four)
    assert two[0] > 0
