"""What one training run is: ``TrainJob`` (the numerics and data) and ``RunOptions`` (where it
writes, what it resumes from), validated once, picklable for spawned ranks. Every field's flag is
declared on the field (``apps.training.options``); ``mxfp8-train`` derives its parser from them.

The weights choice (``Weights``) picks a recipe from ONE table, ``RECIPES``:

| weights | linear layers (``LinearMode``)     | FSDP model weights                               |
|---------|------------------------------------|--------------------------------------------------|
| mxfp8   | MXFP8 GEMMs on MXFP8 planes        | linears MXFP8, others fp32 (bf16 with bf16 acts) |
| bf16    | high precision, bf16 weights       | everything bf16                                  |
| fp32    | high precision, fp32 weights       | everything fp32 (the exact control)              |

Main weights, optimizer state and gradient reduction are fp32 in every case. Activations default
to fp32 on CPU (the exact twin) and bf16 with fused attention on CUDA (the training path):
``DEFAULT_ACTIVATIONS``. ``gather`` (``--gather``) picks what the MXFP8 weights' all-gathers carry
(``GatherMode``: MXFP8 planes, or bf16 that every rank quantizes itself): the same bytes reach the
GEMMs either way, only the wire differs.

The learning rate follows ``schedule()`` (``apps.training.lr_schedule.ScheduleConfig``: linear
warmup over ``warmup_steps``, then constant, cosine or linear decay to ``min_lr`` at ``steps``), and
``grad_clip`` > 0 clips the global gradient norm (``torch_side.clip_grad_norm_``).

The module imports neither torch nor JAX (nor numpy): ``mxfp8-train``'s parser is built from
these classes, and ``--help`` or a refused flag answers in a fraction of a second. What needs a
framework (``policy()``, ``corpus()``, ``overlap()``) imports it when called.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from apps.training.lr_schedule import LRSchedule, ScheduleConfig
from apps.training.options import (
    Group,
    internal,
    non_negative_float,
    non_negative_int,
    option,
    positive,
)
from common.formats import WeightFormat
from common.kernels import KernelConfig
from common.model_config import PRESETS, GPTConfig
from common.modes import Activations, Compute, GatherMode, LinearMode
from torch_side.fsdp.flat_layout import ShardLayout
from torch_side.fsdp.strategy import ShardingStrategy

if TYPE_CHECKING:  # imported where used: the parser (mxfp8-train --help) needs no torch
    from apps.training.data import Corpus
    from torch_side import MixedPrecisionPolicy, Overlap

__all__ = [
    "DEFAULT_ACTIVATIONS",
    "MARKOV_MAX_VOCAB",
    "Init",
    "RECIPES",
    "OnNonFinite",
    "Recipe",
    "Recompute",
    "RunOptions",
    "TrainJob",
    "Weights",
]

# A Markov corpus keeps a dense (V, V) transition matrix: presets with a GPT-2 vocabulary train on
# a chain over the first MARKOV_MAX_VOCAB tokens (the model's vocabulary follows the corpus).
MARKOV_MAX_VOCAB = 1024

# torch.optim.AdamW's first step divides the learning rate by its bias correction 1 - beta1 (0.1
# with the default beta1 = 0.9, which the trainer uses) and converts the quotient to the weights'
# float32: above FLOAT32_MAX it raises "value cannot be converted to type float without overflow"
# inside the optimizer. (Far smaller rates already diverge; --on-nonfinite stops those runs.)
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")
ADAMW_FIRST_STEP_DIVISOR = 1 - 0.9


class Weights(enum.Enum):
    """The precision recipe of a run (``--weights``): a key of ``RECIPES``."""

    MXFP8 = "mxfp8"
    BF16 = "bf16"
    FP32 = "fp32"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a ``Weights`` choice means: the linear layers' GEMMs and the FSDP weight formats."""

    linear_mode: LinearMode
    # FSDP format of every weight that is not an MXFP8 linear weight, by activation dtype
    other_format: Mapping[Activations, WeightFormat]


