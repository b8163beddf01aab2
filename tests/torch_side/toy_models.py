"""Small models for the FSDP tests: a residual MLP stack with MXFP8 linears and fp32 others.

``ToyNet``: frozen input shift (16,) -> ``inp`` nn.Linear(16, 64) (fp32 group) -> ``blocks`` of
``Block`` (LayerNorm(64), MLP: MXFP8Linear(64, 96, bias) -> gelu -> MXFP8Linear(96, 64)) ->
``head`` nn.Linear(64, 8). Inputs (T, 16) with T a multiple of 32 (MXFP8 token blocks).
``Recompute`` picks activation checkpointing: none, whole blocks (unit), or the MLP inside a block.
An ``ExpertMLP`` can stand in for the MLP (an MoE-style block with one local expert).
``MoENet``: ``inp`` -> a dense ``Block`` -> ``MoEBlock`` (router + ``N_EXPERTS`` ``ExpertMLP``s,
tokens routed by an explicit per-token expert index; which experts without tokens are not called
at all, and whether the layer is recomputed in backward, are arguments) -> ``head``.

For the multi-rank tests (each rank of an in-process world, ``threaded_world.py``, or a spawned
one; ``ctx`` is its ``WorkerContext``): ``moe_net`` builds the MoENet of one expert-DP group,
``expert_groups`` makes those groups, ``moe_routes`` routes each rank's tokens so that some
experts get none; ``wrap_net`` / ``train_step`` wrap and train a ToyNet (ZeRO-3, blocks as
units); ``expect_error`` and ``check_close`` are their assertions.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from bridge import MXFP8Linear
from torch_side import ShardingStrategy, fully_shard

D, FF, D_IN, D_OUT = 64, 96, 16, 8


class Recompute(enum.Enum):
    NONE = "none"
    UNIT = "unit"  # checkpoint(block, x): the whole FSDP unit is recomputed in backward
    SUBMODULE = "submodule"  # checkpoint(block.mlp, x): part of a unit is recomputed


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = MXFP8Linear(D, FF)
        self.fc2 = MXFP8Linear(FF, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class ExpertMLP(MLP):
    """Same maths; its parameters are expert parameters (own expert-DP group)."""


class Block(nn.Module):
    def __init__(self, recompute: Recompute, expert: bool = False):
        super().__init__()
        self.recompute = recompute
        self.ln = nn.LayerNorm(D)
        self.mlp = ExpertMLP() if expert else MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        if self.recompute is Recompute.SUBMODULE:
            return x + checkpoint(self.mlp, h, use_reentrant=False)
        return x + self.mlp(h)


class ToyNet(nn.Module):
    def __init__(
        self, recompute: Recompute = Recompute.NONE, n_blocks: int = 2, expert_block: bool = False
    ):
        super().__init__()
        self.recompute = recompute
        self.shift = nn.Parameter(torch.linspace(-0.5, 0.5, D_IN), requires_grad=False)
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(
            [Block(recompute, expert=expert_block and i == n_blocks - 1) for i in range(n_blocks)]
        )
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x + self.shift)  # (T, D)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=False) if self.recompute is Recompute.UNIT else b(h)
        return self.head(h)  # (T, D_OUT)


_SEEDING = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """``torch.manual_seed(seed)`` for the block, one thread at a time. Module initialisers
    draw from Torch's one process-wide generator, which the ranks of an in-process world
    (``threaded_world.py``) share: a module built in this block gets the same values on every
    rank only if every draw from that generator (construction of any module) holds this lock."""
    with _SEEDING:
        torch.manual_seed(seed)
        yield


def make_net(seed: int, device: str = "cpu", **kw) -> ToyNet:
    """Same initial values on every rank and device: initialised on the CPU, then moved."""
    with seeded(seed):
        net = ToyNet(**kw)
    return net.to(device)


def make_batch(seed: int, tokens: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(x (tokens, 16), y (tokens, 8)), fp32, from a seed (CPU generator, then moved)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(tokens, D_IN, generator=g), torch.randn(tokens, D_OUT, generator=g)
    return x.to(device), y.to(device)


def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) ** 2).mean()


N_EXPERTS = 3


class MoEBlock(nn.Module):
    """x + sum_e gate_e * expert_e(ln(x)) over the tokens routed to expert e (top-1, routing
    given). An expert with no tokens is skipped (not called at all) if its index is in
    ``skip_when_empty``, else called on an empty (0, D) tensor -- both happen in real MoE code."""

    def __init__(self, skip_when_empty: tuple[int, ...] = (0,)):
        super().__init__()
        self.skip_when_empty = skip_when_empty
        self.ln = nn.LayerNorm(D)
        self.router = nn.Linear(D, N_EXPERTS)
        self.experts = nn.ModuleList([ExpertMLP() for _ in range(N_EXPERTS)])

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)  # (T, D)
        gate = torch.sigmoid(self.router(h))  # (T, E)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().squeeze(1)  # (T_e,) tokens of expert e
            if idx.numel() == 0 and e in self.skip_when_empty:
                continue
            y = expert(h[idx]) * gate[idx, e : e + 1]  # (T_e, D)
            out = out.index_add(0, idx, y)
        return x + out


class MoENet(nn.Module):
    """``recompute``: the MoE layer is checkpointed (recomputed in backward) as a whole."""

    def __init__(self, skip_when_empty: tuple[int, ...] = (0,), recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        self.inp = nn.Linear(D_IN, D)
        self.dense = Block(Recompute.NONE)
        self.moe = MoEBlock(skip_when_empty)
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.dense(self.inp(x))  # (T, D)
        if self.recompute:
            return self.head(checkpoint(self.moe, h, route, use_reentrant=False))
        return self.head(self.moe(h, route))  # (T, D_OUT)


# ---- multi-rank helpers ------------------------------------------------------------------------
T = 32  # tokens per rank and micro-batch
ZERO3 = ShardingStrategy.OPTIM_GRADS_PARAMS
EXPERT_GROUP_SIZE = 2  # ranks per expert-DP group (expert_groups)


def moe_routes(world_size: int) -> list[torch.Tensor]:
    """Per rank: the expert of each of its T tokens. Rank 0 routes everything to expert 2
    (expert 0 is not called, expert 1 is called on an empty tensor); rank 1 uses all three;
    rank 2 leaves expert 1 empty (called empty), rank 3 leaves expert 0 empty (not called)."""
    t = torch.arange(T)
    table = [
        torch.full((T,), 2),
        t % N_EXPERTS,
        torch.where(t % 2 == 0, 0, 2),
        torch.where(t % 2 == 0, 1, 2),
    ]
    return table[:world_size]


def expert_groups(world_size: int) -> tuple[list, int]:
    """Expert-DP groups: one group of all ranks at world 2, {0,1} and {2,3} at world 4 (each
    group holds its own experts). Collective: every rank creates every group."""
    size = EXPERT_GROUP_SIZE
    ranks = [list(range(i, i + size)) for i in range(0, world_size, size)]
    return [dist.new_group(r) for r in ranks], size


def moe_net(device, group_index: int, dense_seed: int = 0, **kw) -> MoENet:
    """The same dense layers on every rank, the experts of expert group ``group_index``;
    ``kw``: ``MoENet``'s (which experts without tokens are not called, recompute)."""
    with seeded(dense_seed):
        net = MoENet(**kw)
    with seeded(10 + group_index):
        net.moe.experts = torch.nn.ModuleList([ExpertMLP() for _ in range(N_EXPERTS)])
    return net.to(device)


