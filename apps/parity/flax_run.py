"""The Flax side of the parity report: a deterministic batch, the Flax checkpoint of a seed, and
one forward + backward of ``FlaxGPT`` with every tensor the report compares (no torch here).

``run_flax`` runs the model eagerly: the MXFP8 linears are jitted per shape inside
``jax_side.linear``, so layers of equal shape share compiled code (a whole-model jit would
compile every layer anew).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from common.kernels import KernelConfig
from common.model_config import GPTConfig
from common.modes import LinearMode
from jax_side.linear import quantize_weight
from jax_side.mxfp8 import MXFP8Tensor
from models.flax_gpt import FlaxGPT, cross_entropy, flat_params, nested_params

__all__ = [
    "Batch",
    "FlaxRun",
    "check_batch",
    "init_flax_params",
    "linear_names",
    "make_batch",
    "run_flax",
]


class Batch(NamedTuple):
    tokens: np.ndarray  # int32 (B, S)
    targets: np.ndarray  # int32 (B, S): the next token of the same random stream


def make_batch(cfg: GPTConfig, seed: int, batch_size: int, seq_len: int) -> Batch:
    """A deterministic random token batch; seq_len <= cfg.max_seq_len, any B * S (not only x32)."""
    if not 1 <= seq_len <= cfg.max_seq_len or batch_size < 1:
        raise ValueError(
            f"make_batch: need 1 <= seq_len <= max_seq_len={cfg.max_seq_len} and batch_size >= "
            f"1, got seq_len={seq_len}, batch_size={batch_size}"
        )
    stream = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch_size, seq_len + 1))
    stream = stream.astype(np.int32)
    return Batch(stream[:, :-1].copy(), stream[:, 1:].copy())


def check_batch(cfg: GPTConfig, batch: Iterable[np.ndarray | jax.Array]) -> Batch:
    tokens, targets = (np.asarray(a) for a in batch)
    if tokens.shape != targets.shape or tokens.ndim != 2 or tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(
            f"parity batch: tokens {tokens.shape} and targets {targets.shape} must both be "
            f"(B, S) with S <= max_seq_len={cfg.max_seq_len}"
        )
    for what, a in (("tokens", tokens), ("targets", targets)):
        if a.size and (a.min() < 0 or a.max() >= cfg.vocab_size):
            raise ValueError(f"parity batch: {what} must lie in [0, {cfg.vocab_size})")
    return Batch(tokens.astype(np.int32), targets.astype(np.int32))


@functools.lru_cache(maxsize=8)
def _init_fn(cfg: GPTConfig) -> Callable[..., Any]:
    return jax.jit(FlaxGPT(cfg, LinearMode.HIGH_PRECISION).init)


def init_flax_params(cfg: GPTConfig, seed: int) -> dict:
    """Nested float32 Linen params of ``FlaxGPT(cfg)`` from ``jax.random.key(seed)``."""
    tokens = jnp.zeros((1, min(cfg.max_seq_len, 32)), jnp.int32)
    return _init_fn(cfg)(jax.random.key(seed), tokens)["params"]


class FlaxRun(NamedTuple):
    logits: jax.Array  # (B, S, V) float32
    loss: jax.Array  # () float32
    linear_io: dict[str, tuple[jax.Array, jax.Array, jax.Array]]  # name -> x, y, dy (T, C)
    grads: dict[str, jax.Array]  # Torch-style parameter names
    # MXFP8 mode: the planes each linear multiplied with -- the given planes, or bf16(weight)
    # requantized by the layer's own (jitted, deterministic) quantize_weight
    weight_q: dict[str, MXFP8Tensor]


def linear_names(cfg: GPTConfig) -> list[str]:
    return [n.rsplit(".", 1)[0] for n in cfg.linear_shapes()]


@functools.lru_cache(maxsize=16)
def _flax_step_fn(
    cfg: GPTConfig, mode: LinearMode, batch_shape: tuple[int, int], kernels: KernelConfig | None
) -> Callable[..., Any]:
    """The forward + backward with capture, built once per (config, mode, batch shape).

    Runs eagerly: the MXFP8 linears are jitted per shape inside ``jax_side.linear``, so
    layers of equal shape share compiled code (a whole-model jit compiles every layer anew).
    """
    model = FlaxGPT(cfg, mode, kernels)
    tokens_n = batch_shape[0] * batch_shape[1]
    names = linear_names(cfg)

    def loss_fn(params, perturb, planes, tokens, targets):
        variables = {"params": params, "perturbations": perturb}
        if planes is not None:
            variables["mxfp8"] = planes
        logits, state = model.apply(variables, tokens, mutable=["intermediates"])
        return cross_entropy(logits, targets), (logits, state["intermediates"])

    def step(params, planes, tokens, targets):
        shapes = cfg.linear_shapes()
        perturb = nested_params(
            {f"{n}.dy": jnp.zeros((tokens_n, shapes[n + ".weight"][0]), jnp.float32) for n in names}
        )
        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
        (loss, (logits, inter)), (g_params, g_perturb) = grad_fn(
            params, perturb, planes, tokens, targets
        )
        flat_inter, flat_dy = flat_params(inter), flat_params(g_perturb)
        io = {
            n: (flat_inter[f"{n}.input"][0], flat_inter[f"{n}.output"][0], flat_dy[f"{n}.dy"])
            for n in names
        }
        weight_q = {}
        if mode is LinearMode.MXFP8:
            flat_w, flat_planes = flat_params(params), flat_params(planes or {})
            for n in (n + ".weight" for n in names):
                given = flat_planes.get(n)
                weight_q[n] = (
                    quantize_weight(flat_w[n], kernels=kernels) if given is None else given
                )
        return logits, loss, io, flat_params(g_params), weight_q

    return step


def run_flax(
    cfg: GPTConfig,
    mode: LinearMode,
    params: Mapping,
    tokens: np.ndarray,
    targets: np.ndarray,
    planes: Mapping | None = None,
    kernels: KernelConfig | None = None,
) -> FlaxRun:
    """Forward + backward of FlaxGPT on ``params`` (used as-is), optional MXFP8 ``planes``.

    planes: nested like params, ``<layer path>/weight`` -> MXFP8Tensor (both planes), e.g.
    FSDP's all-gathered planes imported zero-copy; None to quantize bf16(param) in each layer.
    kernels: the ``KernelConfig`` of the MXFP8 linears (None: the device default).
    """
    step = _flax_step_fn(cfg, LinearMode.parse(mode), tuple(tokens.shape), kernels)
    return FlaxRun(*step(params, planes, jnp.asarray(tokens), jnp.asarray(targets)))