RECIPES: dict[Weights, Recipe] = {
    Weights.MXFP8: Recipe(LinearMode.MXFP8, {Activations.FP32: WeightFormat.FP32,
                                             Activations.BF16: WeightFormat.BF16}),
    Weights.BF16: Recipe(LinearMode.HIGH_PRECISION, {Activations.FP32: WeightFormat.BF16,
                                                     Activations.BF16: WeightFormat.BF16}),
    Weights.FP32: Recipe(LinearMode.HIGH_PRECISION, {Activations.FP32: WeightFormat.FP32,
                                                     Activations.BF16: WeightFormat.FP32}),
}

DEFAULT_ACTIVATIONS = {"cpu": Activations.FP32, "cuda": Activations.BF16}  # by TrainJob.device


class Init(enum.Enum):
    """How the model's initial weights are made (``--init``)."""

    SEEDED = "seeded"  # TorchGPT(seed): built whole on every rank, rank 0's values broadcast
    META = "meta"  # built on the meta device, each rank fills its own shard (models.init_rule)


class Recompute(enum.Enum):
    """Activation checkpointing of the transformer blocks."""

    NONE = "none"
    BLOCK = "block"  # every block's forward is recomputed in backward


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r}: expected an integer >= 1")


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """One run's settings; each field's flag and help are in its ``option`` (apps.training.cli
    derives the command line from them, ``apps.training.options``)."""

    config: str = option("tiny", Group.MODEL, choices=tuple(PRESETS), help="GPTConfig preset")
    weights: Weights = option(
        Weights.MXFP8, Group.MODEL,
        help="linear layers: MXFP8, or the bf16 / fp32 high-precision controls")
    activations: Activations | None = option(  # None: DEFAULT_ACTIVATIONS[device]
        None, Group.MODEL,
        help="activation dtype (default fp32 on cpu, bf16 + fused attention on cuda)")
    strategy: ShardingStrategy = option(ShardingStrategy.OPTIM_GRADS_PARAMS, Group.MODEL)
    gather: GatherMode = option(
        GatherMode.MXFP8, Group.MODEL,
        help="what the MXFP8 weights' all-gathers carry: their MXFP8 planes (1 byte/element) or "
             "bf16 (2 bytes/element) that every rank quantizes itself; the GEMMs read the same "
             "bytes either way (--weights mxfp8 only)")
    shard_layout: ShardLayout = option(
        ShardLayout.LCM, Group.MODEL,
        help="where the MXFP8 weights' shard boundaries may fall: lcm (rows whole) or "
             "block_atomic (whole 32-row scale blocks, as upstream Megatron-FSDP v2 shards: each "
             "rank makes its blocks' scales, all-gathered; more padding at large world sizes). "
             "The same bytes either way; a checkpoint resumes in either layout")
    recompute: Recompute = option(Recompute.NONE, Group.MODEL,
                                  help="activation checkpointing of the transformer blocks")
    init: Init = option(
        Init.SEEDED, Group.MODEL,
        help="seeded: every rank builds the whole model from --seed and FSDP shards rank 0's; "
             "meta: the model is built on the meta device and each rank materialises only its "
             "own shard (initial values by position, models.init_rule.GPTInit: other values "
             "than seeded, the same at every world size)")
    compute: Compute = option(
        Compute.UNIT, Group.MODEL,
        help="unit: each block's forward and backward, and the head with the loss, as one JAX "
             "program each; op: one JAX op per linear layer (bridge.MXFP8Linear)")
    blocks_per_unit: int = option(
        1, Group.MODEL, parse=positive(int),
        help="transformer blocks per FSDP unit (the last takes the remainder): one all-gather "
             "and one gradient reduction per unit and, with --compute unit, one JAX program per "
             "unit and direction -- fewer, larger programs, less host time per step, up to N "
             "blocks' weights gathered at once. The same bits on CPU and with --deterministic "
             "on the GPU; a resume needs the same N")
    steps: int = option(40, Group.OPTIM, parse=positive(int))
    micro_batches: int = option(2, Group.OPTIM, parse=positive(int))
    batch_size: int = option(8, Group.OPTIM, parse=positive(int),
                             help="sequences per rank and micro-batch")
    seq_len: int = option(32, Group.OPTIM, parse=positive(int))
    lr: float = option(3e-3, Group.OPTIM, parse=positive(float))
    weight_decay: float = option(0.0, Group.OPTIM)
    lr_schedule: LRSchedule = option(
        LRSchedule.CONSTANT, Group.OPTIM,
        help="after warmup: constant --lr, or cosine / linear decay from --lr to --min-lr at "
             "--steps")
    warmup_steps: int = option(0, Group.OPTIM, parse=non_negative_int,
                               help="linear warmup: step s < N trains at lr * (s + 1) / N")
    min_lr: float = option(0.0, Group.OPTIM, parse=non_negative_float,
                           help="the learning rate cosine / linear decay ends at")
    grad_clip: float = option(
        0.0, Group.OPTIM, parse=non_negative_float,
        help="clip the global gradient norm (all shards and ranks) to this; 0: off")
    seed: int = option(0, Group.OPTIM, parse=non_negative_int)
    data: str = option(  # apps.training.data.make_corpus
        "markov", Group.OPTIM,
        help="'markov' (exact loss floor), 'stdlib' (the Python standard library's sources as "
             "bytes), a directory with nanoGPT's train.bin and val.bin (uint16 token ids, "
             "e.g. GPT-2's: use a --config whose vocabulary covers them) or a text file / "
             "directory of text files")
    branching: int = option(4, Group.OPTIM, parse=positive(int),
                            help="successors per token of the Markov corpus (--data markov)")
    eval_batches: int = option(4, Group.OPTIM, parse=positive(int),
                               help="held-out batches evaluated at the end")
    device: str = option("cpu", Group.WHERE, choices=("cpu", "cuda"),
                         help="cpu: gloo ranks; cuda: NCCL, one GPU per rank")
    kernels: KernelConfig | None = option(None, Group.MODEL, nested_help={
        "backend": "MXFP8 quantize backend (default: the device's, reported)",
        "gemm": "MXFP8 GEMM implementation (default: the device's, reported)"})
    deterministic: bool = option(
        False, Group.MODEL,
        help="the same bits in every GPU launch and across a resume: no XLA GEMM autotuning, "
             "deterministic Torch kernels (bridge.determinism; costs 7-30%% of a 124M step "
             "on the H200). CPU runs are reproducible anyway")

    def __post_init__(self) -> None:
        owner = "TrainJob"
        if self.config not in PRESETS:
            raise ValueError(f"{owner}.config={self.config!r}: expected one of {list(PRESETS)}")
        object.__setattr__(self, "weights", Weights(self.weights))
        object.__setattr__(self, "strategy", ShardingStrategy.parse(self.strategy))
        object.__setattr__(self, "gather", GatherMode.parse(self.gather))
        object.__setattr__(self, "shard_layout", ShardLayout.parse(self.shard_layout))
        object.__setattr__(self, "lr_schedule", LRSchedule.parse(self.lr_schedule))
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        object.__setattr__(self, "init", Init(self.init))
        object.__setattr__(self, "compute", Compute.parse(self.compute))
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"{owner}.device={self.device!r}: expected 'cpu' or 'cuda'")
        if self.activations is not None:
            object.__setattr__(self, "activations", Activations(self.activations))
        for name in ("steps", "micro_batches", "batch_size", "seq_len", "branching",
                     "eval_batches", "blocks_per_unit"):
            _positive_int(owner, name, getattr(self, name))
        if not (isinstance(self.lr, float | int) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"{owner}.lr={self.lr!r}: expected a finite learning rate > 0")
        if self.lr / ADAMW_FIRST_STEP_DIVISOR > FLOAT32_MAX:
            raise ValueError(
                f"{owner}.lr={self.lr!r}: AdamW's first step divides the learning rate by "
                f"1 - beta1 = {ADAMW_FIRST_STEP_DIVISOR:.1g}, over the float32 maximum "
                f"{FLOAT32_MAX:.4g}; expected lr <= {FLOAT32_MAX * ADAMW_FIRST_STEP_DIVISOR:.3g} "
                f"(rates that train are ~1e-4 .. 1e-2)")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"{owner}.weight_decay={self.weight_decay!r}: expected >= 0")
        self._check_schedule_and_gather(owner)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"{owner}.seed={self.seed!r}: expected an integer >= 0")
        if self.blocks_per_unit > PRESETS[self.config].n_layer:
            raise ValueError(
                f"{owner}.blocks_per_unit={self.blocks_per_unit} exceeds n_layer="
                f"{PRESETS[self.config].n_layer} of config {self.config!r}"
            )
        if self.seq_len > PRESETS[self.config].max_seq_len:
            raise ValueError(
                f"{owner}.seq_len={self.seq_len} exceeds max_seq_len="
                f"{PRESETS[self.config].max_seq_len} of config {self.config!r}"
            )
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"{owner}.deterministic={self.deterministic!r}: expected a bool")
        if self.kernels is not None and not isinstance(self.kernels, KernelConfig):
            raise TypeError(f"{owner}.kernels={self.kernels!r}: expected a KernelConfig")

    def _check_schedule_and_gather(self, owner: str) -> None:
        if isinstance(self.grad_clip, bool) or not (
            isinstance(self.grad_clip, int | float) and math.isfinite(self.grad_clip)
            and self.grad_clip >= 0
        ):
            raise ValueError(f"{owner}.grad_clip={self.grad_clip!r}: expected a number >= 0 "
                             f"(0: no clipping)")
        try:
            self.schedule()
        except ValueError as e:  # name the flags, not the library's fields
            raise ValueError(
                f"{owner}: lr_schedule={self.lr_schedule.value}, lr={self.lr}, min_lr="
                f"{self.min_lr}, warmup_steps={self.warmup_steps}, steps={self.steps}: {e}"
            ) from None
        if self.gather is GatherMode.BF16 and self.weights is not Weights.MXFP8:
            raise ValueError(
                f"{owner}.gather=bf16 with weights={self.weights.value}: the gather mode applies "
                f"to MXFP8 weights only (--weights {self.weights.value} gathers its weights as "
                f"they are); drop --gather or use --weights mxfp8"
            )

    # ---- what the job means ----------------------------------------------------------------
    def schedule(self) -> ScheduleConfig:
        """The learning-rate schedule over the run's ``steps``."""
        return ScheduleConfig(self.lr, self.lr_schedule, self.warmup_steps, self.steps,
                              self.min_lr)

    @property
    def resolved_activations(self) -> Activations:
        return self.activations or DEFAULT_ACTIVATIONS[self.device]

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.weights]

    @property
    def linear_mode(self) -> LinearMode:
        return self.recipe.linear_mode

    def policy(self) -> MixedPrecisionPolicy:
        """The FSDP policy of the recipe (the table in the module docstring)."""
        import torch

        from torch_side import MixedPrecisionPolicy

        other = self.recipe.other_format[self.resolved_activations]
        return MixedPrecisionPolicy(other_format=other, main_grad_dtype=torch.float32,
                                    gather=self.gather, shard_layout=self.shard_layout)

    def corpus(self) -> Corpus:
        """The job's corpus. The model's vocabulary follows it: bytes for text, the preset's
        (capped at MARKOV_MAX_VOCAB) for the Markov chain, the preset's for token files (which
        must hold no id outside it)."""
        from apps.training.data import BYTE_VOCAB, is_token_dir, make_corpus

        vocab = BYTE_VOCAB
        if self.data == "markov":
            vocab = min(PRESETS[self.config].vocab_size, MARKOV_MAX_VOCAB)
        elif self.data != "stdlib" and is_token_dir(self.data):
            vocab = PRESETS[self.config].vocab_size
        return make_corpus(self.data, vocab_size=vocab, seed=self.seed, branching=self.branching)

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The preset, with the corpus's vocabulary (byte corpora need 256 tokens; token files
        keep the preset's)."""
        cfg = PRESETS[self.config]
        return cfg if cfg.vocab_size == vocab_size else dataclasses.replace(
            cfg, vocab_size=vocab_size
        )

    def tokens_per_step(self, world_size: int) -> int:
        return world_size * self.micro_batches * self.batch_size * self.seq_len

    def control(self) -> TrainJob:
        """The same run with fp32 linear layers (the ``--compare`` control)."""
        return dataclasses.replace(self, weights=Weights.FP32, gather=GatherMode.MXFP8)

    def describe(self) -> dict:
        """JSON-safe description (for metrics run records and checkpoint metadata)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, KernelConfig):
                v = {k: (None if x is None else x.value) for k, x in dataclasses.asdict(v).items()}
            out[f.name] = v
        out["activations"] = self.resolved_activations.value
        return out


class OnNonFinite(enum.Enum):
    """What a step whose loss or global gradient norm is NaN/Inf does."""

    STOP = "stop"  # raise NonFiniteTraining before the update: no step, no checkpoint after it
    SKIP = "skip"  # drop the step's gradients, no update; stop after max_consecutive_skips


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Where a run writes and what it resumes from (not part of the numerics)."""

    metrics: str | None = option(None, Group.OUTPUTS,
                                 help="JSONL metrics file (one object per step)")
    save_dir: str | None = option(None, Group.OUTPUTS, help="directory for sharded checkpoints")
    save_every: int = option(0, Group.OUTPUTS, parse=non_negative_int,
                             help="steps between checkpoints (0: one at the end, with --save-dir)")
    resume: str | None = option(None, Group.OUTPUTS,
                                help="a --save-dir (its latest checkpoint) or a step_* directory")
    progress: bool = option(True, Group.OUTPUTS, help="no progress display")  # rank 0's
    progress_every: int = option(  # apps.training.progress
        10, Group.OUTPUTS, parse=positive(int),
        help="where stderr is not a terminal (a log file, CI, nohup), a progress line every N "
             "steps (and on the first and the last) instead of the bar")
    label: str = internal("", "shown in the progress bar and the run record; the command line "
                              "sets it to the --weights value (or 'fp32 control')")
    precompile: bool = option(  # compile the JAX linear programs in parallel before step 1
        True, Group.OUTPUTS,
        help="compile the JAX programs as the first step reaches them, one after another, "
             "instead of all at once in parallel before it")
    on_nonfinite: OnNonFinite = option(
        OnNonFinite.STOP, Group.OPTIM,
        help="a step whose loss or global gradient norm is NaN/Inf: stop training with an error "
             "(default), or skip its update and go on")
    max_consecutive_skips: int = option(
        10, Group.OPTIM, parse=positive(int),
        help="with --on-nonfinite skip: stop after this many skipped steps in a row")
    # apps.training.instruments, torch_side.instruments.numerics_telemetry
    telemetry: bool = option(
        False, Group.OUTPUTS,
        help="MXFP8 numerics per group, plane and step in the --metrics step records: E8M0 "
             "scale-exponent histogram, shares of elements quantized to zero / subnormal, of "
             "scale blocks changed since the last step, amax headroom (docs/training.md)")
    telemetry_every: int = option(  # apps.training.instruments
        1, Group.OUTPUTS, parse=positive(int),
        help="with --telemetry: record it only on the steps whose index is a multiple of N "
             "(changed blocks then count since the previous recorded step); the other steps "
             "pay nothing for it")
    prefetch: int = option(  # torch_side.Overlap
        1, Group.WHERE, parse=non_negative_int,
        help="units whose weight all-gathers are issued ahead of the compute, forward and "
             "backward (0: gather each unit when it runs); up to N + 1 units' weights are "
             "gathered at once. Never changes the numbers")
    replicas: int = option(  # torch_side.fsdp.hybrid_mesh
        1, Group.WHERE, parse=positive(int),
        help="HSDP: R replicas of the model, each sharded over world / R ranks (a 2-D device "
             "mesh, replicate x shard: --strategy runs inside each shard group, gradients are "
             "also all-reduced across the replicas); R must divide the world size. 1: plain "
             "FSDP over every rank. A checkpoint resumes at any --replicas and world size")
    collective_timeout: float = option(
        300.0, Group.WHERE, parse=positive(float),
        help="seconds a collective may wait for the other ranks; a checkpoint load gives up "
             "reading after half of it, so a stalled file system stops every rank with an "
             "error")
    sync_reduce: bool = option(  # torch_side.Overlap
        False, Group.WHERE,
        help="wait for each unit's gradient reduce-scatter before backward goes on (default: "
             "asynchronous, settled where the gradients are read). Never changes the numbers")
    trace: str | None = option(  # common.trace, apps.training.loop
        None, Group.OUTPUTS,
        help="write a Chrome / Perfetto trace (JSON) of --trace-steps steps after the first: "
             "collectives with their streams, bucket memory, unit forward / backward and JAX "
             "program dispatch. With several ranks each writes PATH with .rank<r> before the "
             "suffix")
    trace_steps: int = option(2, Group.OUTPUTS, parse=positive(int),
                              help="with --trace: how many steps to trace")
    digest: bool = option(  # apps.training.instruments, torch_side.instruments.step_digest
        False, Group.OUTPUTS,
        help="64-bit hashes per group and step of the main weights, reduced gradients, MXFP8 "
             "planes and scales in the --metrics records, independent of the world size; "
             "compare two runs with mxfp8-digest-diff A.jsonl B.jsonl")

    def overlap(self) -> Overlap:
        """FSDP's communication schedule (``torch_side.Overlap``; ``MXFP8_FSDP_COMM_STREAMS=1``
        sends world-size-1 copies through the communication streams: ``apps.environment``)."""
        from apps import environment
        from torch_side import Overlap

        return Overlap(prefetch=self.prefetch, async_reduce=not self.sync_reduce,
                       streams_at_world_1=environment.comm_streams())

    def trace_path(self, rank: int, world_size: int) -> str | None:
        """Where this rank writes ``--trace`` (None: no trace)."""
        if not self.trace or world_size == 1:
            return self.trace
        stem, suffix = os.path.splitext(self.trace)
        return f"{stem}.rank{rank}{suffix}"

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_nonfinite", OnNonFinite(self.on_nonfinite))
        _positive_int("RunOptions", "telemetry_every", self.telemetry_every)
        _positive_int("RunOptions", "progress_every", self.progress_every)
        _positive_int("RunOptions", "trace_steps", self.trace_steps)
        _positive_int("RunOptions", "replicas", self.replicas)
        if not (isinstance(self.collective_timeout, (int, float))
                and math.isfinite(self.collective_timeout) and self.collective_timeout > 0):
            raise ValueError(f"RunOptions.collective_timeout={self.collective_timeout!r}: "
                             f"expected a number of seconds > 0")
        # torch_side.Overlap checks them again when training builds it (overlap())
        if isinstance(self.prefetch, bool) or not (
            isinstance(self.prefetch, int) and self.prefetch >= 0
        ):
            raise ValueError(f"RunOptions.prefetch={self.prefetch!r}: expected an integer >= 0 "
                             f"(units whose all-gathers are issued ahead; 0: none)")
        if not isinstance(self.sync_reduce, bool):
            raise TypeError(f"RunOptions.sync_reduce={self.sync_reduce!r}: expected a bool")
        if isinstance(self.max_consecutive_skips, bool) or not (
            isinstance(self.max_consecutive_skips, int) and self.max_consecutive_skips >= 1
        ):
            raise ValueError(
                f"RunOptions.max_consecutive_skips={self.max_consecutive_skips!r}: expected an "
                f"integer >= 1"
            )
