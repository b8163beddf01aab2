"""One MXFP8 block-shape rule (``common.formats.check_mxfp8_shape``): every layer that takes an
MXFP8 tensor accepts and refuses the same shapes, empty dimensions included (refused)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge import TorchMXFP8Tensor, mxfp8_linear
from common.formats import Plane, scale_shape
from jax_side.mxfp8 import MXFP8Tensor, quantize
from torch_side.fsdp.distributed_quantize import distributed_mxfp8_quantize

SHAPES = {  # shape -> accepted
    (0, 32): False,
    (32, 0): False,
    (32, 32): True,
    (31, 32): False,
    (32, 33): False,
    (64, 96): True,
    (32,): False,
    (2, 32, 32): False,
}


def _planes_shape(shape):
    """Shapes of one plane's data and scale; for a non-2-D shape, any stand-in (the shape check
    comes first)."""
    if len(shape) != 2:
        return (32, 32), (32, 1)
    return shape, scale_shape(shape, Plane.ROWWISE)


def _torch_tensor(shape):
    data, scale = _planes_shape(shape)
    u8 = torch.uint8
    planes = {Plane.ROWWISE: (torch.zeros(data, dtype=u8), torch.zeros(scale, dtype=u8))}
    TorchMXFP8Tensor(planes, shape, torch.bfloat16)


def _jax_tensor(shape):
    data, scale = _planes_shape(shape)
    planes = {
        Plane.ROWWISE: (jnp.zeros(data, jnp.float8_e4m3fn), jnp.zeros(scale, jnp.float8_e8m0fnu))
    }
    MXFP8Tensor(planes, shape, np.dtype(jnp.bfloat16))


def _quantize(shape):
    quantize(jnp.zeros(shape, jnp.bfloat16))


def _linear(shape):
    k = shape[-1] if shape else 32
    mxfp8_linear(torch.zeros(4, k), torch.zeros(shape))


def _distributed_quantize(shape):
    n = int(np.prod(shape))
    distributed_mxfp8_quantize([torch.zeros(n)], [shape], [0])


LAYERS = {
    "torch_tensor": _torch_tensor,
    "jax_tensor": _jax_tensor,
    "quantize": _quantize,
    "linear": _linear,
    "distributed_quantize": _distributed_quantize,
}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_layer_gives_the_same_answer(layer, shape):
    if SHAPES[shape]:
        LAYERS[layer](shape)
    else:
        with pytest.raises(ValueError, match=r"MXFP8 needs (a 2-D|M % 32 == 0)"):
            LAYERS[layer](shape)
