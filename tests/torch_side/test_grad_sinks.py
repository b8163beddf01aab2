"""Unit programs hand a group's gradients to FSDP in one piece (``GroupGradSink``).

Under FSDP, a unit program lays the gradients of each parameter group out as the group's grad
bucket (``jax_side.unit_program.GradGroup``: cast to the bucket's dtype, zeros in the padding)
and FSDP takes that buffer whole (``GradReducer.stage_flat``: adopted as the bucket) instead of
staging each parameter's gradient from an autograd hook. Checked here, world 1 in process: the
reduced gradients are the same bytes as through the per-parameter hooks, the hooks stage nothing
of a unit program's parameters, ``GradCheck.FINITE`` still names the parameter, a wrong
segment is refused.
"""

from __future__ import annotations

import collections

import pytest
import torch

from common.model_config import GPTConfig
from models.torch_gpt import Block, TorchGPT
from torch_side import GradCheck, fully_shard
from torch_side.fsdp.fsdp_unit import ParamShare, WeightPlanes
from torch_side.fsdp.grad_reducer import GradReducer

CFG = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=2, d_model=64, d_ff=128)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab_size, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _model(**kw):
    return fully_shard(TorchGPT(CFG, seed=3, compute="unit"), unit_modules=(Block,), **kw)


def _counted(monkeypatch) -> collections.Counter:
    calls = collections.Counter()
    for name in ("stage", "stage_flat"):
        real = getattr(GradReducer, name)

        def wrap(self, *a, _real=real, _name=name):
            calls[_name, self.label] += 1
            return _real(self, *a)

        monkeypatch.setattr(GradReducer, name, wrap)
    return calls


def _main_grads(model) -> dict[str, torch.Tensor]:
    return {g.label: g.main_grad.clone() for u in model.units for g in u.groups
            if g.takes_grads}


def test_unit_gradients_reach_the_grad_buckets_in_one_add_per_group_same_bytes(
        single_rank_world, monkeypatch):
    calls = _counted(monkeypatch)
    sinks = _model()
    for step in range(2):  # two micro-batches accumulate into the main grads
        sinks(*_batch(step)).backward()
    got = _main_grads(sinks)
    staged = dict(calls)
    # every group's buffer came first in its micro-batch (the head's before the embeddings'
    # hooks): each became its bucket, no zero-fill, add or copy
    flats = sum(n for (kind, _), n in staged.items() if kind == "stage_flat")
    assert sinks.allocator.adopted == flats > 0
    calls.clear()
    # sources that name no target: the per-parameter hook path
    monkeypatch.setattr(WeightPlanes, "grad_target", lambda self: None)
    monkeypatch.setattr(ParamShare, "grad_target", lambda self: None)
    hooks = _model()
    for step in range(2):
        hooks(*_batch(step)).backward()
    want = _main_grads(hooks)
    assert got.keys() == want.keys()
    for label in got:
        assert torch.equal(got[label].view(torch.uint8), want[label].view(torch.uint8)), label
    blocks = {g.label for u in sinks.units if u.module is not sinks.module for g in u.groups}
    assert blocks and all(staged.get(("stage_flat", b)) == 2 for b in blocks), staged
    assert not any(kind == "stage" and label in blocks for kind, label in staged), staged
    # the root's embeddings are not in a unit program: their hooks still stage them
    assert any(kind == "stage" for kind, _ in staged), staged
    assert all(kind == "stage" for kind, _ in calls), dict(calls)  # (the hook path's run)


def test_a_nan_gradient_of_a_unit_program_is_named(single_rank_world):
    model = _model(grad_check=GradCheck.FINITE)
    loss = model(*_batch(0)) * float("nan")
    with pytest.raises(FloatingPointError, match=r"rank 0: gradient of parameter '(lm_head|ln_f)"):
        loss.backward()


def test_a_flat_gradient_buffer_of_another_shape_is_refused(single_rank_world):
    model = _model()
    g = next(g for u in model.units for g in u.groups if g.takes_grads)
    n, dtype, _ = g.grad_slot(0)
    with pytest.raises(ValueError, match=f"must match the grad bucket \\(\\({n},\\)"):
        g.stage_grads(torch.zeros(n + 1, dtype=dtype))
    g.drop_grads()

