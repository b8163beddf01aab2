"""Small models for the FSDP tests: a residual MLP stack with MXFP8 linears and fp32 others.

``ToyNet``: frozen input shift (16,) -> ``inp`` nn.Linear(16, 64) (fp32 group) -> ``blocks`` of
``Block`` (LayerNorm(64), MLP: MXFP8Linear(64, 96, bias) -> gelu -> MXFP8Linear(96, 64)) ->
``head`` nn.Linear(64, 8). Inputs (T, 16) with T a multiple of 32 (MXFP8 token blocks).
``Recompute`` picks activation checkpointing: none, whole blocks (unit), or the MLP inside a block.
An ``ExpertMLP`` can stand in for the MLP (an MoE-style block with one local expert).
``MoENet``: ``inp`` -> a dense ``Block`` -> ``MoEBlock`` (router + ``N_EXPERTS`` ``ExpertMLP``s,
tokens routed by an explicit per-token expert index; which experts without tokens are not called
at all, and whether the layer is recomputed in backward, are arguments) -> ``head``.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from bridge import MXFP8Linear

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
