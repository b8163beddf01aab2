"""Flax GPT twin on ``jax_side.mxfp8`` kernels (the Torch twin is ``torch_side.models``).

``FlaxGPT`` (Linen) runs every linear layer through an injected ``LinearFn``: ``mxfp8_linear``
(MXFP8 GEMMs with the bridge op's quantization points, ``jax.custom_vjp``) or the
``high_precision_linear`` control. ``GPTConfig`` is framework-free and shared with the Torch twin.
"""

from jax_side.models.config import PRESETS, SMALL, TINY, GPTConfig, MatmulMode
from jax_side.models.gpt import FlaxGPT, Linear, cross_entropy, flat_params, nested_params
from jax_side.models.linear import (
    LinearFn,
    high_precision_linear,
    linear_fn,
    mxfp8_linear,
    pad_tokens,
    quantize_activation,
    quantize_weight,
)

__all__ = [
    "PRESETS",
    "SMALL",
    "TINY",
    "FlaxGPT",
    "GPTConfig",
    "Linear",
    "LinearFn",
    "MatmulMode",
    "cross_entropy",
    "flat_params",
    "high_precision_linear",
    "linear_fn",
    "mxfp8_linear",
    "nested_params",
    "pad_tokens",
    "quantize_activation",
    "quantize_weight",
]
