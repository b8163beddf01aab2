"""An exception escaping a forward (with grad, or an evaluation forward under ``no_grad``) or a
backward leaves FSDP ready: the next optimizer step is either correct or refused before any main
weight changes, and after ``zero_grad()`` training continues bit for bit like a run that never saw
the exception (issue 17, defect B; the rule is in docs/fsdp.md, "Misuse, errors and recovery").

In process at world size 1 (a one-rank gloo group): ZeRO-3 gathers every plane into a bucket at
any world size, so the plane lifecycle is the one of a spawned world, at a fraction of the cost.
Each test runs a clean model next to one that sees the exception, from the same initial values
and batches, with forward prefetch on (the exception comes in the second iteration).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.torch_side.toy_models import Block, make_batch, make_net, mse
from torch_side import FSDPOptimizer, ShardingStrategy, fully_shard

T = 32


class BadBatch(ValueError):
    """What the model raises on a bad micro-batch (or, armed, from its backward)."""


@pytest.fixture(scope="module", autouse=True)
def world1():
    """A one-rank gloo group in this process, for this module only (other modules test the
    uninitialised case)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


class Trap:
    """Makes the middle unit (``blocks.0``) fail after its first MXFP8 layer read its planes:
    its forward raises on a micro-batch holding NaN (a model that validates its activations),
    and, while ``backward_armed``, its backward raises."""

    def __init__(self, net):
        self.backward_armed = False
        net.blocks[0].mlp.fc1.register_forward_hook(self._after_fc1)

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
    model: object
    opt: FSDPOptimizer
    trap: Trap


def _run(strategy=ShardingStrategy.OPTIM_GRADS_PARAMS) -> Run:
    net = make_net(0)
    trap = Trap(net)
    model = fully_shard(net, unit_modules=(Block,), strategy=strategy)
    return Run(model, FSDPOptimizer(model, torch.optim.Adam, lr=1e-2, foreach=False), trap)


def _step(run: Run, seed: int) -> torch.Tensor:
    x, y = make_batch(seed, T)
    loss = mse(run.model(x), y)
    loss.backward()
    run.opt.step()
    run.opt.zero_grad()
    return loss.detach()


def _bad_batch() -> torch.Tensor:
    x, _ = make_batch(99, T)
    x[3, 5] = float("nan")
    return x


def _mains(run: Run) -> list[torch.Tensor]:
    return [g.main.clone() for g in run.model.param_groups]


def _assert_same_mains(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(u, v), f"{what}: group {i} max diff {(u - v).abs().max().item()}"


def _assert_trains_like(clean: Run, hit: Run, steps=(2, 3)) -> None:
    """The next steps give the same losses and main weights, bit for bit, and free every bucket."""
    for s in steps:
        want, got = _step(clean, s), _step(hit, s)
        assert torch.equal(got, want), (s, got.item(), want.item())
    _assert_same_mains(_mains(clean), _mains(hit), "after the recovery")
    assert hit.model.allocator.live_keys() == [], hit.model.allocator.live_keys()


def _start() -> tuple[Run, Run]:
    clean, hit = _run(), _run()
    assert torch.equal(_step(clean, 0), _step(hit, 0))  # the execution order is frozen: prefetch
    return clean, hit


def test_a_forward_that_raises_leaves_no_unsharded_plane_and_the_next_step_is_correct():
    clean, hit = _start()
    with pytest.raises(BadBatch):
        mse(hit.model(_bad_batch()), make_batch(99, T)[1]).backward()
    assert hit.model.allocator.live_keys() == [], "buckets of the aborted forward are still live"
    # (i) a step now is the step of a run that never saw the bad micro-batch (no gradient came)
    clean.opt.step()
    hit.opt.step()
    _assert_same_mains(_mains(clean), _mains(hit), "the step after the aborted forward")
    # (ii) zero_grad, then training continues exactly like the clean run
    clean.opt.zero_grad()
    hit.opt.zero_grad()
    _assert_trains_like(clean, hit)


def test_a_forward_that_raises_mid_accumulation_keeps_the_other_micro_batches():
    """A bad micro-batch skipped inside gradient accumulation: the step uses the good ones."""
    clean, hit = _start()
    for run in (clean, hit):
        x, y = make_batch(1, T)
        mse(run.model(x), y).backward()
    with pytest.raises(BadBatch):
        hit.model(_bad_batch())
    assert hit.model.allocator.live_keys() == [], "the aborted forward holds gathered planes"
    for run in (clean, hit):
        x, y = make_batch(2, T)
        mse(run.model(x), y).backward()
        run.opt.step()
        run.opt.zero_grad()
    _assert_same_mains(_mains(clean), _mains(hit), "the step with the bad micro-batch skipped")
    _assert_trains_like(clean, hit)


def test_an_evaluation_forward_that_raises_under_no_grad_leaves_training_exact():
    """An evaluation between a backward and its step raises: the step is still the right one."""
    clean, hit = _start()
    for run in (clean, hit):
        x, y = make_batch(1, T)
        mse(run.model(x), y).backward()
    with torch.no_grad(), pytest.raises(BadBatch):
        hit.model(_bad_batch())
    assert hit.model.allocator.live_keys() == [], hit.model.allocator.live_keys()
    for run in (clean, hit):
        run.opt.step()
    _assert_same_mains(_mains(clean), _mains(hit), "the step after the failed evaluation")
    with torch.no_grad():  # a good evaluation forward reads the new planes
        x, _ = make_batch(5, T)
        assert torch.equal(hit.model(x), clean.model(x))
    clean.opt.zero_grad()
    hit.opt.zero_grad()
    _assert_trains_like(clean, hit)


def test_a_step_after_a_forward_that_bypassed_the_root_is_refused_before_any_change():
    """An exception escaping a forward of the inner module (``fsdp.module(x)``, which FSDP's root
    cannot catch) leaves planes unsharded: the step refuses before touching a main weight, and
    zero_grad() resets FSDP."""
    clean, hit = _start()
    with pytest.raises(BadBatch):
        hit.model.module(_bad_batch())
    before = _mains(hit)
    with pytest.raises(RuntimeError, match=r"rank 0: FSDPOptimizer.step\(\): .*zero_grad\(\)"):
        hit.opt.step()
    _assert_same_mains(before, _mains(hit), "a refused step")
    hit.opt.zero_grad()
    assert hit.model.allocator.live_keys() == [], hit.model.allocator.live_keys()
    _assert_trains_like(clean, hit, steps=(1, 2))


def test_a_backward_that_raises_is_refused_at_the_step_then_recovered_by_zero_grad():
    clean, hit = _start()
    hit.trap.backward_armed = True
    x, y = make_batch(1, T)
    with pytest.raises(BadBatch):
        mse(hit.model(x), y).backward()
    hit.trap.backward_armed = False
    before = _mains(hit)
    with pytest.raises(RuntimeError, match=r"rank 0: FSDPOptimizer.step\(\): .*zero_grad\(\)"):
        hit.opt.step()
    _assert_same_mains(before, _mains(hit), "a refused step")
    hit.opt.zero_grad()
    _assert_trains_like(clean, hit, steps=(1, 2))
