"""Flax GPT twin on ``jax_side`` kernels (the Torch twin is ``torch_side.models``).

``FlaxGPT`` (Linen) runs every linear layer through an injected ``jax_side.linear.LinearFn``:
``mxfp8_linear`` (the one JAX MXFP8 linear, also run by the bridge's Torch op) or the
``high_precision_linear`` control. ``GPTConfig`` is framework-free (``common.model_config``) and
shared with the Torch twin.
"""

from common.model_config import PRESETS, SMALL, TINY, GPTConfig
from common.modes import LinearMode
from jax_side.models.gpt import FlaxGPT, Linear, cross_entropy, flat_params, nested_params

__all__ = [
    "PRESETS",
    "SMALL",
    "TINY",
    "FlaxGPT",
    "GPTConfig",
    "Linear",
    "LinearMode",
    "cross_entropy",
    "flat_params",
    "nested_params",
]