def wrap_net(ctx, **kw):
    """``make_net(0)`` on ``ctx.device``, wrapped: ``fully_shard``'s ``kw``, by default ZeRO-3
    with each ``Block`` a unit."""
    kw.setdefault("unit_modules", (Block,))
    kw.setdefault("strategy", ZERO3)
    return fully_shard(make_net(0, device=ctx.device), **kw)


def train_step(model, opt, step: int, ctx) -> torch.Tensor:
    """One global-batch step (this rank's T rows of it); returns the loss averaged over ranks."""
    x, y = make_batch(100 + step, T * ctx.world_size, ctx.device)
    mine = slice(ctx.rank * T, (ctx.rank + 1) * T)
    loss = mse(model(x[mine]), y[mine])
    loss.backward()
    opt.step()
    opt.zero_grad()
    out = loss.detach().clone()
    dist.all_reduce(out)
    return out / ctx.world_size


def expect_error(error: type[BaseException], match: str, fn: Callable, *args, **kwargs) -> str:
    """``fn(*args, **kwargs)`` raises ``error`` whose message contains ``match``; the message."""
    try:
        fn(*args, **kwargs)
    except error as e:
        assert match in str(e), str(e)
        return str(e)
    raise AssertionError(f"expected {error.__name__} matching {match!r}")


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """Bit for bit if ``exact``, else the training tolerance (four ranks: gradient sums in
    another order, as test_training_parity.RTOL/ATOL)."""
    if exact:
        assert torch.equal(got, want), f"{what}: max diff {(got - want).abs().max().item()}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{what}: {m}")
