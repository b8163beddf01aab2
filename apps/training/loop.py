"""The hybrid training loop: the Torch GPT under ``torch_side`` FSDP, MXFP8 GEMMs in JAX.

Tensors and roles (DESIGN.md 5): Torch FSDP owns the fp32 main weights, gradients and optimizer;
every linear layer's GEMMs are JAX MXFP8 kernels reached through the bridge op, reading the MXFP8
planes that FSDP all-gathers. After each optimizer step the planes are re-quantized from
bf16(main) by the distributed recipe.

``train_rank(job, opts)`` is what every rank runs, inside an initialised process group
(torchrun's, or the one ``torch_side.launch.run_local_ranks`` makes): it builds a ``Trainer`` and
runs it. ``Trainer.step`` is one training step (``_forward_backward`` of the micro-batches, then
``_update``); ``Trainer.run`` adds precompilation, checkpoints and the held-out evaluation. The
job and its options are ``apps.training.job``'s (``RunOptions``, ``OnNonFinite`` and
``MARKOV_MAX_VOCAB`` are re-exported here). Data come from ``apps.training.data``:
sample ids are global, so rank r's micro-batch m of the step at data position p is a fixed set of
ids, and a checkpoint needs only the position. Rank 0 shows progress
(``apps.training.progress``: a tqdm bar on a terminal, a line every ``--progress-every`` steps
in a log), writes the metrics (``apps.training.metrics``) and the checkpoint metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from apps import environment
from apps.training import checkpoint as ckpt
from apps.training.data import Corpus, DataPosition, Split, advance, heldout_ids, sample_ids
from apps.training.instruments import StepInstruments
from apps.training.job import (
    MARKOV_MAX_VOCAB,
    Init,
    OnNonFinite,
    Recompute,
    RunOptions,
    TrainJob,
)
from apps.training.lr_schedule import LRScheduler
from apps.training.metrics import MetricsWriter, eval_record, run_record, step_record
from apps.training.progress import Progress, progress
from bridge.compile_ahead import AheadReport
from bridge.determinism import make_deterministic
from common import trace
from common.modes import Compute
from models.init_rule import GPTInit
from models.torch_gpt import TorchGPT
from torch_side import FSDPOptimizer, Overlap, clip_grad_norm_, fully_shard
from torch_side.comm.collectives import Collective, all_reduce_on
from torch_side.fsdp.hybrid_mesh import hsdp_mesh
from torch_side.fsdp.precompiling import precompile

__all__ = [
    "MARKOV_MAX_VOCAB",
    "NonFiniteTraining",
    "OnNonFinite",
    "RunOptions",
    "StepLog",
    "StepOutcome",
    "TrainResult",
    "Trainer",
    "train_rank",
]


class StepOutcome(enum.Enum):
    """The ``outcome`` of a step (StepLog, the JSONL step record)."""

    APPLIED = "applied"  # the optimizer updated the weights
    SKIPPED = "skipped"  # non-finite loss or gradient norm: gradients dropped, no update
    STOPPED = "stopped"  # non-finite, and training ends here with NonFiniteTraining


class NonFiniteTraining(RuntimeError):
    """Training diverged: a non-finite loss or gradient norm (raised on every rank alike)."""


_DEFAULT_OPTIONS = RunOptions()  # frozen: one shared default


@dataclasses.dataclass(frozen=True)
class StepLog:
    step: int
    loss: float  # mean token loss over ranks and micro-batches
    seconds: float  # wall time of the step on rank 0 (forward, backward, optimizer, requant)
    tokens_per_s: float
    grad_norm: float = float("nan")  # global L2 norm of the gradient of the mean loss (unclipped)
    outcome: StepOutcome = StepOutcome.APPLIED
    lr: float = float("nan")  # the learning rate of this step (job.schedule())


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
    """The wrapped model, its optimizer, its learning-rate scheduler (at step 0) and the corpus
    of one job."""

    def __init__(self, job: TrainJob, overlap: Overlap | None = None, replicas: int = 1):
        self.corpus: Corpus = job.corpus()
        self.corpus.check_fits(job.seq_len)  # not at the held-out evaluation after training
        self.cfg = job.model_config(self.corpus.vocab_size)
        unit = job.compute is Compute.UNIT
        kernels = environment.kernels(job.kernels)  # MXFP8_BACKEND / MXFP8_GEMM fill its Nones
        meta = job.init is Init.META
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = TorchGPT(
                self.cfg, job.linear_mode, seed=job.seed, device="meta" if meta else job.device,
                kernels=kernels, activations=job.resolved_activations, compute=job.compute,
                recompute=unit and job.recompute is Recompute.BLOCK,  # inside the backward program
            )
        if job.recompute is Recompute.BLOCK and not unit:
            for block in model.blocks:
                # per instance, as nn.Module allows (the class forward stays for the others)
                block.forward = _checkpointed(block.forward)  # type: ignore[method-assign,assignment]
        self.fsdp = fully_shard(
            model, unit_modules=model.block_units(job.blocks_per_unit), strategy=job.strategy,
            policy=job.policy(), kernels=kernels, overlap=overlap,
            check_collectives=environment.check_collectives(),
            init=GPTInit(self.cfg, job.seed) if meta else None, device=job.device,
            mesh=hsdp_mesh(replicas, job.device),
        )
        # one fused kernel pass over every fp32 main shard on CUDA (as FSDP2's recipe runs
        # AdamW); the single-tensor loop on the CPU, the arithmetic the Flax replay mirrors
        cuda = job.device == "cuda"
        self.opt = FSDPOptimizer(
            self.fsdp, torch.optim.AdamW, lr=job.lr, weight_decay=job.weight_decay,
            fused=cuda, foreach=None if cuda else False,
        )
        self.schedule = LRScheduler(self.opt, job.schedule())


def _checkpointed(
    forward: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)

    return run


def _batch(
    corpus: Corpus, split: Split, ids: np.ndarray, job: TrainJob
) -> tuple[torch.Tensor, torch.Tensor]:
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
            total[0] += weight * m.fsdp(tokens, targets).double()
            total[1] += weight
    all_reduce_on(total, Collective.ALL_REDUCE_SUM, "the held-out loss's all-reduce")
    return float(total[0] / total[1])


def _precompile(m: _Model, job: TrainJob) -> AheadReport:
    """Compile the step's JAX programs, and those of the held-out evaluation (a no-grad forward
    of the same shape), in parallel (torch_side.precompile: a dry micro-batch of the training
    shapes, zero tokens; weights, optimizer, data position and RNG untouched)."""
    tokens = torch.zeros((job.batch_size, job.seq_len), dtype=torch.long, device=job.device)
    report = precompile(m.fsdp, lambda: m.fsdp(tokens, tokens),
                        no_grad_forward=True)
    _sync(job)
    return report


def _forward_backward(m: _Model, job: TrainJob, position: DataPosition) -> tuple[float, float]:
    """One step's micro-batches, forward and backward; returns (the mean token loss over all
    ranks, the global gradient norm). Collectives.

    Backward runs on each micro-batch's sum of token losses: the mean's backward divides by n
    and the product multiplies by n back, so the loss gradient is exactly 1 per token (n / n
    rounds to 1) whatever the micro-batch count and batch size. The mean over this rank's tokens
    is then taken on the accumulated fp32 main gradients (``divide_grads``). Scaling the loss by
    1 / micro_batches before backward instead changed dy's MXFP8 bytes (MXFP8 scaling absorbs
    powers of two only), so runs of one global batch split differently (another world size on
    resume) differed by more than summation order.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros((), dtype=torch.float32, device=job.device)  # this rank's token-loss sum
    for mb in range(job.micro_batches):
        ids = sample_ids(position, rank=rank, world_size=world, micro_batch=mb,
                         micro_batches=job.micro_batches, batch_size=job.batch_size)
        tokens, targets = _batch(m.corpus, Split.TRAIN, ids, job)
        loss = m.fsdp(tokens, targets) * targets.numel()  # token sum, see above
        loss.backward()
        total += loss.detach()
    tokens_per_rank = job.micro_batches * job.batch_size * job.seq_len
    m.opt.divide_grads(tokens_per_rank)
    all_reduce_on(total, Collective.ALL_REDUCE_SUM, "the step loss's all-reduce")
    return float(total) / (tokens_per_rank * world), float(m.opt.grad_norm())


