"""``GPTConfig``: the one config both GPT twins are built from, and the matmul mode enum.

Framework-free on purpose (no jax, no torch import): the Torch twin in ``torch_side.models`` builds
from the very same dataclass, so the two twins cannot drift apart in shape or hyperparameters.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["GPTConfig", "MatmulMode", "TINY", "SMALL", "PRESETS"]

_BLOCK = 32  # MXFP8 block size: every MXFP8 weight dim must be a multiple of it (DESIGN.md 4)


class MatmulMode(enum.Enum):
    """How the linear layers multiply: MXFP8 GEMMs, or the high-precision control (no quantization).

    Values equal ``bridge.LinearMode``'s, so a mode crosses the bridge by value.
    """

    MXFP8 = "mxfp8"
    HIGH_PRECISION = "high_precision"

    @classmethod
    def parse(cls, value: MatmulMode | str) -> MatmulMode:
        if isinstance(value, cls):
            return value
        if hasattr(value, "value"):  # another framework's enum with the same values
            value = value.value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown matmul mode {value!r}: expected one of {[m.value for m in cls]}"
            ) from None


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A small GPT-2 style decoder: pre-norm blocks, learned positions, untied LM head, no biases
    in linear layers (every linear weight is an MXFP8 parameter; LayerNorm and embeddings stay in
    high precision).

    Every linear weight is (out, in) with both dims multiples of 32, validated here:
    qkv (3*d_model, d_model), attn proj (d_model, d_model), fc (d_ff, d_model),
    mlp proj (d_model, d_ff), lm_head (vocab_size, d_model).
    """

    vocab_size: int = 128
    max_seq_len: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    d_ff: int = 128
    ln_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "d_ff"):
            value = getattr(self, name)
            if value <= 0 or value % _BLOCK:
                raise ValueError(
                    f"GPTConfig.{name}={value}: linear weights built from it must have dims that "
                    f"are positive multiples of {_BLOCK} (MXFP8 blocks, DESIGN.md 4); use "
                    f"{max(_BLOCK, -(-value // _BLOCK) * _BLOCK)}"
                )
        if self.n_head <= 0 or self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}"
            )
        if self.n_layer <= 0 or self.max_seq_len <= 0:
            raise ValueError(
                f"GPTConfig: n_layer={self.n_layer} and max_seq_len={self.max_seq_len} must be > 0"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Parameter name -> (out, in) of every linear weight (the MXFP8 parameters)."""
        d, f = self.d_model, self.d_ff
        shapes: dict[str, tuple[int, int]] = {}
        for i in range(self.n_layer):
            shapes[f"h_{i}.attn.qkv.weight"] = (3 * d, d)
            shapes[f"h_{i}.attn.proj.weight"] = (d, d)
            shapes[f"h_{i}.mlp.fc.weight"] = (f, d)
            shapes[f"h_{i}.mlp.proj.weight"] = (d, f)
        shapes["lm_head.weight"] = (self.vocab_size, d)
        return shapes


TINY = GPTConfig()
SMALL = GPTConfig(vocab_size=256, max_seq_len=128, n_layer=4, n_head=4, d_model=128, d_ff=512)
PRESETS: dict[str, GPTConfig] = {"tiny": TINY, "small": SMALL}
