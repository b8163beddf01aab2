"""The Flax twin's AdamW: ``torch.optim.AdamW(foreach=False)``'s fp32 arithmetic, op for op, in JAX.

Why not optax: ``optax.adamw`` computes ``mu = b1 mu + (1 - b1) g``, ``nu = b2 nu + (1 - b2) g^2``
and ``p - lr (mu / bc1 / (sqrt(nu / bc2) + eps) + wd p)``; Torch computes (``_single_tensor_adam``,
decoupled weight decay) the same update in another order, with other roundings:

    p  <- p * f32(1 - lr wd)                                  (mul_, skipped when wd == 0)
    m  <- lerp(m, g, f32(1 - b1)) = fma(w, g - m, m)          (w < 0.5; else fma(w - 1, g - m, g))
    v  <- v * f32(b2);  v <- fma(f32(1 - b2) g, g, v)         (mul_, then addcmul_)
    d  <- sqrt(v) / f32(sqrt(bc2)) + f32(eps)
    p  <- p + (f32(-lr / bc1) m) / d                          (addcdiv_)

with bc1 = 1 - b1^t, bc2 = 1 - b2^t and every scalar computed in Python float64, then rounded to
fp32. The fused multiply-adds are what Torch's CPU kernels compute (measured: lerp and addcmul
contract into one FMA, addcdiv does not), and XLA's CPU backend contracts ``a * b + c`` into an
FMA too: each Torch op boundary is therefore a program boundary here (``v * b2`` must be rounded
before the addcmul), so no contraction crosses one.

The square root is the one op whose *implementation* differs: Torch's CPU ``sqrt`` is MKL VML's
"high accuracy" sqrt, not correctly rounded (about 17% of fp32 inputs one ulp off on this
project's CPU machine; the result depends on the value only), XLA's is correctly rounded.
``Sqrt.TORCH`` takes the square root with Torch's kernel (the same bytes; like the linears, which
both stacks run with the same JAX kernels); ``Sqrt.XLA`` with JAX's, which shows the difference
(on the CPU the main weights then differ after the first step).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

__all__ = ["AdamWConfig", "AdamWState", "Sqrt", "adamw_step", "init_state"]

_F32 = jnp.float32


class Sqrt(enum.Enum):
    """Which kernel takes AdamW's square root on the Flax side (module note)."""

    TORCH = "torch"  # Torch's sqrt kernel on the device (MKL VML on the CPU): the same bytes
    XLA = "xla"  # jnp.sqrt (correctly rounded)


class AdamWConfig(NamedTuple):
    """``torch.optim.AdamW``'s hyperparameters (its defaults but the weight decay, which is the
    training app's)."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def torch_kwargs(self) -> dict:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


class AdamWState(NamedTuple):
    step: int  # completed steps (Torch's ``state["step"]``)
    exp_avg: dict[str, jax.Array]  # by parameter name, fp32
    exp_avg_sq: dict[str, jax.Array]


def init_state(params: Mapping[str, jax.Array]) -> AdamWState:
    zeros = {n: jnp.zeros_like(p) for n, p in params.items()}
    return AdamWState(0, zeros, dict(zeros))


class _Scalars(NamedTuple):
    """One step's scalars, computed as Torch computes them (float64), rounded to fp32."""

    decay: np.float32  # 1 - lr wd
    lerp_coeff: np.float32  # w (small weight) or w - 1
    lerp_small: bool
    beta2: np.float32
    sq_coeff: np.float32  # 1 - b2
    bc2_sqrt: np.float32
    eps: np.float32
    neg_step_size: np.float32  # -lr / bc1


def _scalars(hp: AdamWConfig, step: int) -> _Scalars:
    b1, b2 = hp.betas
    t = float(step)
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    w = np.float32(1 - b1)
    small = bool(abs(w) < 0.5)  # torch's is_lerp_weight_small
    coeff = w if small else np.float32(w - np.float32(1))
    return _Scalars(np.float32(1 - hp.lr * hp.weight_decay), coeff, small, np.float32(b2),
                    np.float32(1 - b2), np.float32(bc2**0.5), np.float32(hp.eps),
                    np.float32(-(hp.lr / bc1)))


# One program per Torch op, each a single elementwise expression: XLA contracts ``a * b + c`` into
# an FMA inside one fused loop, but not across programs nor (for small arrays) always across the
# outputs of a multi-output program; Torch's lerp and addcmul are FMAs, its mul_ a rounding.
@jax.jit
def _mul(a, s):
    return a * s


@jax.jit
def _lerp_small(m, g, w):  # Torch's lerp for |w| < 0.5: fma(w, g - m, m)
    return w * (g - m) + m


@jax.jit
def _lerp_large(m, g, w_minus_1):  # otherwise: fma(w - 1, g - m, g)
    return w_minus_1 * (g - m) + g


@jax.jit
def _addcmul(v, g, sq_coeff):
    return v + sq_coeff * g * g


@jax.jit
def _addcdiv(p, m, root, bc2_sqrt, eps, neg_step_size):
    # bc2_sqrt comes as a full array: XLA rewrites a division by a broadcast scalar into a
    # multiplication by its reciprocal (other bytes than Torch's division)
    return p + (neg_step_size * m) / (root / bc2_sqrt + eps)


_xla_sqrt = jax.jit(jnp.sqrt)


def _sqrt(v: jax.Array, how: Sqrt) -> jax.Array:
    if how is Sqrt.XLA:
        return _xla_sqrt(v)
    return jnp.asarray(torch.from_numpy(np.array(v)).sqrt().numpy())


def adamw_step(params: Mapping[str, jax.Array], grads: Mapping[str, jax.Array],
               state: AdamWState, hp: AdamWConfig, sqrt: Sqrt = Sqrt.TORCH
               ) -> tuple[dict[str, jax.Array], AdamWState]:
    """One AdamW step over fp32 ``params`` (by name) with ``grads``: (new params, new state)."""
    s = _scalars(hp, state.step + 1)
    new_p, new_m, new_v = {}, {}, {}
    for n, p in params.items():
        g = grads[n]
        if p.dtype != _F32 or g.dtype != _F32:
            raise TypeError(f"adamw_step: {n} is {p.dtype} with a {g.dtype} gradient; the main "
                            f"weights and gradients are fp32")
        p1 = _mul(p, s.decay) if hp.weight_decay != 0 else p  # Torch skips the mul_ at 0
        m1 = (_lerp_small if s.lerp_small else _lerp_large)(state.exp_avg[n], g, s.lerp_coeff)
        v2 = _addcmul(_mul(state.exp_avg_sq[n], s.beta2), g, s.sq_coeff)
        new_p[n] = _addcdiv(p1, m1, _sqrt(v2, sqrt), jnp.full(p.shape, s.bc2_sqrt, _F32), s.eps,
                            s.neg_step_size)
        new_m[n], new_v[n] = m1, v2
    return new_p, AdamWState(state.step + 1, new_m, new_v)