def _update(m: _Model, job: TrainJob, opts: RunOptions, loss: float, norm: float,
            skips: int) -> tuple[StepOutcome, int]:
    """Apply the step (its gradients clipped to ``job.grad_clip`` by the norm already computed:
    no second all-reduce), or drop it when the loss or gradient norm is not finite (the same
    values on every rank, so every rank decides alike, before any clipping); returns (outcome,
    consecutive skips)."""
    if math.isfinite(loss) and math.isfinite(norm):
        if job.grad_clip > 0:
            clip_grad_norm_(m.opt, job.grad_clip, total_norm=norm)
        m.opt.step()
        m.opt.zero_grad()
        return StepOutcome.APPLIED, 0
    m.opt.zero_grad()  # the weights stay those of the last good step
    if opts.on_nonfinite is OnNonFinite.SKIP and skips < opts.max_consecutive_skips:
        return StepOutcome.SKIPPED, skips + 1
    return StepOutcome.STOPPED, skips


def _largest_weight(m: _Model, job: TrainJob) -> float:
    """COLLECTIVE: the largest |main weight| over every group and rank (a diagnosis)."""
    local = max((float(g.main.abs().max()) for g in m.fsdp.param_groups if g.main.numel()),
                default=0.0)
    largest = torch.tensor([local], dtype=torch.float64, device=job.device)
    all_reduce_on(largest, Collective.ALL_REDUCE_MAX, "the largest weight's all-reduce")
    return float(largest)


