"""The hybrid training loop: the Torch GPT under ``torch_side`` FSDP, MXFP8 GEMMs in JAX.

Tensors and roles (DESIGN.md 5): Torch FSDP owns the fp32 main weights, gradients and optimizer;
every linear layer's GEMMs are JAX MXFP8 kernels reached through the bridge op, reading the MXFP8
planes that FSDP all-gathers. After each optimizer step the planes are re-quantized from
bf16(main) by the distributed recipe.

``train_rank(job, run)`` is what every rank runs, inside an initialised process group (torchrun's,
or the one ``torch_side.launch.run_local_ranks`` makes). Data come from ``apps.training.data``:
sample ids are global, so rank r's micro-batch m of the step at data position p is a fixed set of
ids, and a checkpoint needs only the position. Rank 0 shows progress (tqdm), writes the metrics
(``apps.training.metrics``) and the checkpoint metadata.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from apps.training import checkpoint as ckpt
from apps.training.data import (
    BYTE_VOCAB,
    Corpus,
    DataPosition,
    Split,
    advance,
    heldout_ids,
    make_corpus,
    sample_ids,
)
from apps.training.job import Recompute, TrainJob
from apps.training.metrics import MetricsWriter, eval_record, run_record, step_record
from common.model_config import PRESETS
from torch_side import FSDPOptimizer, fully_shard, precompile
from torch_side.models.gpt import Block, TorchGPT, cross_entropy

__all__ = ["MARKOV_MAX_VOCAB", "RunOptions", "StepLog", "TrainResult", "train_rank"]

# A Markov corpus keeps a dense (V, V) transition matrix: presets with a GPT-2 vocabulary train on
# a chain over the first MARKOV_MAX_VOCAB tokens (the model's vocabulary follows the corpus).
MARKOV_MAX_VOCAB = 1024


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Where a run writes and what it resumes from (not part of the numerics)."""

    metrics: str | None = None  # JSONL path (rank 0)
    save_dir: str | None = None
    save_every: int = 0  # steps between checkpoints (0: only at the end when save_dir is set)
    resume: str | None = None  # a save dir (its latest checkpoint) or a step_* directory
    progress: bool = True  # rank 0's progress bar
    label: str = ""  # shown in the progress bar and the run record
    precompile: bool = True  # compile the JAX linear programs in parallel before step 1


@dataclasses.dataclass(frozen=True)
class StepLog:
    step: int
    loss: float  # mean over ranks and micro-batches
    seconds: float  # wall time of the step on rank 0 (forward, backward, optimizer, requant)
    tokens_per_s: float


@dataclasses.dataclass(frozen=True)
class TrainResult:
    job: TrainJob
    world_size: int
    steps: list[StepLog]  # the steps this run executed (after the resumed step, if any)
    start_step: int  # 0, or the step a resume continued from
    heldout_loss: float  # on the fixed held-out set, after training
    loss_floor: float | None  # exact for the Markov corpus, None for text
    initial_loss: float  # ln(vocab): a uniform prediction
    first_step_s: float  # wall time of the first executed step (compilation included)
    corpus: str
    precompile_s: float = 0.0  # wall time of torch_side.precompile before the first step
    precompiled_programs: int = 0


class _Model:
    """The wrapped model, its optimizer and the corpus of one job."""

    def __init__(self, job: TrainJob):
        # The model's vocabulary follows the corpus: bytes for text, the preset's (capped) for
        # the Markov chain.
        vocab = BYTE_VOCAB
        if job.data == "markov":
            vocab = min(PRESETS[job.config].vocab_size, MARKOV_MAX_VOCAB)
        self.corpus: Corpus = make_corpus(job.data, vocab_size=vocab, seed=job.seed)
        self.corpus.check_fits(job.seq_len)  # not at the held-out evaluation after training
        self.cfg = job.model_config(self.corpus.vocab_size)
        model = TorchGPT(
            self.cfg, job.linear_mode, seed=job.seed, device=job.device, kernels=job.kernels,
            activations=job.resolved_activations,
        )
        if job.recompute is Recompute.BLOCK:
            for block in model.blocks:
                block.forward = _checkpointed(block.forward)
        self.fsdp = fully_shard(
            model, unit_modules=(Block,), strategy=job.strategy, policy=job.policy(),
            kernels=job.kernels,
        )
        self.opt = FSDPOptimizer(
            self.fsdp, torch.optim.AdamW, lr=job.lr, weight_decay=job.weight_decay,
            foreach=False,
        )


def _checkpointed(forward):
    def run(x):
        return checkpoint(forward, x, use_reentrant=False)

    return run


def _batch(corpus: Corpus, split: Split, ids: np.ndarray, job: TrainJob):
    b = corpus.batch(split, ids, job.seq_len)
    return (torch.from_numpy(b.tokens).to(job.device), torch.from_numpy(b.targets).to(job.device))


def _sync(job: TrainJob) -> None:
    if job.device == "cuda":
        torch.cuda.synchronize()


