"""After an exception escapes a forward (with grad, or an evaluation forward under ``no_grad``) or
a backward, FSDP is left ready (issue 17; the user-facing rule: docs/fsdp.md, "Misuse, errors and
recovery"): the next optimizer step is either correct or refused before any main weight changes,
and after ``zero_grad()`` training continues bit for bit like a run that never saw the exception.

Each case runs a clean model next to one that sees the exception, from the same initial values and
batches (every rank the same micro-batch, so every rank raises), with forward prefetch on: the
exception comes in the second iteration. The cases run on every rank of an in-process world
(``threaded_world.py``). ZeRO-3 gathers every plane into a bucket at any world size, so world
size 1 covers the plane lifecycle; world size 2 adds prefetch gathers still in flight at the
exception.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.torch_side.threaded_world import run_world
from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import FSDPModel, FSDPOptimizer, ShardingStrategy, fully_shard

T = 32


def _wrap(ctx) -> FSDPModel:
    return fully_shard(make_net(0, device=ctx.device), unit_modules=(Block,),
                       strategy=ShardingStrategy.OPTIM_GRADS_PARAMS)


def _expect(error, match: str, fn, *args) -> str:
    """``fn(*args)`` raises ``error`` whose message holds ``match`` (a substring); the message."""
    try:
        fn(*args)
    except error as e:
        assert match in str(e), str(e)
        return str(e)
    raise AssertionError(f"expected {error.__name__} matching {match!r}")


class BadBatch(ValueError):
    """What the model raises on a bad micro-batch (or, armed, from its backward)."""


class Trap:
    """Makes the middle unit (``blocks.0``) fail after its first MXFP8 layer read its planes:
    its forward raises on a micro-batch holding NaN (a model that validates its activations),
    and, while ``backward_armed``, its backward raises."""

    def __init__(self, model: FSDPModel):
        self.backward_armed = False
        model.module.blocks[0].mlp.fc1.register_forward_hook(self._after_fc1)

    def _after_fc1(self, module, args, out):
        if torch.isnan(out).any():
            raise BadBatch("bad micro-batch: NaN activations in blocks.0")
        if self.backward_armed and out.requires_grad:
            out.register_hook(self._raise)

    @staticmethod
    def _raise(grad):
        raise BadBatch("bad gradient in blocks.0")


@dataclasses.dataclass
class Run:
    model: FSDPModel
    opt: FSDPOptimizer
    trap: Trap
    device: str

    def batch(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(seed, T, self.device)

    def micro_batch(self, seed: int) -> torch.Tensor:
        x, y = self.batch(seed)
        loss = mse(self.model(x), y)
        loss.backward()
        return loss.detach()

    def step(self, seed: int) -> torch.Tensor:
        loss = self.micro_batch(seed)
        self.opt.step()
        self.opt.zero_grad()
        return loss

    def bad_batch(self) -> torch.Tensor:
        x, _ = self.batch(99)
        x[3, 5] = float("nan")
        return x

    def mains(self) -> list[torch.Tensor]:
        return [g.main.clone() for g in self.model.param_groups]

    def live(self) -> list:
        return self.model.allocator.live_keys()


def _run(ctx) -> Run:
    model = _wrap(ctx)
    opt = FSDPOptimizer(model, torch.optim.Adam, lr=1e-2, foreach=False)
    return Run(model, opt, Trap(model), ctx.device)


def _start(ctx) -> tuple[Run, Run]:
    clean, hit = _run(ctx), _run(ctx)
    assert torch.equal(clean.step(0), hit.step(0))  # the execution order is frozen: prefetch on
    return clean, hit


def _assert_same_mains(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(u, v), f"{what}: group {i} max diff {(u - v).abs().max().item()}"


def _assert_trains_like(clean: Run, hit: Run, seeds=(2, 3)) -> None:
    """The next steps give the same losses and main weights, bit for bit, and free every bucket."""
    for s in seeds:
        want, got = clean.step(s), hit.step(s)
        assert torch.equal(got, want), (s, got.item(), want.item())
    _assert_same_mains(clean.mains(), hit.mains(), "after the recovery")
    assert hit.live() == [], hit.live()


def _case_forward_that_raises_then_step(ctx):
    """A forward that raises frees every bucket (prefetches in flight waited for); a step right
    after it is the step of a run that never saw it (no gradient came); after zero_grad training
    continues exactly like the clean run."""
    clean, hit = _start(ctx)
    _expect(BadBatch, "bad micro-batch", hit.model, hit.bad_batch())  # grad enabled
    assert hit.live() == [], f"buckets of the aborted forward are still live: {hit.live()}"
    clean.opt.step()
    hit.opt.step()
    _assert_same_mains(clean.mains(), hit.mains(), "the step after the aborted forward")
    clean.opt.zero_grad()
    hit.opt.zero_grad()
    _assert_trains_like(clean, hit)


def _case_forward_that_raises_mid_accumulation(ctx):
    """A bad micro-batch skipped inside gradient accumulation: the step uses the good ones."""
    clean, hit = _start(ctx)
    for run in (clean, hit):
        run.micro_batch(1)
    _expect(BadBatch, "bad micro-batch", hit.model, hit.bad_batch())
    assert hit.live() == [], f"the aborted forward holds gathered planes: {hit.live()}"
    for run in (clean, hit):
        run.step(2)
    _assert_same_mains(clean.mains(), hit.mains(), "the step with the bad micro-batch skipped")
    _assert_trains_like(clean, hit)


def _case_evaluation_forward_that_raises(ctx):
    """An evaluation under no_grad between a backward and its step raises: the step is still the
    right one, and the next evaluation reads the new planes."""
    clean, hit = _start(ctx)
    for run in (clean, hit):
        run.micro_batch(1)
    with torch.no_grad():
        _expect(BadBatch, "bad micro-batch", hit.model, hit.bad_batch())
    assert hit.live() == [], hit.live()
    for run in (clean, hit):
        run.opt.step()
    _assert_same_mains(clean.mains(), hit.mains(), "the step after the failed evaluation")
    with torch.no_grad():
        x, _ = hit.batch(5)
        assert torch.equal(hit.model(x), clean.model(x))
    clean.opt.zero_grad()
    hit.opt.zero_grad()
    _assert_trains_like(clean, hit)


def _case_step_after_a_forward_that_bypassed_the_root_is_refused(ctx):
    """An exception escaping a forward of the inner module (``fsdp.module(x)``, which FSDP's root
    cannot catch) leaves planes gathered: the step refuses before touching a main weight, and
    zero_grad() resets FSDP."""
    clean, hit = _start(ctx)
    _expect(BadBatch, "bad micro-batch", hit.model.module, hit.bad_batch())
    before = hit.mains()
    msg = _expect(RuntimeError, "FSDP is in the middle of an iteration (buckets [", hit.opt.step)
    assert msg.startswith(f"rank {ctx.rank}: FSDPOptimizer.step(): ") and "zero_grad()" in msg
    _assert_same_mains(before, hit.mains(), "a refused step")
    hit.opt.zero_grad()
    assert hit.live() == [], hit.live()
    _assert_trains_like(clean, hit, seeds=(1, 2))


def _case_backward_that_raises(ctx):
    """A backward that raises mid-model: the step refuses (its gradients are partial) before
    touching a main weight, and after zero_grad training continues like the clean run."""
    clean, hit = _start(ctx)
    hit.trap.backward_armed = True
    _expect(BadBatch, "bad gradient", hit.micro_batch, 1)
    hit.trap.backward_armed = False
    before = hit.mains()
    msg = _expect(RuntimeError, "call zero_grad()", hit.opt.step)
    assert msg.startswith(f"rank {ctx.rank}: FSDPOptimizer.step(): "), msg
    _assert_same_mains(before, hit.mains(), "a refused step")
    hit.opt.zero_grad()
    _assert_trains_like(clean, hit, seeds=(1, 2))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_forward_that_raises_frees_its_planes_and_the_next_step_is_correct(world_size):
    run_world(world_size, _case_forward_that_raises_then_step)


def test_a_forward_that_raises_mid_accumulation_keeps_the_other_micro_batches():
    run_world(1, _case_forward_that_raises_mid_accumulation)


def test_an_evaluation_forward_that_raises_under_no_grad_leaves_training_exact():
    run_world(1, _case_evaluation_forward_that_raises)


def test_a_step_after_a_forward_that_bypassed_the_root_is_refused_before_any_change():
    run_world(1, _case_step_after_a_forward_that_bypassed_the_root_is_refused)


def test_a_backward_that_raises_is_refused_at_the_step_then_recovered_by_zero_grad():
    run_world(1, _case_backward_that_raises)
