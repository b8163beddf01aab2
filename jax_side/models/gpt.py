"""The Flax (Linen) GPT twin: same math and parameter names as ``torch_side.models.TorchGPT``.

Why Linen (not NNX): the parity and FSDP use case hands the model weights it does not own -- the
planes FSDP all-gathered into Torch buckets, imported zero-copy -- and they change every step.
Linen's ``model.apply(variables, tokens)`` takes exactly such an explicit pytree and uses its
leaves as-is, and ``jax.grad`` over the ``params`` collection gives per-parameter gradients with
no graph split/merge. NNX would hold the arrays in mutable ``Variable`` objects that must be
rebuilt (``nnx.merge``) from each step's buffers.

Variables (collections of ``apply``):
- ``params``: float32, Torch names with "/" for "." (``flat_params``): ``wte/weight`` (V, D),
  ``wpe/weight`` (S, D), ``h_<i>/{ln_1,ln_2}/{weight,bias}`` (D,), ``h_<i>/attn/qkv/weight``
  (3D, D), ``h_<i>/attn/proj/weight`` (D, D), ``h_<i>/mlp/fc/weight`` (F, D),
  ``h_<i>/mlp/proj/weight`` (D, F), ``ln_f/{weight,bias}`` (D,), ``lm_head/weight`` (V, D).
- ``mxfp8`` (optional): per linear, ``<path>/weight`` an ``MXFP8Tensor`` (both planes) of that
  weight. When present, the layer multiplies with these planes as-is and the param of the same
  name is only the slot that receives dW (its values are not read). When absent, each MXFP8 layer
  quantizes ``bf16(param)`` itself, exactly like the Torch op without FSDP planes.
- ``intermediates`` (output, with ``mutable=["intermediates"]``): each linear's ``input``
  (T, in) and ``output`` (T, out), and ``logits``.
- ``perturbations`` (optional input): per linear, ``<path>/dy`` zeros (T, out); its gradient is
  the layer's output gradient dy (Linen ``perturb``).

Every linear runs through an injected ``LinearFn`` (``jax_side.linear``, the same JAX linear the
Torch op runs): MXFP8 with the model's ``KernelConfig``, or the high-precision control, chosen by
``LinearMode``. Activations are float32.
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from common.kernels import KernelConfig
from common.model_config import GPTConfig
from common.modes import LinearMode
from jax_side.linear import LinearFn, linear_fn

__all__ = [
    "FlaxGPT",
    "Linear",
    "cross_entropy",
    "flat_params",
    "nested_params",
]

_F32 = jnp.float32


class Linear(nn.Module):
    """``y = x W^T`` through an injected ``LinearFn``; weight (out, in), no bias.

    x: (..., in) float32 -> (..., out) float32. Sows ``input``/``output`` as (T, C) intermediates.
    """

    features_in: int
    features_out: int
    fn: LinearFn
    init_std: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param(
            "weight",
            nn.initializers.normal(self.init_std),
            (self.features_out, self.features_in),
            _F32,
        )
        planes = None
        if self.has_variable("mxfp8", "weight"):
            planes = self.get_variable("mxfp8", "weight")  # MXFP8Tensor, used as-is
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.features_in)  # (T, in), T = prod(lead)
        self.sow("intermediates", "input", x2)
        y2 = self.fn(x2, weight, planes)  # (T, out)
        self.sow("intermediates", "output", y2)
        y2 = self.perturb("dy", y2)  # no-op unless a "perturbations" collection is passed
        return y2.reshape(*lead, self.features_out)  # (..., out)


class LayerNorm(nn.Module):
    """Written out (not ``nn.LayerNorm``) so both twins evaluate the same formula:
    ``(x - mean) / sqrt(var + eps) * weight + bias``, biased variance over the last axis."""

    dim: int
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (self.dim,), _F32)
        bias = self.param("bias", nn.initializers.zeros, (self.dim,), _F32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + jnp.float32(self.eps)) * weight + bias


class Embedding(nn.Module):
    num: int
    dim: int
    init_std: float

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        init = nn.initializers.normal(self.init_std)
        weight = self.param("weight", init, (self.num, self.dim), _F32)
        return jnp.take(weight, ids, axis=0)


class Attention(nn.Module):
    cfg: GPTConfig
    fn: LinearFn

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, s, d = x.shape
        h, hd = cfg.n_head, cfg.head_dim
        qkv = Linear(d, 3 * d, self.fn, cfg.init_std, name="qkv")(x)  # (B, S, 3D)
        q, k, v = jnp.split(qkv, 3, axis=-1)  # 3 x (B, S, D)
        q, k, v = (t.reshape(b, s, h, hd).transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, H, S, hd)
        att = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * jnp.float32(hd**-0.5)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        att = jnp.where(causal, att, jnp.float32(-jnp.inf))
        att = jax.nn.softmax(att, axis=-1)  # (B, H, S, S)
        out = jnp.einsum("bhqk,bhkd->bhqd", att, v, precision="highest")  # (B, H, S, hd)
        out = out.transpose(0, 2, 1, 3).reshape(b, s, d)  # (B, S, D)
        return Linear(d, d, self.fn, cfg.init_std, name="proj")(out)


class MLP(nn.Module):
    cfg: GPTConfig
    fn: LinearFn

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        hid = Linear(cfg.d_model, cfg.d_ff, self.fn, cfg.init_std, name="fc")(x)  # (B, S, F)
        hid = jax.nn.gelu(hid, approximate=True)
        return Linear(cfg.d_ff, cfg.d_model, self.fn, cfg.init_std, name="proj")(hid)


class Block(nn.Module):
    cfg: GPTConfig
    fn: LinearFn

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = x + Attention(cfg, self.fn, name="attn")(
            LayerNorm(cfg.d_model, cfg.ln_eps, name="ln_1")(x)
        )
        return x + MLP(cfg, self.fn, name="mlp")(
            LayerNorm(cfg.d_model, cfg.ln_eps, name="ln_2")(x)
        )


class FlaxGPT(nn.Module):
    """tokens int32 (B, S), S <= max_seq_len -> logits float32 (B, S, vocab_size)."""

    cfg: GPTConfig
    mode: LinearMode = LinearMode.MXFP8
    kernels: KernelConfig | None = None  # None: the device default (jax_side.mxfp8.kernel_report)

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, s = tokens.shape
        if s > cfg.max_seq_len:
            raise ValueError(
                f"FlaxGPT: sequence length {s} exceeds max_seq_len={cfg.max_seq_len}; "
                f"truncate the batch or build a config with a larger max_seq_len"
            )
        fn = linear_fn(self.mode, self.kernels)
        x = Embedding(cfg.vocab_size, cfg.d_model, cfg.init_std, name="wte")(tokens)  # (B, S, D)
        x = x + Embedding(cfg.max_seq_len, cfg.d_model, cfg.init_std, name="wpe")(jnp.arange(s))
        for i in range(cfg.n_layer):
            x = Block(cfg, fn, name=f"h_{i}")(x)
        x = LayerNorm(cfg.d_model, cfg.ln_eps, name="ln_f")(x)
        logits = Linear(cfg.d_model, cfg.vocab_size, fn, cfg.init_std, name="lm_head")(x)
        self.sow("intermediates", "logits", logits)
        return logits


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy, fp32 scalar. logits (B, S, V) float32, targets int (B, S)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # (B, S)
    return -jnp.mean(picked)


def flat_params(params: Mapping) -> dict[str, jax.Array]:
    """Nested Linen params -> {"h_0.attn.qkv.weight": array, ...} (the Torch state_dict names)."""
    return {".".join(k): v for k, v in flatten_dict(dict(params)).items()}


def nested_params(flat: Mapping[str, object]) -> dict:
    """Inverse of ``flat_params``: Torch-style names -> nested Linen params (leaves kept as-is)."""
    return unflatten_dict({tuple(k.split(".")): v for k, v in flat.items()})