def heldout_loss(m: _Model, job: TrainJob) -> float:
    """Mean token loss on the fixed held-out set (``eval_batches`` x ``batch_size`` sequences),
    split across ranks round-robin; a collective. Every rank runs the same number of forwards
    (FSDP gathers weights in each): a rank past the end repeats a batch with weight 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = heldout_ids(job.eval_batches * job.batch_size).reshape(job.eval_batches, -1)
    total = torch.zeros(2, dtype=torch.float64, device=job.device)  # (sum of losses, count)
    with torch.no_grad():
        for k in range(-(-job.eval_batches // world)):
            i = rank + k * world
            tokens, targets = _batch(m.corpus, Split.HELDOUT, ids[min(i, len(ids) - 1)], job)
            weight = 1.0 if i < len(ids) else 0.0
            total[0] += weight * cross_entropy(m.fsdp(tokens), targets).double()
            total[1] += weight
    dist.all_reduce(total)
    return float(total[0] / total[1])


def _precompile(m: _Model, job: TrainJob):
    """Compile the step's JAX programs, and those of the held-out evaluation (a no-grad forward
    of the same shape), in parallel (torch_side.precompile: a dry micro-batch of the training
    shapes, zero tokens; weights, optimizer, data position and RNG untouched)."""
    tokens = torch.zeros((job.batch_size, job.seq_len), dtype=torch.long, device=job.device)
    report = precompile(m.fsdp, lambda: cross_entropy(m.fsdp(tokens), tokens),
                        no_grad_forward=True)
    _sync(job)
    return report


def _progress(job: TrainJob, opts: RunOptions, start: int):
    if not opts.progress or dist.get_rank() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=job.steps, initial=start, desc=opts.label or job.weights.value,
                unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)


def train_rank(job: TrainJob, opts: RunOptions = RunOptions()) -> TrainResult:
    """Train on this rank's part of the data-parallel group; a collective (every rank calls it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = _Model(job)
    desc = job.describe()
    start, position = 0, DataPosition(0)
    if opts.resume:
        resumed = ckpt.load(opts.resume, fsdp=m.fsdp, opt=m.opt, job=desc)
        start, position = resumed.step, resumed.position
    writer = None
    if rank == 0 and opts.metrics:
        writer = MetricsWriter(opts.metrics, append=bool(opts.resume))
        writer.write(run_record(
            job=desc, world_size=world, label=opts.label, corpus=m.corpus.describe(),
            loss_floor=m.corpus.loss_floor(job.seq_len), resumed_from=start,
            params=m.cfg.num_parameters(),
        ))
    report = None
    if opts.precompile and job.steps > start:
        report = _precompile(m, job)
    bar = _progress(job, opts, start)
    logs: list[StepLog] = []
    tokens_per_step = job.tokens_per_step(world)
    try:
        for step in range(start, job.steps):
            t0 = time.perf_counter()
            total = torch.zeros((), dtype=torch.float32, device=job.device)
            for mb in range(job.micro_batches):
                ids = sample_ids(position, rank=rank, world_size=world, micro_batch=mb,
                                 micro_batches=job.micro_batches, batch_size=job.batch_size)
                tokens, targets = _batch(m.corpus, Split.TRAIN, ids, job)
                loss = cross_entropy(m.fsdp(tokens), targets) / job.micro_batches
                loss.backward()
                total += loss.detach()
            m.opt.step()
            m.opt.zero_grad()
            position = advance(position, world_size=world, micro_batches=job.micro_batches,
                               batch_size=job.batch_size)
            dist.all_reduce(total)
            _sync(job)
            seconds = time.perf_counter() - t0
            log = StepLog(step, float(total) / world, seconds, tokens_per_step / seconds)
            logs.append(log)
            if writer is not None:
                writer.write(step_record(step=step, loss=log.loss, tokens_per_s=log.tokens_per_s,
                                         step_s=seconds))
            if bar is not None:
                bar.set_postfix(loss=f"{log.loss:.4f}", tok_s=f"{log.tokens_per_s:,.0f}",
                                step_s=f"{seconds:.3f}")
                bar.update(1)
            done = step + 1
            if opts.save_dir and opts.save_every and done % opts.save_every == 0:
                ckpt.save(opts.save_dir, step=done, fsdp=m.fsdp, opt=m.opt, position=position,
                          job=desc)
        final = job.steps if job.steps > start else start
        if opts.save_dir and (not opts.save_every or final % opts.save_every):
            ckpt.save(opts.save_dir, step=final, fsdp=m.fsdp, opt=m.opt, position=position,
                      job=desc)
        held = heldout_loss(m, job)
        if writer is not None:
            writer.write(eval_record(step=final, heldout_loss=held))
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
    return TrainResult(
        job=job, world_size=world, steps=logs, start_step=start, heldout_loss=held,
        loss_floor=m.corpus.loss_floor(job.seq_len), initial_loss=math.log(m.cfg.vocab_size),
        first_step_s=logs[0].seconds if logs else float("nan"), corpus=m.corpus.describe(),
        precompile_s=report.wall_s if report else 0.0,
        precompiled_programs=report.programs if report else 0,
    )


def result_path(metrics: str | None, suffix: str) -> str | None:
    """``run.jsonl`` -> ``run.<suffix>.jsonl`` (the --compare control's metrics file)."""
    if metrics is None:
        return None
    p = Path(metrics)
    return str(p.with_name(f"{p.stem}.{suffix}{p.suffix}"))