def _diverged_message(step: int, held: float, last: StepLog | None, largest: float,
                      job: TrainJob) -> str:
    """The weights after ``step`` updates give a non-finite held-out loss."""
    what = f"the weights after {step} steps give a non-finite held-out loss ({held})"
    if last is not None:
        what = (f"step {last.step}: its update made the held-out loss {held}, although the "
                f"step's loss ({last.loss}) and global gradient norm ({last.grad_norm}) were "
                f"finite: at lr {last.lr} it moved the weights to where the forward overflows")
    weights = (f"every main weight is finite, the largest of magnitude {largest:.3g}"
               if math.isfinite(largest) else "some main weights are not finite")
    return (f"{what} ({weights}). Training stopped; no checkpoint of this state is written (the "
            f"last one written stays 'latest'). Lower the learning rate (--lr {job.lr})")


def _stop_message(log: StepLog, opts: RunOptions, skips: int) -> str:
    what = (f"step {log.step}: non-finite training (loss {log.loss}, global gradient norm "
            f"{log.grad_norm})")
    if opts.on_nonfinite is OnNonFinite.SKIP:
        return (f"{what} after {skips} consecutive skipped steps (max_consecutive_skips="
                f"{opts.max_consecutive_skips}); training stopped before this step's update and "
                f"writes no checkpoint after it. The run diverged: lower the learning rate")
    return (f"{what}; training stopped before this step's update and writes no checkpoint after "
            f"it. Lower the learning rate, or skip such steps (--on-nonfinite skip)")


def _progress(job: TrainJob, opts: RunOptions, start: int) -> Progress | None:
    if not opts.progress or dist.get_rank() != 0:
        return None
    return progress(opts.label or job.weights.value, job.steps, start,
                    every=opts.progress_every)


