"""The GPT math, written once: the Flax twin's modules and the Torch model's unit programs run it.

Pure functions of arrays and callables (no Linen, no parameters of their own):

- ``layer_norm``: ``(x - mean) / sqrt(var + eps) * weight + bias``, biased variance, statistics
  and affine in fp32; the result in x's dtype (a no-op cast for fp32 activations);
- ``attention``: causal multi-head self-attention around two linears (``qkv``, ``proj``):
  written out in fp32, or, for bf16 activations on a GPU (``fused``), cuDNN flash attention
  (``jax.nn.dot_product_attention``);
- ``mlp``: ``proj(gelu_tanh(fc(x)))``, GELU evaluated in fp32 and rounded once to x's dtype;
- ``block``: the pre-norm residual block ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``;
- ``head_loss``: final norm, LM head and the mean token cross-entropy (fp32) in one function.

Memory: LayerNorm and GELU are ``jax.checkpoint``-ed: their backward keeps only their inputs (in
the activation dtype) and recomputes the fp32 intermediates, which would otherwise be kept in
fp32 (GPT-2 124M, 8 x 1024 tokens: 2.4 GB of GELU residuals); the loss (``cross_entropy``, a
``custom_vjp``) keeps only the logits and recomputes the rest in one pass (1.6 GB of
log-softmax residuals otherwise).

A linear is any callable ``(..., in) -> (..., out)``: a Linen ``Linear`` in the Flax twin, an
MXFP8 linear on FSDP's planes in a unit program (``jax_side.unit_program``). Activations enter in
the model's activation dtype (fp32 or bf16) and every function returns that dtype.

``GPTBlockFn`` and ``GPTHeadFn`` are the block and the head as hashable callables of
``(params, linear, x, *aux)`` -- the form a unit program takes (equal configs compare equal, so
every block of a model shares one compiled program).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from common.model_config import GPTConfig
from common.modes import Activations

__all__ = [
    "GPTBlockFn",
    "GPTHeadFn",
    "attention",
    "block",
    "cross_entropy",
    "cross_entropy_reference",
    "gelu_tanh",
    "head_loss",
    "layer_norm",
    "mlp",
]

_F32 = jnp.float32
Fn = Callable[[jax.Array], jax.Array]


@functools.partial(jax.checkpoint, static_argnums=(3,))
def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """x (..., D) -> (..., D) in x's dtype; statistics and affine in fp32 (module docstring)."""
    xf = x.astype(_F32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    out = (xf - mean) * jax.lax.rsqrt(var + jnp.float32(eps)) * weight.astype(_F32)
    return (out + bias.astype(_F32)).astype(x.dtype)


def attention(cfg: GPTConfig, acts: Activations, x: jax.Array, *,
              qkv: Callable[[jax.Array], Any], proj: Fn,
              fused: bool = False) -> jax.Array:
    """Causal self-attention. x (B, S, D) -> (B, S, D) in x's dtype.

    ``qkv(x)``: (B, S, 3D), split here into q, k and v, or those three (B, S, D) already (a unit
    program's linear with ``parts=3``: no cut-out copies).
    fused (bf16 activations on a GPU): cuDNN flash attention (``jax.nn.dot_product_attention``,
    implementation "cudnn"). Otherwise written out in fp32 (q, k, v widened first), the result
    rounded once to x's dtype."""
    b, s, d = x.shape
    h, hd = cfg.n_head, cfg.head_dim
    out = qkv(x)
    q, k, v = out if isinstance(out, tuple) else jnp.split(out, 3, axis=-1)  # 3 x (B, S, D)
    if fused and acts is Activations.BF16:
        q, k, v = (t.reshape(b, s, h, hd) for t in (q, k, v))  # (B, S, H, hd)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return proj(out.reshape(b, s, d))  # (B, S, D)
    q, k, v = (t.astype(_F32).reshape(b, s, h, hd).transpose(0, 2, 1, 3) for t in (q, k, v))
    att = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * jnp.float32(hd**-0.5)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    att = jnp.where(causal, att, jnp.float32(-jnp.inf))
    att = jax.nn.softmax(att, axis=-1)  # (B, H, S, S)
    out = jnp.einsum("bhqk,bhkd->bhqd", att, v, precision="highest")  # (B, H, S, hd)
    return proj(out.transpose(0, 2, 1, 3).reshape(b, s, d).astype(x.dtype))  # (B, S, D)


def gelu_tanh(hid: jax.Array) -> jax.Array:
    """The MLP's GELU (tanh approximation) in fp32, rounded once to ``hid``'s dtype;
    elementwise, so a unit program's linear can apply it inside its quantize of x
    (``linear(name, h, pre=gelu_tanh)``)."""
    return jax.nn.gelu(hid.astype(_F32), approximate=True).astype(hid.dtype)


_gelu = jax.checkpoint(gelu_tanh)


def mlp(x: jax.Array, *, fc: Fn, proj: Fn, gelu_in_proj: bool = False,
        gelu_in_fc: bool = False) -> jax.Array:
    """x (B, S, D) -> (B, S, D); the GELU (tanh) in fp32, rounded once to x's dtype.
    ``gelu_in_proj``: ``proj`` takes the GELU's input and applies ``gelu_tanh`` itself (a unit
    program's ``linear(name, h, pre=gelu_tanh)``), with the values of ``proj(_gelu(h))``.
    ``gelu_in_fc``: ``fc`` returns the GELU's output itself (a unit program's ``linear(name, x,
    post="gelu_tanh")``: in the GEMM's epilogue, from its fp32 accumulator, where it can)."""
    if gelu_in_proj and gelu_in_fc:
        raise ValueError("mlp: the GELU goes in one linear: gelu_in_proj or gelu_in_fc, not both")
    hid = fc(x)  # (B, S, F)
    return proj(hid) if gelu_in_proj or gelu_in_fc else proj(_gelu(hid))


def block(x: jax.Array, *, ln_1: Fn, attn: Fn, ln_2: Fn, mlp: Fn) -> jax.Array:
    """The pre-norm residual block."""
    x = x + attn(ln_1(x))
    return x + mlp(ln_2(x))


@jax.checkpoint
def cross_entropy_reference(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy, fp32 scalar, by autodiff: ``-mean(log_softmax(logits)
    [target])``, logits (B, S, V) widened to fp32 first, targets int (B, S); checkpointed (its
    backward recomputes the fp32 intermediates). ``cross_entropy`` returns its bytes, forward
    and backward (``tests/models/test_gpt_math.py``)."""
    logp = jax.nn.log_softmax(logits.astype(_F32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return -jnp.mean(picked)


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy, fp32 scalar (``cross_entropy_reference``'s bytes). Its backward
    keeps only the logits (in their own dtype) and writes d logits in one elementwise pass,
    ``onehot(target) * c + exp(shifted) * (-c / sum exp(shifted))`` with c = -g / N, the target
    found by comparing an iota: autodiff's version scatters into an fp32 zero array of the
    logits' shape first (1.6 GB at 8 x 1024 tokens of a 50k vocabulary) and reads it back.
    ``targets`` must have the logits' shape without the vocabulary axis (no broadcasting)."""
    _check_targets(logits, targets)
    return cross_entropy_reference(logits, targets)


def _check_targets(logits: jax.Array, targets: jax.Array) -> None:
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"cross_entropy: targets {tuple(targets.shape)} must have the logits' "
                         f"shape {tuple(logits.shape)} without the vocabulary axis, i.e. "
                         f"{tuple(logits.shape[:-1])}; reshape or broadcast them first")


def _cross_entropy_fwd(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, tuple]:
    _check_targets(logits, targets)
    return cross_entropy_reference(logits, targets), (logits, targets)


def _cross_entropy_bwd(res: tuple, g: jax.Array) -> tuple[jax.Array, None]:
    # The barrier keeps this recomputation apart from the forward's in a program holding both
    # (the Flax twin's whole-model gradient), as jax.checkpoint's does: otherwise XLA shares
    # exp and the sum with the forward's fusions there and not in a unit program's backward,
    # and the two differ in the last bit.
    logits, targets = jax.lax.optimization_barrier(res)
    z = logits.astype(_F32)
    shifted = z - jnp.max(z, axis=-1, initial=-jnp.inf, keepdims=True)
    e = jnp.exp(shifted)
    # autodiff's cotangents, in its order: -mean -> c at each target (take_along_axis wraps a
    # negative target once and drops one out of range); log_softmax's "- log(sum)" -> -c, / sum
    c = jax.lax.div(-g, jnp.asarray(targets.size, _F32))
    v = z.shape[-1]
    t = targets.astype(jnp.int32)
    t = jnp.where(t < 0, t + v, t)[..., None]
    onehot = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == t
    ct_lse = jnp.where((t >= 0) & (t < v), -c, jnp.zeros((), _F32))
    ct_s = ct_lse / jnp.sum(e, axis=-1, keepdims=True)
    dz = jnp.where(onehot, c, jnp.zeros((), _F32)) + ct_s * e
    return dz.astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def head_loss(x: jax.Array, targets: jax.Array, *, ln_f: Fn, lm_head: Fn) -> jax.Array:
    """Final norm, LM head, loss: x (B, S, D), targets int (B, S) -> fp32 scalar."""
    return cross_entropy(lm_head(ln_f(x)), targets)


# (the block-relative layer name, x) -> y; GPTBlockFn also calls linear(name, x, parts=3) for
# the qkv linear: y's three column parts, and linear(name, x, pre=gelu_tanh) for the MLP's second
# linear: the linear of gelu_tanh(x) (jax_side.unit_program's linear)
Linear = Callable[..., Any]


# GPTBlockFn asks its qkv linear for q, k and v as three parts (read when a block is traced;
# benchmarks.bench_train_step's ':qkv1' runs switch it off to compare one GEMM and a split)
QKV_PARTS = True
# GPTBlockFn hands the MLP's second linear the GELU's input and the GELU as its ``pre`` (read
# when a block is traced). Off: on the H200 the kernels with the GELU inside were slower than
# XLA's GELU pass and the plain kernels together (BENCHMARKS.md, session 14); bench_train_step's
# ':gelu-in' runs switch it on
GELU_IN_LINEAR = False
# GPTBlockFn asks the MLP's first linear for the GELU of its output (``linear("mlp.fc", h,
# post="gelu_tanh")``: cuBLASLt's GELU_AUX epilogue with the fp8_blocked GEMM, one pass writing
# the GELU's output and input; elsewhere the same checkpointed GELU as off, the same bytes).
# On: the 1.3B step's GPU time fell 0.2 ms on an H100 and 1.3 ms on an H200 (BENCHMARKS.md,
# session 20). GELU_IN_LINEAR, when on, takes precedence. Read when a block is traced;
# bench_train_step's ':gelu-apart' runs switch it off.
GELU_IN_GEMM = True


def _linear(linear: Linear, name: str) -> Fn:
    return lambda h: linear(name, h)


def _qkv(linear: Linear) -> Callable[[jax.Array], Any]:
    if QKV_PARTS:
        return lambda h: linear("attn.qkv", h, parts=3)
    return _linear(linear, "attn.qkv")


def _gelu_in_fc() -> bool:
    """Whether the MLP's first linear applies the GELU (``GELU_IN_GEMM``, unless
    ``GELU_IN_LINEAR`` puts it in the second)."""
    return GELU_IN_GEMM and not GELU_IN_LINEAR


def _fc(linear: Linear) -> Fn:
    if _gelu_in_fc():
        return lambda h: linear("mlp.fc", h, post="gelu_tanh")
    return _linear(linear, "mlp.fc")


def _proj(linear: Linear) -> Fn:
    if GELU_IN_LINEAR:
        return lambda h: linear("mlp.proj", h, pre=gelu_tanh)
    return _linear(linear, "mlp.proj")


def _norm(params: Mapping[str, jax.Array], name: str, eps: float) -> Fn:
    return lambda h: layer_norm(h, params[f"{name}.weight"], params[f"{name}.bias"], eps)


@dataclasses.dataclass(frozen=True)
class GPTBlockFn:
    """``fn(params, linear, x) -> x``: one GPT block (``models.torch_gpt.Block``), with
    ``params`` its LayerNorm parameters by block-relative name (``ln_1.weight``, ...) and
    ``linear(name, h)`` its four linears (``attn.qkv``, ``attn.proj``, ``mlp.fc``,
    ``mlp.proj``; the qkv one as ``linear("attn.qkv", h, parts=3)``: q, k and v; the MLP's
    second as ``linear("mlp.proj", h, pre=gelu_tanh)``: the GELU applied by the linear, or its
    first as ``linear("mlp.fc", h, post="gelu_tanh")``: the GELU of its output, the default;
    ``GELU_IN_LINEAR`` takes precedence)."""

    cfg: GPTConfig
    activations: Activations
    fused_attention: bool = False  # cuDNN attention (bf16 activations on a GPU)
    # its linears run under no transformation of their own (jax_side.unit_program._deferrable)
    linears_at_top: ClassVar[bool] = True

    def __call__(
        self, params: Mapping[str, jax.Array], linear: Linear, x: jax.Array
    ) -> jax.Array:
        cfg, acts = self.cfg, self.activations
        return block(
            x,
            ln_1=_norm(params, "ln_1", cfg.ln_eps),
            attn=lambda h: attention(cfg, acts, h, qkv=_qkv(linear),
                                     proj=_linear(linear, "attn.proj"),
                                     fused=self.fused_attention),
            ln_2=_norm(params, "ln_2", cfg.ln_eps),
            mlp=lambda h: mlp(h, fc=_fc(linear), proj=_proj(linear),
                              gelu_in_proj=GELU_IN_LINEAR,
                              gelu_in_fc=_gelu_in_fc()),
        )


@dataclasses.dataclass(frozen=True)
class GPTHeadFn:
    """``fn(params, linear, x, targets) -> loss``: the GPT's final norm (``ln_f.weight``,
    ``ln_f.bias``), LM head (``lm_head``) and loss."""

    cfg: GPTConfig
    linears_at_top: ClassVar[bool] = True  # (as GPTBlockFn's)

    def __call__(self, params: Mapping[str, jax.Array], linear: Linear, x: jax.Array,
                 targets: jax.Array) -> jax.Array:
        return head_loss(x, targets, ln_f=_norm(params, "ln_f", self.cfg.ln_eps),
                         lm_head=_linear(linear, "lm_head"))
