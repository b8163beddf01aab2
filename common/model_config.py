"""``GPTConfig``: the one config both GPT twins are built from, and its presets.

Framework-free on purpose (no jax, no torch import): the Torch twin (``models.torch_gpt``) and
the Flax twin (``models.flax_gpt``) build from the very same dataclass, so they cannot drift apart
in shape or hyperparameters.
"""

from __future__ import annotations

import dataclasses

from common.formats import BLOCK_SIZE, block_padded

__all__ = ["GPT2_124M", "GPT2_350M", "GPT_1_3B", "GPT_2_7B", "PRESETS", "SMALL", "TINY",
           "GPTConfig"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 style decoder: pre-norm blocks, learned positions, untied LM head, no biases in
    linear layers (every linear weight is an MXFP8 parameter; LayerNorm and embeddings stay in
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
            if value <= 0 or value % BLOCK_SIZE:
                raise ValueError(
                    f"GPTConfig.{name}={value}: linear weights built from it must have dims that "
                    f"are positive multiples of {BLOCK_SIZE} (MXFP8 blocks, DESIGN.md 4); use "
                    f"{block_padded(value)}"
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

    def num_parameters(self) -> int:
        """Parameters of the model built from this config (embeddings, norms, linears)."""
        d = self.d_model
        linears = sum(m * k for m, k in self.linear_shapes().values())
        norms = (2 * self.n_layer + 1) * 2 * d
        return linears + norms + (self.vocab_size + self.max_seq_len) * d


TINY = GPTConfig()
SMALL = GPTConfig(vocab_size=256, max_seq_len=128, n_layer=4, n_head=4, d_model=128, d_ff=512)
# GPT-2 shapes (vocab padded to 50304 = 393 * 128, as nanoGPT does); untied LM head here.
GPT2_124M = GPTConfig(
    vocab_size=50304, max_seq_len=1024, n_layer=12, n_head=12, d_model=768, d_ff=3072
)
GPT2_350M = GPTConfig(
    vocab_size=50304, max_seq_len=1024, n_layer=24, n_head=16, d_model=1024, d_ff=4096
)
# GPT-3 XL and 2.7B shapes (Brown et al. 2020, table 2.1), where every run is bound by the GPU.
GPT_1_3B = GPTConfig(
    vocab_size=50304, max_seq_len=2048, n_layer=24, n_head=16, d_model=2048, d_ff=8192
)
GPT_2_7B = GPTConfig(
    vocab_size=50304, max_seq_len=2048, n_layer=32, n_head=32, d_model=2560, d_ff=10240
)
PRESETS: dict[str, GPTConfig] = {
    "tiny": TINY,
    "small": SMALL,
    "gpt2-124m": GPT2_124M,
    "gpt2-350m": GPT2_350M,
    "gpt-1.3b": GPT_1_3B,
    "gpt-2.7b": GPT_2_7B,
}
