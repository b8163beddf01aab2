"""The GPT under unit compute (``bridge.units``), sharded by FSDP, matches a replicated
single-process reference: every strategy at world sizes 1 and 2 (ZeRO-3 also at 4), activation
recompute inside the backward programs with micro-batches, bf16 weight gathers, and both blocks
as one FSDP unit (one program per direction). The cases ``case_*(ctx)`` run on every rank of an
in-process world (``threaded_world.py``) here, and on NCCL ranks by ``test_nccl.py``. World 1 of
ZeRO-3 is the fast test; the rest is slow (``make test-all``).

The reference is the same ``TorchGPT`` (unit compute, no FSDP) trained on the whole global batch
(in the ranks' slices, each slice's loss / w, at one program shape for every world size):
its unit programs quantize ``bf16(weight)`` themselves, which is what the FSDP model reads from
its planes. Rank r's micro-batch is sequences ``[r * B, (r + 1) * B)`` of the global batch, its
loss the mean over its tokens, and FSDP averages gradients over ranks, so both follow the same
gradient. World size 1 runs the same arithmetic in the same order: losses and main weights are
equal. With more ranks the gradient sums run in another order, so they agree to ``RTOL`` /
``ATOL`` (SGD: weight differences stay proportional to gradient differences).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from common.model_config import GPTConfig
from models.torch_gpt import Block, TorchGPT
from tests.torch_side.threaded_world import run_world
from torch_side import (
    FSDPOptimizer,
    MixedPrecisionPolicy,
    Overlap,
    ShardingStrategy,
    fully_shard,
)

CFG = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=2, d_model=64, d_ff=128)
B, S, STEPS, LR = 2, 32, 2, 0.5
RTOL, ATOL = 1e-4, 1e-6


def _batch(step: int, mb: int, sequences: int, device):
    g = torch.Generator().manual_seed(1000 * step + mb)
    tokens = torch.randint(0, CFG.vocab_size, (sequences, S + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _train_and_compare(ctx, strategy, recompute=False, micro_batches=1, gather="mxfp8",
                       one_unit=False) -> None:
    net = TorchGPT(CFG, seed=5, device=ctx.device, compute="unit", recompute=recompute)
    ref = TorchGPT(CFG, seed=5, device=ctx.device, compute="unit")
    # one_unit: both blocks one FSDP unit, run as one unit program per direction
    units = [tuple(net.blocks)] if one_unit else (Block,)
    model = fully_shard(net, unit_modules=units, strategy=strategy,
                        policy=MixedPrecisionPolicy(gather=gather),
                        overlap=Overlap(streams_at_world_1=ctx.comm_streams))
    opt = FSDPOptimizer(model, torch.optim.SGD, lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    w, r = ctx.world_size, ctx.rank
    mine = slice(r * B, (r + 1) * B)
    for step in range(STEPS):
        losses = torch.zeros(1, device=ctx.device)
        ref_loss = torch.zeros(1, device=ctx.device)
        for mb in range(micro_batches):
            tokens, targets = _batch(step, mb, B * w, ctx.device)
            loss = model(tokens[mine], targets[mine]) / micro_batches
            loss.backward()
            losses += loss.detach()
            # The reference takes the global batch in the ranks' slices: the same mean loss
            # (each slice's mean / w; w a power of two, so dy's MXFP8 bytes are unchanged) at the
            # FSDP model's shapes, whose unit programs every world reuses from the compilation
            # cache (a (w * B)-sequence batch compiled a program set per world size).
            for rr in range(w):
                part = slice(rr * B, (rr + 1) * B)
                lref = ref(tokens[part], targets[part]) / (w * micro_batches)
                lref.backward()
                ref_loss += lref.detach()
        dist.all_reduce(losses)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        _assert_close(f"loss step {step}", losses / w, ref_loss, w == 1)
    state = model.full_state_dict()
    for name, p in ref.named_parameters():
        _assert_close(name, state[name], p.detach(), w == 1)
    assert model.allocator.live_keys() == [], model.allocator.live_keys()


def _assert_close(what, got, want, exact: bool) -> None:
    if exact:
        assert torch.equal(got, want), f"{what}: max diff {(got - want).abs().max().item()}"
        return
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def case_unit_no_shard(ctx):
    _train_and_compare(ctx, ShardingStrategy.NO_SHARD)


def case_unit_optim(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM)


def case_unit_optim_grads(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS)


def case_unit_optim_grads_params(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS)


def case_unit_zero3_recompute_accumulation(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS, recompute=True, micro_batches=2)


def case_unit_zero3_bf16_gather(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS, gather="bf16")


def case_unit_zero3_blocks_in_one_unit_recompute_accumulation(ctx):
    _train_and_compare(ctx, ShardingStrategy.OPTIM_GRADS_PARAMS, recompute=True,
                       micro_batches=2, one_unit=True)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("case", "world_size"),
    [
        (case_unit_optim_grads_params, 1),
        pytest.param(case_unit_zero3_recompute_accumulation, 1, marks=SLOW),
        *[pytest.param(c, w, marks=SLOW)
          for c in (case_unit_no_shard, case_unit_optim, case_unit_optim_grads)
          for w in (1, 2)],
        # World 4 only for ZeRO-3: the other strategies' collectives (all-reduce, reduce-scatter
        # of replicated or sharded grads) are the same at 2 ranks as at 4.
        pytest.param(case_unit_optim_grads_params, 2, marks=SLOW),
        pytest.param(case_unit_optim_grads_params, 4, marks=SLOW),
        pytest.param(case_unit_zero3_recompute_accumulation, 2, marks=SLOW),
        pytest.param(case_unit_zero3_bf16_gather, 1, marks=SLOW),
        pytest.param(case_unit_zero3_bf16_gather, 2, marks=SLOW),
        # world 1 of a unit of several blocks: tests/torch_side/test_unit_spans.py (in process)
        pytest.param(case_unit_zero3_blocks_in_one_unit_recompute_accumulation, 2, marks=SLOW),
    ],
    ids=lambda v: v.__name__.removeprefix("case_unit_") if callable(v) else f"w{v}",
)
def test_unit_compute_matches_the_replicated_reference(case, world_size):
    run_world(world_size, case)
