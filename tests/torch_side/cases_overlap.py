"""Spawned-rank cases: communication overlapped with compute (``torch_side.Overlap``).

Spawned, not in-process (``tests/torch_side/conftest.py``): their subject is gloo's own
asynchronous worker thread, which the threaded process group does not have.

1. The overlap settings never change a bit: the GPT trained under ZeRO-3 with micro-batches
   (unit compute, and per-linear compute with activation recompute) gives the same losses, main
   weights and reduced gradients, byte for byte, with no overlap (gather on demand, synchronous
   reductions), one unit of prefetch and asynchronous reductions (the default), and three units
   of prefetch with two reductions in flight. The collectives are the same ones in the same order
   on every rank, only issued earlier and waited for later.
2. The bucket memory of a ZeRO-3 step is known from the layout: with prefetch depth ``d`` the
   pool's peak (``peak_reserved_bytes``, everything it held at once) is at most

       root unit's planes + (d + 1) * a block's planes + root's grad bucket
       + (1 + reductions_in_flight) * a block's grad bucket

   in backward (forward: root + (d + 1) blocks' forward planes), and the gathered-plane peak
   reaches the forward term: the prefetched units really are held (a schedule that gathered
   less would fail the lower bound, one that freed late the upper). The bound does not depend
   on timing: it holds when gloo's thread lets go of a finished gather's bucket late (played:
   0.3 s, beyond the 0.1 s wait that made it flaky; issue 30, item 13) and with the cyclic
   garbage collector off.
3. The trace of a step (``common.trace``): the forward all-gather of unit i + 1 is issued before
   unit i's forward finishes, and (with ``prefetch=0``) not before it.
"""

from __future__ import annotations

import dataclasses
import gc
import threading

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from common import trace
from common.model_config import GPTConfig
from models.torch_gpt import Block, TorchGPT
from torch_side import FSDPOptimizer, Overlap, ShardingStrategy, fully_shard

CFG = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=4, n_head=2, d_model=64, d_ff=128)
B, S, LR = 2, 32, 0.5
SCHEDULES = (Overlap.none(), Overlap(), Overlap(prefetch=3, reductions_in_flight=2))


def _batch(step: int, mb: int, device):
    g = torch.Generator().manual_seed(1000 * step + mb + 17 * dist.get_rank())
    tokens = torch.randint(0, CFG.vocab_size, (B, S + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _checkpointed(forward):
    def run(x):
        return checkpoint(forward, x, use_reentrant=False)

    return run


def _model(ctx, overlap: Overlap, compute: str = "unit", recompute: bool = False):
    unit = compute == "unit"
    net = TorchGPT(CFG, seed=3, device=ctx.device, compute=compute, recompute=unit and recompute)
    if recompute and not unit:  # per-linear compute: Torch's activation checkpointing
        for block in net.blocks:
            block.forward = _checkpointed(block.forward)
    overlap = dataclasses.replace(overlap, streams_at_world_1=ctx.comm_streams)
    return fully_shard(net, unit_modules=(Block,), strategy=ShardingStrategy.OPTIM_GRADS_PARAMS,
                       overlap=overlap)


def _step(model, opt, step: int, micro_batches: int, ctx, before_step=None):
    losses = []
    for mb in range(micro_batches):
        tokens, targets = _batch(step, mb, ctx.device)
        loss = model(tokens, targets) / micro_batches
        loss.backward()
        losses.append(loss.detach().clone())
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad()
    return losses


def _run(ctx, overlap: Overlap, compute: str, recompute: bool):
    model = _model(ctx, overlap, compute, recompute)
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=LR)
    losses, grads = [], []
    for step in range(2):  # the first records the order; prefetch runs in the second
        losses += _step(model, opt, step, 2, ctx,
                        lambda: grads.append([g.main_grad.clone() for g in model.param_groups]))
    assert model.allocator.live_keys() == [], model.allocator.live_keys()
    return losses, grads, model.full_state_dict()


def _same(what, a, b):
    assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max().item()}"


def _bytes_do_not_depend_on_the_schedule(ctx, compute: str, recompute: bool):
    runs = [_run(ctx, o, compute, recompute) for o in SCHEDULES]
    for o, (losses, grads, state) in zip(SCHEDULES[1:], runs[1:], strict=True):
        ref_losses, ref_grads, ref_state = runs[0]
        for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            _same(f"{o} loss {i}", a, b)
        for step, (gs, rs) in enumerate(zip(grads, ref_grads, strict=True)):
            for k, (a, b) in enumerate(zip(gs, rs, strict=True)):
                _same(f"{o} step {step} main_grad of group {k}", a, b)
        for name in ref_state:
            _same(f"{o} {name}", state[name], ref_state[name])


def case_overlap_unit_compute_bytes(ctx):
    _bytes_do_not_depend_on_the_schedule(ctx, "unit", recompute=False)


def case_overlap_op_recompute_bytes(ctx):
    _bytes_do_not_depend_on_the_schedule(ctx, "op", recompute=True)


def _plane_bytes(unit, which: str) -> int:
    total = 0
    for g in unit.groups:
        plane = g.forward_plane if which == "forward" else g.backward_plane
        total += g.layout.padded_numel * g.model[plane].element_size()
    return total


def _grad_bytes(unit) -> int:
    return sum(g.layout.padded_numel * g.grad_slot(0).dtype.itemsize
               for g in unit.groups if g.takes_grads)


