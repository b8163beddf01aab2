"""The Flax (Linen) GPT twin: same math and parameter names as ``models.torch_gpt.TorchGPT``.

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
``LinearMode``. The math between the linears (LayerNorm, attention, GELU, residuals, loss) is
``models.gpt_math``, the very functions the Torch model's unit programs run
(``bridge.units``). ``activations``: ``Activations.FP32`` (default; attention written out) or
``BF16`` (bf16 activations after the embeddings, fused attention, fp32 norm statistics and loss;
the Torch training path's twin).
"""

from __future__ import annotations

from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from common.kernels import KernelConfig
from common.model_config import GPTConfig
from common.modes import Activations, LinearMode
from jax_side.linear import LinearFn, linear_fn
from models import gpt_math as gm

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
    """``gpt_math.layer_norm`` with its ``weight`` (ones) and ``bias`` (zeros) parameters."""

    dim: int
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (self.dim,), _F32)
        bias = self.param("bias", nn.initializers.zeros, (self.dim,), _F32)
        return gm.layer_norm(x, weight, bias, self.eps)


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
    activations: Activations = Activations.FP32
    fused: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, d = self.cfg, self.cfg.d_model
        return gm.attention(
            cfg, self.activations, x,
            qkv=Linear(d, 3 * d, self.fn, cfg.init_std, name="qkv"),
            proj=Linear(d, d, self.fn, cfg.init_std, name="proj"),
            fused=self.fused,
        )


class MLP(nn.Module):
    cfg: GPTConfig
    fn: LinearFn

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        return gm.mlp(
            x,
            fc=Linear(cfg.d_model, cfg.d_ff, self.fn, cfg.init_std, name="fc"),
            proj=Linear(cfg.d_ff, cfg.d_model, self.fn, cfg.init_std, name="proj"),
        )


class Block(nn.Module):
    cfg: GPTConfig
    fn: LinearFn
    activations: Activations = Activations.FP32
    fused: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        return gm.block(
            x,
            ln_1=LayerNorm(cfg.d_model, cfg.ln_eps, name="ln_1"),
            attn=Attention(cfg, self.fn, self.activations, self.fused, name="attn"),
            ln_2=LayerNorm(cfg.d_model, cfg.ln_eps, name="ln_2"),
            mlp=MLP(cfg, self.fn, name="mlp"),
        )


class FlaxGPT(nn.Module):
    """tokens int32 (B, S), S <= max_seq_len -> logits (B, S, vocab_size) in the activation
    dtype (float32, or bfloat16 with ``Activations.BF16``)."""

    cfg: GPTConfig
    mode: LinearMode = LinearMode.MXFP8
    kernels: KernelConfig | None = None  # None: the device default (jax_side.mxfp8.kernel_report)
    activations: Activations = Activations.FP32
    # bf16 attention through cuDNN; None: where JAX's default backend is a GPU
    fused_attention: bool | None = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, s = tokens.shape
        if s > cfg.max_seq_len:
            raise ValueError(
                f"FlaxGPT: sequence length {s} exceeds max_seq_len={cfg.max_seq_len}; "
                f"truncate the batch or build a config with a larger max_seq_len"
            )
        acts = Activations.parse(self.activations)
        fn = linear_fn(self.mode, self.kernels)
        x = Embedding(cfg.vocab_size, cfg.d_model, cfg.init_std, name="wte")(tokens)  # (B, S, D)
        x = x + Embedding(cfg.max_seq_len, cfg.d_model, cfg.init_std, name="wpe")(jnp.arange(s))
        if acts is Activations.BF16:
            x = x.astype(jnp.bfloat16)
        fused = self.fused_attention
        if fused is None:
            fused = jax.default_backend() == "gpu"
        for i in range(cfg.n_layer):
            x = Block(cfg, fn, acts, fused, name=f"h_{i}")(x)
        x = LayerNorm(cfg.d_model, cfg.ln_eps, name="ln_f")(x)
        logits = Linear(cfg.d_model, cfg.vocab_size, fn, cfg.init_std, name="lm_head")(x)
        self.sow("intermediates", "logits", logits)
        return logits


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy, fp32 scalar. logits (B, S, V) (bf16 widened first), targets
    int (B, S) (``gpt_math.cross_entropy``)."""
    return gm.cross_entropy(logits, targets)


def flat_params(params: Mapping) -> dict[str, jax.Array]:
    """Nested Linen params -> {"h_0.attn.qkv.weight": array, ...} (the Torch state_dict names)."""
    return {".".join(k): v for k, v in flatten_dict(dict(params)).items()}


def nested_params(flat: Mapping[str, object]) -> dict:
    """Inverse of ``flat_params``: Torch-style names -> nested Linen params (leaves kept as-is)."""
    return unflatten_dict({tuple(k.split(".")): v for k, v in flat.items()})
