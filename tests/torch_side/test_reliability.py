"""Misuse and edge cases that used to give silently wrong results (issue 10), in in-process
worlds (``threaded_world.py``).

Each test reads as the rule it pins: an exception escaping backward is recovered from; a second
backward over a retained graph accumulates; state dicts are full and checked; a plain optimizer
and an optimizer step between forward and backward are refused; experts that get no tokens keep
every rank's collectives in step, also as FSDP units of their own; wrapping arguments that match
nothing (or expert units no unit can host) are refused. Each case states the misuse, what FSDP
does now (recover, refuse with a clear error, or support it), and compares against a run without
the misuse where there is one.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist

from tests.torch_side.threaded_world import RankWarnings, run_world
from tests.torch_side.toy_models import (
    EXPERT_GROUP_SIZE,
    N_EXPERTS,
    ZERO3,
    Block,
    ExpertMLP,
    MoEBlock,
    T,
    check_close,
    expect_error,
    expert_groups,
    make_batch,
    make_net,
    moe_net,
    moe_routes,
    mse,
    train_step,
    wrap_net,
)
from torch_side import (
    Collective,
    FSDPOptimizer,
    GradCheck,
    MixedPrecisionPolicy,
    Overlap,
    Phase,
    WeightFormat,
    fully_shard,
)


# ---- item 1: an exception escaping backward ---------------------------------------------------
def _exception_in_backward_recovers(ctx, seen: RankWarnings):
    """NaN loss on every rank with GradCheck.FINITE: the check raises out of backward (autograd
    drops FSDP's end-of-backward callback). The next forward resets FSDP (with a warning), the
    optimizer refuses partial gradients until zero_grad, and training then continues exactly like
    a run that never saw the bad batch. ``seen``: the warnings of each rank (the test records
    them for the whole world: ``warnings.catch_warnings`` is process-wide)."""
    clean = wrap_net(ctx, grad_check=GradCheck.FINITE)
    hit = wrap_net(ctx, grad_check=GradCheck.FINITE)
    opt_clean = FSDPOptimizer(clean, torch.optim.Adam, lr=1e-2, foreach=False)
    opt_hit = FSDPOptimizer(hit, torch.optim.Adam, lr=1e-2, foreach=False)
    assert torch.equal(train_step(clean, opt_clean, 0, ctx), train_step(hit, opt_hit, 0, ctx))
    x, y = make_batch(7, T, ctx.device)
    y[0, 0] = float("nan")  # every rank: a NaN loss, so every rank raises (none hangs)
    expect_error(FloatingPointError, f"rank {ctx.rank}:", lambda: mse(hit(x), y).backward())
    assert hit.state.backward_active  # the callback that ends backward never ran
    before = len(seen.mine())
    with torch.no_grad():
        hit(x)  # an eval forward: must be a normal forward again, not a "recompute"
    msgs = [str(w.message) for w in seen.mine()[before:] if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "previous backward did not finish" in msgs[0], msgs
    assert not hit.state.backward_active
    assert hit.allocator.live_keys() == [], hit.allocator.live_keys()  # no stale buckets
    assert all(e.param.grad is None for g in hit.param_groups for e in g.entries)
    expect_error(RuntimeError, "call zero_grad()", opt_hit.step)
    opt_hit.zero_grad()
    for step in (1, 2, 3):
        want, got = train_step(clean, opt_clean, step, ctx), train_step(hit, opt_hit, step, ctx)
        assert torch.equal(got, want), (step, got.item(), want.item())
    a, b = clean.full_state_dict(), hit.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights diverged after the recovery"
    assert hit.allocator.live_keys() == []


def _zero_grad_after_an_aborted_backward_resets_quietly(ctx, seen: RankWarnings):
    """The documented recovery (catch, zero_grad) needs no warning, and a new backward over a
    graph built before the failure also finds FSDP reset (its end callback runs again).
    ``seen``: the warnings of each rank (as in ``_exception_in_backward_recovers``)."""
    model = wrap_net(ctx, grad_check=GradCheck.FINITE)
    x, y = make_batch(3, T, ctx.device)
    good = mse(model(x), y)
    bad_y = y.clone()
    bad_y[0, 0] = float("inf")
    expect_error(FloatingPointError, "non-finite", lambda: mse(model(x), bad_y).backward())
    before = len(seen.mine())
    model.zero_grad()
    assert seen.mine()[before:] == [], [str(w.message) for w in seen.mine()]  # any warning fails
    assert not model.state.backward_active and not model.state.grads_incomplete
    assert model.allocator.live_keys() == []
    good.backward()  # the graph built before the failure
    # only gradient reductions still in flight (Overlap.async_reduce), settled when read
    assert not model.state.backward_active
    assert {p for _, p in model.allocator.live_keys()} <= {"grad_reducing"}
    assert all(torch.isfinite(g).all() for g in model.full_grads().values())
    assert model.allocator.live_keys() == []


# ---- item 2: a second backward over a retained graph -----------------------------------------
def _second_backward_over_retained_graph(ctx):
    """backward(retain_graph=True) then backward(): the main grads hold twice one backward's
    gradient (as for nn.Linear parameters); the second backward gathers the colwise planes again
    and frees every bucket."""
    once, twice = wrap_net(ctx), wrap_net(ctx)
    x, y = make_batch(5, T * ctx.world_size, ctx.device)
    mine = slice(ctx.rank * T, (ctx.rank + 1) * T)
    mse(once(x[mine]), y[mine]).backward()
    loss = mse(twice(x[mine]), y[mine])
    loss.backward(retain_graph=True)
    twice.clear_wire_log()
    loss.backward()
    again = {
        r.label for r in twice.wire_log() if r.op is Collective.ALL_GATHER
        and r.phase is Phase.BACKWARD and r.label.endswith("/colwise")
    }
    mx = {f"{g.label}/colwise" for g in twice.param_groups if g.format is WeightFormat.MXFP8_E4M3}
    assert again == mx, (again, mx)
    g1, g2 = once.full_grads(), twice.full_grads()
    for name, g in g1.items():
        assert g.abs().max() > 0 or name.startswith("shift"), name
        assert torch.equal(g2[name], 2 * g), f"{name}: max diff {(g2[name] - 2 * g).abs().max()}"
    assert twice.allocator.live_keys() == [], twice.allocator.live_keys()


# ---- items 3 and 4: state dicts ---------------------------------------------------------------
def _load_full_state_dict_checks_shapes(ctx):
    model = wrap_net(ctx)
    before = model.full_state_dict()
    name = "blocks.0.mlp.fc1.weight"  # (96, 64)
    for bad, what in (
        (torch.zeros(97, 64), "(97, 64)"),  # oversized: used to be truncated
        (before[name].T.contiguous(), "(64, 96)"),  # same numel, transposed: used to load
    ):
        state = {**before, name: bad}
        msg = expect_error(
            ValueError, f"parameter {name!r} has shape {what}", model.load_full_state_dict, state
        )
        assert "(96, 64) in the model; nothing was loaded" in msg, msg
    after = model.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before), "a refused load wrote values"


def _state_dict_is_full_and_round_trips(ctx):
    """state_dict() = the wrapped module's state dict (same keys, buffers included) with full fp32
    main weights, not placeholders; torch.save round-trips it into another wrapped model and it
    loads into an unwrapped copy of the model."""
    net = make_net(0, device=ctx.device)
    net.register_buffer("counter", torch.arange(3.0, device=ctx.device))
    plain = copy.deepcopy(net)
    model = fully_shard(net, unit_modules=(Block,), strategy=ZERO3)
    sd = model.state_dict()
    assert list(sd) == list(plain.state_dict()), (list(sd), list(plain.state_dict()))
    full = model.full_state_dict()
    for k, v in sd.items():
        want = full.get(k, plain.state_dict()[k])
        assert torch.equal(v, want) and v.stride() == want.stride(), k  # no stride-0 / empty
        assert torch.equal(v, plain.state_dict()[k]), k  # the replicated (unwrapped) model
    buf = io.BytesIO()
    torch.save(sd, buf)
    other_net = make_net(1, device=ctx.device)
    other_net.register_buffer("counter", torch.zeros(3, device=ctx.device))
    other = fully_shard(other_net, unit_modules=(Block,), strategy=ZERO3)
    buf.seek(0)
    result = other.load_state_dict(torch.load(buf, weights_only=True))
    assert result.missing_keys == [] and result.unexpected_keys == []
    back = other.state_dict()
    assert all(torch.equal(back[k], sd[k]) for k in sd), "round trip changed values"
    plain2 = make_net(2, device=ctx.device)
    plain2.register_buffer("counter", torch.zeros(3, device=ctx.device))
    plain2.load_state_dict(sd)  # keys are the module's own: loads into the unwrapped model
    expect_error(RuntimeError, "missing keys ['counter']", other.load_state_dict,
                 {k: v for k, v in sd.items() if k != "counter"})
    expect_error(RuntimeError, "unexpected keys ['module.head.bias']", other.load_state_dict,
                 {**sd, "module.head.bias": sd["head.bias"]})
    partial = other.load_state_dict({"head.bias": sd["head.bias"] + 1}, strict=False)
    assert "counter" in partial.missing_keys and "inp.weight" in partial.missing_keys
    now = other.full_state_dict()
    assert torch.equal(now["head.bias"], sd["head.bias"] + 1)
    assert torch.equal(now["inp.weight"], sd["inp.weight"])  # missing: kept


# ---- item 5: a plain optimizer -----------------------------------------------------------------
def _plain_optimizer_is_refused(ctx):
    model = wrap_net(ctx)
    before = model.full_state_dict()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_batch(1, T, ctx.device)
    mse(model(x), y).backward()
    msg = expect_error(TypeError, "FSDPOptimizer(fsdp_model, torch.optim.SGD", opt.step)
    assert f"rank {ctx.rank}: SGD.step(): parameter '" in msg, msg
    after = model.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert sum(p.numel() for p in model.parameters()) > 0  # parameters() still works
    fsdp_opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    fsdp_opt.step()  # the inner optimizer over the main shards is not refused


# ---- item 6: a step between forward and backward ------------------------------------------------
def _step_between_forward_and_backward_is_refused(ctx):
    model = wrap_net(ctx)
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.1)
    x, y = make_batch(2, T, ctx.device)
    mse(model(x), y).backward()
    loss = mse(model(x), y)
    opt.step()  # new weights, while loss's graph holds the old forward's activations
    msg = expect_error(RuntimeError, "changed between this forward and its backward",
                       loss.backward)
    assert msg.startswith(f"rank {ctx.rank}: FSDP unit ") and "weights version 0" in msg, msg
    opt.zero_grad()
    assert not model.state.backward_active and model.allocator.live_keys() == []
    mse(model(x), y).backward()  # a forward after the step is fine
    opt.step()


# ---- item 7: experts that get no tokens -------------------------------------------------------
def _wire_sequences(model) -> dict[str, list[tuple]]:
    return {
        c.name: [(r.op.value, r.phase.value, r.label, r.numel) for r in c.records]
        for c in model.comms.values()
    }


def _wrap_moe(ctx, unit_modules, overlap: Overlap | None = None, **kw):
    """The MoENet of this rank's expert group, wrapped (ZeRO-3, expert-DP groups as in
    ``expert_groups``)."""
    egroups, gsize = expert_groups(ctx.world_size)
    mine = ctx.rank // gsize
    return fully_shard(
        moe_net(ctx.device, mine, **kw), unit_modules=unit_modules, strategy=ZERO3,
        expert_modules=(ExpertMLP,), expert_group=egroups[mine], overlap=overlap,
    )


def _check_ranks_in_step(model, ctx) -> None:
    """Every rank issued the same dense collectives, and the same expert collectives as the
    ranks of its expert group, in the same order (this step's wire log)."""
    gsize = EXPERT_GROUP_SIZE
    seqs = _wire_sequences(model)
    every = [None] * ctx.world_size
    dist.all_gather_object(every, seqs)
    for other in range(ctx.world_size):
        assert every[other]["dp"] == seqs["dp"], f"rank {ctx.rank} vs {other}: dense collectives"
        if other // gsize == ctx.rank // gsize:
            assert every[other]["expert_dp"] == seqs["expert_dp"], (
                f"rank {ctx.rank} vs {other}: expert collectives"
            )


def _train_moe_like_the_reference(ctx, model, routes, **kw) -> None:
    """Two SGD steps of ``model`` (``_wrap_moe``), each rank on its own micro-batch routed by
    ``routes[rank]``, against a replicated single-process reference over all ranks' micro-batches
    (one dense net, one expert set per expert group); collectives compared across ranks each
    step; no bucket left live. Exact at world 2, the training tolerance at 4."""
    w, r = ctx.world_size, ctx.rank
    gsize = EXPERT_GROUP_SIZE
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=0.5, foreach=False)
    ref = moe_net("cpu", 0, **kw)
    experts = [moe_net("cpu", g, **kw).moe.experts for g in range(w // gsize)]
    dense = [p for n, p in ref.named_parameters() if not n.startswith("moe.experts.")]
    ref_opt = torch.optim.SGD(dense + [p for e in experts for p in e.parameters()], lr=0.5,
                              foreach=False)
    exact = w == 2
    for step in range(2):
        x, y = make_batch(50 + step, T * w, ctx.device)
        rows = slice(r * T, (r + 1) * T)
        model.clear_wire_log()
        loss = mse(model(x[rows], routes[r].to(ctx.device)), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        _check_ranks_in_step(model, ctx)
        total = loss.detach().clone()
        dist.all_reduce(total)
        ref_loss = torch.zeros(())
        for rr in range(w):
            ref.moe.experts = experts[rr // gsize]
            lr_ = mse(ref(x[rr * T:(rr + 1) * T].cpu(), routes[rr]), y[rr * T:(rr + 1) * T].cpu())
            (lr_ / w).backward()
            ref_loss += lr_.detach() / w
        ref_opt.step()
        ref_opt.zero_grad()
        check_close(f"loss step {step}", (total / w).cpu(), ref_loss, exact)
    ref.moe.experts = experts[r // gsize]
    state = model.full_state_dict()
    for name, p in ref.named_parameters():
        check_close(name, state[name].cpu(), p.detach(), exact)
    assert model.allocator.live_keys() == [], model.allocator.live_keys()


def _moe_experts_without_tokens(ctx):
    """Some experts get no tokens on some ranks (not called, or called on an empty tensor), the
    experts inside their MoE layer's unit: every rank issues the same collectives in the same
    order (compared across ranks), and training matches a replicated single-process reference
    over all ranks' micro-batches."""
    model = _wrap_moe(ctx, (Block, MoEBlock))
    _train_moe_like_the_reference(ctx, model, moe_routes(ctx.world_size))


# ---- issue 30 item 12: experts as FSDP units of their own ------------------------------------
SKIPPED = (0, 2)  # experts not called at all when they get no tokens (expert 1: called empty)


def _expert_unit_routes(world_size: int) -> list[torch.Tensor]:
    """Per rank, with experts 0 and 2 not called when empty (``SKIPPED``): rank 0 sends every
    token to expert 2 (0 not called, 1 called empty); rank 1 to experts 0 and 1 (2 not called:
    the last in forward, the first in backward); rank 2 to expert 1 only (0 and 2 not called);
    rank 3 to all three."""
    t = torch.arange(T)
    return [torch.full((T,), 2), t % 2, torch.full((T,), 1), t % N_EXPERTS][:world_size]


def _count_gathered_experts(model) -> list[int]:
    """After every bucket allocation of ``model``: how many expert units hold gathered planes."""
    counts, allocate = [], model.allocator.allocate

    def counting(owner, purpose, *args, **kwargs):
        out = allocate(owner, purpose, *args, **kwargs)
        counts.append(len({o.split("/")[0] for o, p in model.allocator.live_keys()
                           if o.startswith("moe.experts.") and p in ("rowwise", "colwise")}))
        return out

    model.allocator.allocate = counting
    return counts


def _expert_units_without_tokens(ctx):
    """Each expert an FSDP unit of its own, hosted by its MoE layer's unit; the router sends
    some experts no tokens on some ranks, and they are not called there (or called on an empty
    tensor): the skipped experts still join their gathers and reductions (zeros), so every rank
    issues the same collectives in the same order, training matches the replicated reference,
    and at most ``prefetch + 1`` experts' planes are gathered at once."""
    model = _wrap_moe(ctx, (Block, MoEBlock, ExpertMLP), skip_when_empty=SKIPPED)
    experts = [u for u in model.units if u.host is not None]
    assert [u.name for u in experts] == [f"moe.experts.{e}" for e in range(N_EXPERTS)]
    assert all(u.host.name == "moe" for u in experts)
    gathered = _count_gathered_experts(model)
    _train_moe_like_the_reference(ctx, model, _expert_unit_routes(ctx.world_size),
                                  skip_when_empty=SKIPPED)
    assert 0 < max(gathered) <= model.state.overlap.prefetch + 1, max(gathered)


def _expert_units_hosted_by_the_root(ctx):
    """The experts are the only units: the root hosts them (forward and backward passes at the
    root's own hooks, its reduction at the end of backward); gathers two units ahead and
    synchronous reductions, where ranks whose collectives differed in order would deadlock."""
    model = _wrap_moe(ctx, (ExpertMLP,), Overlap(prefetch=2, async_reduce=False),
                      skip_when_empty=SKIPPED)
    assert {u.host.name for u in model.units if u.host is not None} == {"<root>"}
    gathered = _count_gathered_experts(model)
    _train_moe_like_the_reference(ctx, model, _expert_unit_routes(ctx.world_size),
                                  skip_when_empty=SKIPPED)
    assert 0 < max(gathered) <= 3, max(gathered)


def _expert_units_in_a_recomputed_moe_layer(ctx):
    """The MoE layer checkpointed as a whole: its recompute in backward gathers both planes of
    the experts it calls, and the skipped ones are passed with the same gathers (also when Torch
    stops the recompute early, before the layer's post-forward)."""
    kw = {"skip_when_empty": SKIPPED, "recompute": True}
    model = _wrap_moe(ctx, (Block, MoEBlock, ExpertMLP), **kw)
    _train_moe_like_the_reference(ctx, model, _expert_unit_routes(ctx.world_size), **kw)


# ---- item 8: arguments that used to be accepted without a word ---------------------------------
def _bad_wrapping_arguments(ctx):
    expect_error(ValueError, "unit_modules entry ExpertMLP matches no module", wrap_net, ctx,
                 unit_modules=(Block, ExpertMLP))
    expect_error(TypeError, "policy must be a MixedPrecisionPolicy, got {}", wrap_net, ctx,
                 policy={})
    wrap_net(ctx, policy=MixedPrecisionPolicy())  # the real thing is accepted
    expect_error(ValueError, "unknown init_sync mode 'rank0'", wrap_net, ctx, init_sync="rank0")
    egroups, gsize = expert_groups(ctx.world_size)
    net = moe_net(ctx.device, 0)
    moe = {"expert_modules": (ExpertMLP,), "expert_group": egroups[ctx.rank // gsize]}
    # expert units whose host (here the root: the MoE layer is no unit) holds another unit
    msg = expect_error(ValueError, "the nearest enclosing unit ('<root>'), which also holds the "
                       "unit 'dense'", fully_shard, net, unit_modules=(Block, ExpertMLP), **moe)
    assert "List the module that calls the experts (the MoE layer) in unit_modules" in msg, msg
    expect_error(ValueError, "an FSDP unit inside the expert unit 'moe.experts.0'", fully_shard,
                 net, unit_modules=(MoEBlock, ExpertMLP, net.moe.experts[0].fc1), **moe)
    expect_error(ValueError, "the unit moe.router+moe.experts.0 mixes expert modules with other",
                 fully_shard, net, unit_modules=(MoEBlock, [net.moe.router, net.moe.experts[0]]),
                 **moe)


# ---- the tests ---------------------------------------------------------------------------------
def test_exception_escaping_backward_is_recovered_from():
    """NaN loss + GradCheck.FINITE on every rank, caught; training then matches a clean run."""
    with RankWarnings().record() as seen:
        run_world(2, _exception_in_backward_recovers, seen)
    got = {name: [f"{w.category.__name__}: {w.message}" for w in ws]
           for name, ws in seen.by_thread.items()}
    assert sorted(got) == ["rank 0/2", "rank 1/2"], got  # no other thread warned
    assert all(len(m) == 1 for m in got.values()), got  # and no other warning


def test_zero_grad_resets_after_an_aborted_backward():
    with RankWarnings().record() as seen:
        run_world(2, _zero_grad_after_an_aborted_backward_resets_quietly, seen)
    assert seen.by_thread == {}, seen.by_thread


def test_second_backward_over_a_retained_graph_accumulates():
    run_world(2, _second_backward_over_retained_graph)


def test_load_full_state_dict_refuses_other_shapes():
    run_world(2, _load_full_state_dict_checks_shapes)


def test_state_dict_is_the_full_model_and_round_trips():
    run_world(2, _state_dict_is_full_and_round_trips)


def test_plain_optimizer_over_fsdp_parameters_is_refused():
    run_world(2, _plain_optimizer_is_refused)


def test_optimizer_step_between_forward_and_backward_is_refused():
    run_world(2, _step_between_forward_and_backward_is_refused)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_experts_without_tokens_keep_ranks_in_step(world_size):
    run_world(world_size, _moe_experts_without_tokens)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "case",
    [_expert_units_without_tokens, _expert_units_hosted_by_the_root,
     _expert_units_in_a_recomputed_moe_layer],
    ids=["moe_layer_hosts", "root_hosts", "recomputed_moe_layer"],
)
def test_expert_units_without_tokens_keep_ranks_in_step(case, world_size):
    """Experts as FSDP units of their own, not called (or called empty) on some ranks: the same
    collectives on every rank, training as the replicated reference (issue 30 item 12)."""
    run_world(world_size, case)


def test_wrapping_arguments_that_match_nothing_are_refused():
    run_world(2, _bad_wrapping_arguments)
