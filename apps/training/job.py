"""``TrainJob``: everything one training run needs, validated once, picklable for spawned ranks.

The weights choice (``Weights``) decides the linear layers and the FSDP policy:

| weights | linear layers (``LinearMode``)     | FSDP model weights                               |
|---------|------------------------------------|--------------------------------------------------|
| mxfp8   | MXFP8 GEMMs on MXFP8 planes        | linears MXFP8, others fp32 (bf16 with bf16 acts) |
| bf16    | high precision, bf16 weights       | everything bf16                                  |
| fp32    | high precision, fp32 weights       | everything fp32 (the exact control)              |

Main weights, optimizer state and gradient reduction are fp32 in every case. Activations default
to fp32 on CPU (the exact twin) and bf16 with fused attention on CUDA (the training path).
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

from common.kernels import KernelConfig
from common.model_config import PRESETS, GPTConfig
from common.modes import LinearMode
from torch_side import MixedPrecisionPolicy, ShardingStrategy, WeightFormat
from torch_side.models.gpt import Activations

__all__ = ["Recompute", "TrainJob", "Weights"]


class Weights(enum.Enum):
    MXFP8 = "mxfp8"
    BF16 = "bf16"
    FP32 = "fp32"


class Recompute(enum.Enum):
    """Activation checkpointing of the transformer blocks."""

    NONE = "none"
    BLOCK = "block"  # every block's forward is recomputed in backward


def _positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r}: expected an integer >= 1")


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """One run's settings (see ``apps.training.cli`` for the command-line flags)."""

    config: str = "tiny"  # common.model_config.PRESETS key
    weights: Weights = Weights.MXFP8
    activations: Activations | None = None  # None: fp32 on cpu, bf16 on cuda
    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
    recompute: Recompute = Recompute.NONE
    steps: int = 40
    micro_batches: int = 2
    batch_size: int = 8  # sequences per rank and micro-batch
    seq_len: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    data: str = "markov"  # "markov", "stdlib" or a path (apps.training.data.make_corpus)
    branching: int = 4  # successors per token of the Markov corpus
    eval_batches: int = 4  # held-out batches (of batch_size sequences) evaluated at the end
    device: str = "cpu"
    kernels: KernelConfig | None = None
    deterministic: bool = False  # bridge.determinism: the same bits in every GPU launch

    def __post_init__(self) -> None:
        owner = "TrainJob"
        if self.config not in PRESETS:
            raise ValueError(f"{owner}.config={self.config!r}: expected one of {list(PRESETS)}")
        object.__setattr__(self, "weights", Weights(self.weights))
        object.__setattr__(self, "strategy", ShardingStrategy.parse(self.strategy))
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"{owner}.device={self.device!r}: expected 'cpu' or 'cuda'")
        if self.activations is not None:
            object.__setattr__(self, "activations", Activations(self.activations))
        for name in ("steps", "micro_batches", "batch_size", "seq_len", "eval_batches"):
            _positive_int(owner, name, getattr(self, name))
        if not (isinstance(self.lr, float | int) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"{owner}.lr={self.lr!r}: expected a finite learning rate > 0")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"{owner}.weight_decay={self.weight_decay!r}: expected >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"{owner}.seed={self.seed!r}: expected an integer >= 0")
        if self.seq_len > PRESETS[self.config].max_seq_len:
            raise ValueError(
                f"{owner}.seq_len={self.seq_len} exceeds max_seq_len="
                f"{PRESETS[self.config].max_seq_len} of config {self.config!r}"
            )
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"{owner}.deterministic={self.deterministic!r}: expected a bool")
        if self.kernels is not None and not isinstance(self.kernels, KernelConfig):
            raise TypeError(f"{owner}.kernels={self.kernels!r}: expected a KernelConfig")

    # ---- what the job means ----------------------------------------------------------------
    @property
    def resolved_activations(self) -> Activations:
        if self.activations is not None:
            return self.activations
        return Activations.BF16 if self.device == "cuda" else Activations.FP32

    @property
    def linear_mode(self) -> LinearMode:
        return LinearMode.MXFP8 if self.weights is Weights.MXFP8 else LinearMode.HIGH_PRECISION

    def policy(self) -> MixedPrecisionPolicy:
        """The FSDP policy of the table in the module docstring."""
        bf16 = self.weights is Weights.BF16 or (
            self.weights is Weights.MXFP8 and self.resolved_activations is Activations.BF16
        )
        other = WeightFormat.BF16 if bf16 else WeightFormat.FP32
        return MixedPrecisionPolicy(other_format=other, main_grad_dtype=torch.float32)

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The preset, with the corpus's vocabulary (byte corpora need 256 tokens)."""
        cfg = PRESETS[self.config]
        return cfg if cfg.vocab_size == vocab_size else dataclasses.replace(
            cfg, vocab_size=vocab_size
        )

    def tokens_per_step(self, world_size: int) -> int:
        return world_size * self.micro_batches * self.batch_size * self.seq_len

    def control(self) -> TrainJob:
        """The same run with fp32 linear layers (the ``--compare`` control)."""
        return dataclasses.replace(self, weights=Weights.FP32)

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
