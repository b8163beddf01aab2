"""The hybrid training prototype: the GPT twin under ``torch_side`` FSDP, MXFP8 GEMMs in JAX.

Tensors and roles (DESIGN.md 5): Torch FSDP owns the fp32 main weights, gradients and optimizer;
every linear layer's GEMMs are JAX MXFP8 kernels reached through the bridge op, reading the MXFP8
planes that FSDP all-gathers. After each optimizer step the planes are re-quantized from
bf16(main) by the distributed recipe.

Data: ``MarkovCorpus``, a seeded random Markov chain over the vocabulary (each token has a few
successors). It needs no download, is learnable by a tiny model in tens of steps, and has an
exact loss floor: the expected conditional entropy of the next token, which a perfect model
reaches (``loss_floor``). Each rank samples its own micro-batches (seeded by rank).

``train_rank(job)`` is what every rank runs; ``apps.training.cli`` spawns the ranks
(``torch_side.launch.run_local_ranks``) and prints the result.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from common.model_config import PRESETS
from common.modes import LinearMode
from torch_side import FSDPOptimizer, MixedPrecisionPolicy, ShardingStrategy, fully_shard
from torch_side.models.gpt import Block, TorchGPT, cross_entropy

__all__ = ["MarkovCorpus", "StepLog", "TrainJob", "TrainResult", "WeightMode", "train_rank"]


class WeightMode(enum.Enum):
    """What the linear layers compute with: MXFP8 GEMMs on MXFP8 weights, or the fp32 control."""

    MXFP8 = "mxfp8"
    FP32 = "fp32"


class MarkovCorpus:
    """Sequences from a random Markov chain: V tokens, ``branching`` successors each.

    The chain (successors and their probabilities) depends only on ``seed``; sequences start from
    a uniformly random token.
    """

    def __init__(self, vocab_size: int, *, branching: int = 4, seed: int = 0):
        if not 1 <= branching <= vocab_size:
            raise ValueError(
                f"MarkovCorpus: branching={branching} must be in [1, vocab_size={vocab_size}]"
            )
        rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size
        self.transition = np.zeros((vocab_size, vocab_size))  # (V, V), rows sum to 1
        for i in range(vocab_size):
            succ = rng.choice(vocab_size, size=branching, replace=False)
            self.transition[i, succ] = rng.dirichlet(np.ones(branching))
        self._cdf = np.cumsum(self.transition, axis=1)

    def sample(self, batch: int, seq_len: int, rng: np.random.Generator):
        """(tokens, targets) int64 (batch, seq_len): targets are tokens shifted by one."""
        seq = np.empty((batch, seq_len + 1), np.int64)
        seq[:, 0] = rng.integers(0, self.vocab_size, size=batch)
        for t in range(seq_len):
            u = rng.random((batch, 1))
            nxt = (self._cdf[seq[:, t]] < u).sum(axis=1)  # inverse-CDF sampling per row
            seq[:, t + 1] = np.minimum(nxt, self.vocab_size - 1)
        return torch.from_numpy(seq[:, :-1].copy()), torch.from_numpy(seq[:, 1:].copy())

    def loss_floor(self, seq_len: int) -> float:
        """Expected cross-entropy (nats/token) of the true conditional distribution.

        Position t's token is distributed as u P^t (u uniform); predicting position t+1 costs
        the entropy of the row of the current token. Averaged over the seq_len predictions.
        """
        p = self.transition
        with np.errstate(divide="ignore", invalid="ignore"):
            row_entropy = -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=1)  # (V,)
        dist_t = np.full(self.vocab_size, 1.0 / self.vocab_size)
        total = 0.0
        for _ in range(seq_len):
            total += float(dist_t @ row_entropy)
            dist_t = dist_t @ p
        return total / seq_len


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs (picklable)."""

    config: str = "tiny"  # jax_side.models.PRESETS key
    weights: WeightMode = WeightMode.MXFP8
    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
    steps: int = 40
    micro_batches: int = 2
    batch_size: int = 8  # per rank and micro-batch
    seq_len: int = 32
    lr: float = 3e-3
    seed: int = 0
    branching: int = 4
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.config not in PRESETS:
            raise ValueError(f"TrainJob.config={self.config!r}: expected one of {list(PRESETS)}")
        for name in ("steps", "micro_batches", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainJob.{name}={getattr(self, name)} must be >= 1")
        if self.seq_len > PRESETS[self.config].max_seq_len:
            raise ValueError(
                f"TrainJob.seq_len={self.seq_len} exceeds max_seq_len="
                f"{PRESETS[self.config].max_seq_len} of config {self.config!r}"
            )


@dataclasses.dataclass(frozen=True)
class StepLog:
    step: int
    loss: float  # mean over ranks and micro-batches
    seconds: float  # wall time of the step on rank 0 (forward, backward, optimizer, requant)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    job: TrainJob
    world_size: int
    steps: list[StepLog]
    eval_loss_start: float  # on a fixed held-out batch, before training
    eval_loss_end: float  # the same batch, after training
    loss_floor: float  # MarkovCorpus.loss_floor(seq_len)
    initial_loss: float  # ln(vocab_size): a uniform prediction


def _build(job: TrainJob):
    cfg = PRESETS[job.config]
    mode = LinearMode.MXFP8 if job.weights is WeightMode.MXFP8 else LinearMode.HIGH_PRECISION
    model = TorchGPT(cfg, mode, seed=job.seed, device=job.device)  # same init on every rank
    fsdp = fully_shard(
        model, unit_modules=(Block,), strategy=job.strategy, policy=MixedPrecisionPolicy()
    )
    return cfg, fsdp, FSDPOptimizer(fsdp, torch.optim.AdamW, lr=job.lr, weight_decay=0.0)


def _eval_loss(fsdp, tokens, targets) -> float:
    with torch.no_grad():
        return float(cross_entropy(fsdp(tokens), targets))


def train_rank(job: TrainJob) -> TrainResult:
    """Train on this rank's part of the data parallel group; collective (call on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, fsdp, opt = _build(job)
    corpus = MarkovCorpus(cfg.vocab_size, branching=job.branching, seed=job.seed)
    held_out = corpus.sample(16, job.seq_len, np.random.default_rng([job.seed, 10_000]))
    held_out = tuple(t.to(job.device) for t in held_out)
    rng = np.random.default_rng([job.seed, rank])
    eval_start = _eval_loss(fsdp, *held_out)
    logs = []
    for step in range(job.steps):
        t0 = time.perf_counter()
        total = torch.zeros((), dtype=torch.float32, device=job.device)
        for _ in range(job.micro_batches):
            tokens, targets = (t.to(job.device) for t in corpus.sample(
                job.batch_size, job.seq_len, rng))
            loss = cross_entropy(fsdp(tokens), targets) / job.micro_batches
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        logs.append(StepLog(step, float(total) / world, time.perf_counter() - t0))
    return TrainResult(
        job=job,
        world_size=world,
        steps=logs,
        eval_loss_start=eval_start,
        eval_loss_end=_eval_loss(fsdp, *held_out),
        loss_floor=corpus.loss_floor(job.seq_len),
        initial_loss=math.log(cfg.vocab_size),
    )