def _bounds(model, overlap: Overlap) -> tuple[int, int]:
    """(forward, backward) bucket bytes of a ZeRO-3 step by the layout (module note, 2)."""
    root = next(u for u in model.units if u.module is model.module)
    block = next(u for u in model.units if u is not root)
    assert all(_plane_bytes(u, "forward") == _plane_bytes(block, "forward")
               for u in model.units if u is not root)
    n = min(overlap.prefetch + 1, CFG.n_layer)
    forward = _plane_bytes(root, "forward") + n * _plane_bytes(block, "forward")
    backward = (_plane_bytes(root, "backward") + n * _plane_bytes(block, "backward")
                + _grad_bytes(root)
                + (1 + overlap.reductions_in_flight) * _grad_bytes(block))
    return forward, backward


def case_peak_bucket_bytes_follow_the_layout(ctx):
    for depth in (0, 1, 2):
        overlap = Overlap(prefetch=depth)
        model = _model(ctx, overlap)
        opt = FSDPOptimizer(model, torch.optim.SGD, lr=LR)
        _step(model, opt, 0, 1, ctx)  # records the execution order
        forward, backward = _bounds(model, overlap)
        model.allocator.reset_peaks()
        _step(model, opt, 1, 1, ctx)
        peak, reserved = model.allocator.peak_bytes, model.allocator.peak_reserved_bytes
        assert forward <= peak <= max(forward, backward), (depth, forward, peak, backward)
        assert reserved <= max(forward, backward), (depth, reserved, forward, backward)
        assert model.allocator.held_bytes == 0  # nothing outside FSDP kept a bucket


def _let_go_late(comm, label: str, after_s: float) -> list[str]:
    """From now on the collective of ``label`` keeps its tensors referenced (a view of each,
    as gloo's work does) for ``after_s`` after it was issued, as gloo's thread does when it is
    not scheduled for that long; returns the labels it was done to."""
    issue, done = comm._issue, []

    def late_issue(op, phase, what, t, call, async_op, tensors=()):
        def late_call(async_):
            work = call(async_)
            if what == label:
                held = [x[1:] for x in tensors]
                timer = threading.Timer(after_s, held.clear)
                timer.daemon = True
                timer.start()
                done.append(what)
            return work

        return issue(op, phase, what, t, late_call, async_op, tensors)

    comm._issue = late_issue
    return done


def case_peak_bucket_bytes_do_not_depend_on_timing(ctx):
    """Issue 30, item 13: the bound failed once (446464 B against 417792 at depth 1): gloo's
    thread let go of a gathered bucket later than the 0.1 s the wait then allowed, and the
    bucket was still held when the next unit's gather asked the pool. Played here, and with
    the cyclic garbage collector off: no bucket waits on it either."""
    overlap = Overlap(prefetch=1)
    model = _model(ctx, overlap)
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=LR)
    _step(model, opt, 0, 1, ctx)
    forward, backward = _bounds(model, overlap)
    done = _let_go_late(model.comms["dp"], "h_2/mxfp8_e4m3/dp/colwise", after_s=0.3)
    model.allocator.reset_peaks()
    collecting = gc.isenabled()
    gc.disable()
    try:
        _step(model, opt, 1, 1, ctx)
    finally:
        if collecting:
            gc.enable()
    reserved = model.allocator.peak_reserved_bytes
    assert done and reserved <= max(forward, backward), (done, reserved, forward, backward)
    assert model.allocator.held_bytes == 0


def _forward_spans(events):
    return {e["name"].removeprefix("forward "): e for e in events
            if e.get("cat") == "compute: units" and e["name"].startswith("forward ")}


def _gather_issues(events, units):
    """{unit name: issue time of its first forward-phase all-gather}."""
    out = {}
    for e in events:
        if e.get("cat", "").startswith("comm: all-gather") and e["args"].get("phase") == "forward":
            label = e["name"].split(" ", 1)[1]  # "<unit>/<format>/<dp group>/<plane>"
            for u in units:
                if label.startswith(f"{u}/"):  # (CUDA: ts is the GPU start; issued_us the host's)
                    out.setdefault(u, e["args"].get("issued_us", e["ts"]))
    return out


def case_trace_shows_the_gather_of_the_next_unit_issued_during_this_one(ctx):
    for depth in (1, 0):
        model = _model(ctx, Overlap(prefetch=depth))
        opt = FSDPOptimizer(model, torch.optim.SGD, lr=LR)
        _step(model, opt, 0, 1, ctx)
        with trace.recording(trace.Recorder(ctx.rank)) as rec:
            _step(model, opt, 1, 1, ctx)
        events = rec.events()
        blocks = [u.name for u in model.units if u.module is not model.module]
        spans, issues = _forward_spans(events), _gather_issues(events, blocks)
        assert len(blocks) == CFG.n_layer and set(blocks) <= set(spans), (blocks, list(spans))
        for here, nxt in zip(blocks, blocks[1:], strict=False):
            end = spans[here]["ts"] + spans[here]["dur"]
            issued = issues[nxt]
            if depth:
                assert issued < end, f"{nxt} gathered at {issued}, after {here} ended at {end}"
            else:
                assert issued > end, f"{nxt} gathered at {issued} without prefetch"
        assert any(e.get("name") == "bucket bytes" for e in events)
        assert any(e.get("cat") == "jax: unit programs (dispatch)" for e in events)