class Trainer:
    """One rank's training: the FSDP model, its optimizer and corpus (``parts``), the data
    position, the checkpoint saver and the metrics writer. A collective object: every rank makes
    one and calls the same methods in the same order.

    ``Trainer(job, opts)`` takes the writer lock of ``opts.save_dir`` (before the model is
    built), builds the model and resumes from ``opts.resume``; ``step()`` trains one step,
    ``save()`` writes a checkpoint at the current step, ``evaluate()`` computes the held-out loss,
    ``run()`` does all of it to ``job.steps``; ``close()`` (or leaving the ``with`` block)
    releases the metrics file and the lock.
    """

    def __init__(self, job: TrainJob, opts: RunOptions = _DEFAULT_OPTIONS):
        self.job, self.opts = job, opts
        self.saver = ckpt.CheckpointSaver.start(opts.save_dir) if opts.save_dir else None
        self.metrics: MetricsWriter | None = None
        self.instruments: StepInstruments | None = None
        self._recorder: trace.Recorder | None = None  # --trace
        try:
            if job.deterministic:
                make_deterministic()  # before the first JAX computation (XLA reads its flags once)
            self.parts = _Model(job, opts.overlap(), opts.replicas)
            self.desc = job.describe()
            self.start_step, self.position = 0, DataPosition(0)
            if opts.resume:
                resumed = ckpt.load(opts.resume, fsdp=self.parts.fsdp, opt=self.parts.opt,
                                    job=self.desc, data_digest=self.parts.corpus.content_digest(),
                                    scheduler=self.parts.schedule,
                                    timeout=opts.collective_timeout / 2)
                self.start_step, self.position = resumed.step, resumed.position
            self.instruments = StepInstruments(self.parts.fsdp, telemetry=opts.telemetry,
                                               digest=opts.digest,
                                               telemetry_every=opts.telemetry_every)
            self._open_metrics(self.instruments.start_fields())
        except BaseException:
            self.close()
            raise
        self.done = self.start_step  # steps done: the index of the next step
        self.skips = 0  # consecutive skipped steps
        self.logs: list[StepLog] = []  # the steps this trainer ran
        self._held: tuple[int, float] | None = None  # (done, held-out loss) of this state

    def _open_metrics(self, extra: dict) -> None:
        if dist.get_rank() != 0 or not self.opts.metrics:
            return
        m = self.parts
        self.metrics = MetricsWriter(self.opts.metrics, append=bool(self.opts.resume))
        self.metrics.write(run_record(
            job=self.desc, world_size=dist.get_world_size(), label=self.opts.label,
            mesh=list(m.fsdp.mesh_shape),  # (replicas, shards): --replicas
            corpus=m.corpus.describe(), loss_floor=m.corpus.loss_floor(self.job.seq_len),
            resumed_from=self.start_step, params=m.cfg.num_parameters(), **extra,
        ))

    def step(self) -> StepLog:
        """One training step: forward and backward of every micro-batch, then the update (or,
        on a non-finite loss or gradient norm, a skip, or NonFiniteTraining before the update).
        With ``--trace``, the ``trace_steps`` steps after this trainer's first are recorded."""
        first = self.start_step + (1 if self.job.steps - self.start_step > 1 else 0)
        if not self.opts.trace or not first <= self.done < first + self.opts.trace_steps:
            return self._step()
        if self._recorder is None:
            self._recorder = trace.Recorder(dist.get_rank())
        with trace.recording(self._recorder), trace.span("host: steps", f"step {self.done}"):
            log = self._step()
        where = self.opts.trace_path(dist.get_rank(), dist.get_world_size())
        assert where is not None  # opts.trace is set
        path = Path(where)
        path.parent.mkdir(parents=True, exist_ok=True)  # as the metrics and plots do
        self._recorder.write(path)
        return log

    def _step(self) -> StepLog:
        job, world = self.job, dist.get_world_size()
        self._held = None  # the weights are about to change
        t0 = time.perf_counter()
        lr = self.parts.schedule.lr  # this step's (set in the optimizer since the last step)
        loss, norm = _forward_backward(self.parts, job, self.position)
        instruments = self.instruments
        assert instruments is not None  # made by __init__
        instruments.before_update(self.done)
        outcome, self.skips = _update(self.parts, job, self.opts, loss, norm, self.skips)
        self.position = advance(self.position, world_size=world,
                                micro_batches=job.micro_batches, batch_size=job.batch_size)
        _sync(job)
        seconds = time.perf_counter() - t0
        extra = instruments.after_update()  # --telemetry, --digest (outside step_s)
        log = StepLog(self.done, loss, seconds, job.tokens_per_step(world) / seconds, norm,
                      outcome, lr)
        self.logs.append(log)
        if self.metrics is not None:
            self.metrics.write(step_record(step=log.step, loss=loss, step_s=seconds,
                                           tokens_per_s=log.tokens_per_s, grad_norm=norm,
                                           lr=lr, outcome=outcome.value, **extra))
        if outcome is StepOutcome.STOPPED:
            raise NonFiniteTraining(_stop_message(log, self.opts, self.skips))
        self.done += 1
        self.parts.schedule.step()  # a skipped step counts: the lr follows the step index
        return log

    def save(self) -> None:
        """A checkpoint of the current step into ``opts.save_dir`` (nothing without one), of a
        state whose held-out loss is finite only (``require_finite_state``)."""
        if self.saver is not None:
            self.require_finite_state()
            self.saver.save(step=self.done, fsdp=self.parts.fsdp, opt=self.parts.opt,
                            position=self.position, job=self.desc,
                            data_digest=self.parts.corpus.content_digest(),
                            scheduler=self.parts.schedule)

    def evaluate(self) -> float:
        """The held-out loss (``heldout_loss``), also written as the ``eval`` metrics record."""
        held = self._heldout()
        if self.metrics is not None:
            self.metrics.write(eval_record(step=self.done, heldout_loss=held))
        return held

    def _heldout(self) -> float:
        """``heldout_loss`` of the current weights, computed once per state (a collective)."""
        if self._held is None or self._held[0] != self.done:
            self._held = (self.done, heldout_loss(self.parts, self.job))
        return self._held[1]

    def require_finite_state(self) -> None:
        """COLLECTIVE: ``NonFiniteTraining`` (on every rank alike: the loss is all-reduced)
        unless the current weights give a finite held-out loss. An update can leave every
        weight finite and still diverge: ``--lr 1e37`` makes them ~1e37, and the first linear
        layer's output (~1e74) overflows fp32; the next step's loss would stop the run, but a
        checkpoint written in between, or at the end, would keep that state. One held-out
        evaluation per checkpoint (the one at the end is the run's own evaluation)."""
        held = self._heldout()
        if math.isfinite(held):
            return
        if self.metrics is not None:  # the file says why the run ended
            self.metrics.write(eval_record(step=self.done, heldout_loss=held))
        last = self.logs[-1] if self.logs and self.logs[-1].step == self.done - 1 else None
        raise NonFiniteTraining(_diverged_message(
            self.done, held, last, _largest_weight(self.parts, self.job), self.job))

    def run(self) -> TrainResult:
        """Precompile, train to ``job.steps`` (checkpoints every ``save_every`` steps and at the
        end), evaluate; what ``train_rank`` returns."""
        job, opts = self.job, self.opts
        report = None
        if opts.precompile and job.steps > self.done:
            report = _precompile(self.parts, job)
        bar = _progress(job, opts, self.done)
        try:
            while self.done < job.steps:
                log = self.step()
                if bar is not None:
                    bar.show(log.step, log.loss, log.tokens_per_s, log.seconds)
                if opts.save_every and self.done % opts.save_every == 0:
                    self.save()
            self.require_finite_state()  # a run that diverged at its end exits nonzero too
            held = self.evaluate()  # the same evaluation (computed once per state)
            if not opts.save_every or self.done % opts.save_every:
                self.save()
        finally:
            if bar is not None:
                bar.close()
        return self._result(held, report)

    def _result(self, held: float, report: AheadReport | None) -> TrainResult:
        corpus, logs = self.parts.corpus, self.logs
        return TrainResult(
            job=self.job, world_size=dist.get_world_size(), steps=logs,
            start_step=self.start_step, heldout_loss=held,
            loss_floor=corpus.loss_floor(self.job.seq_len),
            initial_loss=math.log(self.parts.cfg.vocab_size),
            first_step_s=logs[0].seconds if logs else float("nan"), corpus=corpus.describe(),
            precompile_s=report.wall_s if report else 0.0,
            precompiled_programs=report.programs if report else 0,
        )

    def close(self) -> None:
        """Close the metrics file, then release the writer lock (in that order, on every exit)."""
        try:
            if self.instruments is not None:
                self.instruments.close()
            if self.metrics is not None:
                self.metrics.close()
        finally:
            if self.saver is not None:
                self.saver.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def train_rank(job: TrainJob, opts: RunOptions = _DEFAULT_OPTIONS) -> TrainResult:
    """Train on this rank's part of the data-parallel group; a collective (every rank calls it).

    A run with ``save_dir`` holds that directory's writer lock from before the model is built
    until it returns or raises (``apps.training.checkpoint.CheckpointSaver``)."""
    with Trainer(job, opts) as trainer:
        return trainer.run()
