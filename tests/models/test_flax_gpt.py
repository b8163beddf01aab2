"""FlaxGPT: parameter names and shapes, config validation, and running on external MXFP8 planes
(the ``mxfp8`` collection) exactly as on self-quantized weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.model_config import GPTConfig
from common.modes import LinearMode
from jax_side.linear import quantize_weight
from models.flax_gpt import FlaxGPT, cross_entropy, flat_params, nested_params

CFG = GPTConfig(vocab_size=64, max_seq_len=64, n_layer=2, n_head=2, d_model=64, d_ff=64)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 20)), jnp.int32)


@pytest.fixture(scope="module")
def params():
    return jax.jit(FlaxGPT(CFG, LinearMode.HIGH_PRECISION).init)(jax.random.key(0), TOKENS)[
        "params"
    ]


def test_parameter_names_and_shapes(params):
    flat = flat_params(params)
    linear = CFG.linear_shapes()
    others = {"wte.weight": (64, 64), "wpe.weight": (64, 64), "ln_f.weight": (64,),
              "ln_f.bias": (64,)}
    for i in range(CFG.n_layer):
        for ln in ("ln_1", "ln_2"):
            others |= {f"h_{i}.{ln}.weight": (64,), f"h_{i}.{ln}.bias": (64,)}
    assert {n: a.shape for n, a in flat.items()} == {**linear, **others}
    assert all(a.dtype == jnp.float32 for a in flat.values())
    assert flat_params(nested_params(flat)).keys() == flat.keys()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"vocab_size": 100}, "vocab_size=100.*use 128"), ({"d_ff": 48}, "d_ff=48"),
     ({"n_head": 3}, "divisible by n_head=3"), ({"n_layer": 0}, "n_layer=0")],
)
def test_config_rejects_shapes_mxfp8_cannot_block(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**CFG.__dict__, **kwargs})


def test_sequence_longer_than_max_is_refused(params):
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        FlaxGPT(CFG).apply({"params": params}, jnp.zeros((1, 65), jnp.int32))


def _loss_and_grads(params, planes=None):
    model = FlaxGPT(CFG, LinearMode.MXFP8)

    def loss(p):
        variables = {"params": p} | ({} if planes is None else {"mxfp8": planes})
        logits = model.apply(variables, TOKENS)
        return cross_entropy(logits, TOKENS), logits

    return jax.value_and_grad(loss, has_aux=True)(params)


def test_external_planes_give_the_same_bytes_and_the_weights_become_grad_slots(params):
    """Feeding each layer the planes of bf16(weight) (as FSDP would) changes no byte of the
    logits or of any gradient (gradients: on CPU; on GPU to 1e-6 of their max, see below), even
    when the linear weights are replaced by zero slots."""
    flat = flat_params(params)
    linear = CFG.linear_shapes()
    planes = nested_params({n: quantize_weight(flat[n]) for n in linear})
    slots = nested_params({n: (jnp.zeros_like(a) if n in linear else a) for n, a in flat.items()})
    (l_own, logits_own), g_own = _loss_and_grads(params)
    (l_ext, logits_ext), g_ext = _loss_and_grads(slots, planes)
    np.testing.assert_array_equal(np.asarray(logits_own).view(np.uint32),
                                  np.asarray(logits_ext).view(np.uint32))
    assert float(l_own) == float(l_ext)
    on_gpu = jax.devices()[0].platform == "gpu"
    for n, g in flat_params(g_own).items():
        got, want = np.asarray(flat_params(g_ext)[n]), np.asarray(g)
        if on_gpu:
            # Seen on the H200 (jax 0.11.2): the two programs' embedding gradients (a scatter-add,
            # atomics on GPU) differed by up to 8 ulp in 27/4096 elements; the two programs are
            # compiled separately, so reduction order is not pinned there. Bytes are pinned on CPU.
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max(),
                                       err_msg=n)
        else:
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=n)


def test_mxfp8_stays_close_to_the_high_precision_control(params):
    """E4M3 keeps 3 mantissa bits (relative rounding error <= 2^-4 per element); in dot products
    the errors average out, so logits stay within a few percent of the control's."""
    hp = FlaxGPT(CFG, LinearMode.HIGH_PRECISION).apply({"params": params}, TOKENS)
    mx = FlaxGPT(CFG, LinearMode.MXFP8).apply({"params": params}, TOKENS)
    err = float(jnp.max(jnp.abs(hp - mx)) / jnp.max(jnp.abs(hp)))
    assert 0 < err < 0.1


def test_flax_linear_refuses_a_float64_checkpoint_weight():
    """A float64 (numpy) weight is refused, not narrowed to fp32 before its bf16 / E4M3
    quantization (a double rounding) when x64 is off."""
    from jax_side.linear import linear_fn
    from models.flax_gpt import Linear

    layer = Linear(64, 96, linear_fn("mxfp8"), 0.02)
    x = jnp.ones((32, 64), jnp.float32)
    with pytest.raises(TypeError, match=r"weight has dtype float64, expected float32 or bfloat16"):
        layer.apply({"params": {"weight": np.ones((96, 64))}}, x)
    y = layer.apply({"params": {"weight": np.ones((96, 64), np.float32)}}, x)
    assert y.shape == (32, 96)
