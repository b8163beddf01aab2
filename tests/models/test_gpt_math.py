"""``gpt_math.cross_entropy`` (a custom VJP: one elementwise pass for d logits) returns the bytes
of ``cross_entropy_reference`` (plain autodiff of log-softmax, take, mean), loss and gradient,
jitted as the unit programs and the Flax twin run it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.gpt_math import cross_entropy, cross_entropy_reference


def _both(logits, targets, g=1.0):
    """(loss, d logits) of both, each one jitted program of runtime arguments."""
    def grads(fn, z, t, ct):
        loss, vjp = jax.vjp(lambda z: fn(z, t), z)
        return loss, vjp(ct)[0]

    ct = jnp.asarray(g, jnp.float32)
    return tuple(jax.jit(lambda z, t, c, f=fn: grads(f, z, t, c))(logits, targets, ct)
                 for fn in (cross_entropy, cross_entropy_reference))


def _bytes(x):
    return np.asarray(x).tobytes()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("g", [1.0, -0.37, 0.0, -0.0])
def test_loss_and_gradient_are_the_autodiff_bytes(dtype, g):
    k1, k2 = jax.random.split(jax.random.key(3))
    logits = (4.0 * jax.random.normal(k1, (3, 5, 384))).astype(dtype)
    # extremes: a row of equal logits, a huge and a very negative logit, -inf entries
    logits = logits.at[0, 0].set(1.5).at[0, 1, 7].set(80.0).at[1, 2, :9].set(-jnp.inf)
    logits = logits.at[2, 3, 11].set(-3e4)
    targets = jax.random.randint(k2, (3, 5), 0, 384).at[0, 1].set(7).at[1, 2].set(383)
    (loss, d), (ref_loss, ref_d) = _both(logits, targets, g)
    assert d.dtype == logits.dtype and d.shape == logits.shape
    assert _bytes(loss) == _bytes(ref_loss)
    assert _bytes(d) == _bytes(ref_d)


def test_negative_and_out_of_range_targets_match_take_along_axis():
    """A negative target wraps once (as ``take_along_axis`` indexes); one out of range is
    dropped from the gradient (its loss is NaN either way)."""
    logits = jax.random.normal(jax.random.key(1), (2, 4, 256), jnp.float32)
    for bad in (-1, -256, 256, -257, 10_000):
        targets = jnp.arange(8).reshape(2, 4).at[1, 2].set(bad)
        (loss, d), (ref_loss, ref_d) = _both(logits, targets)
        assert _bytes(loss) == _bytes(ref_loss), bad
        assert _bytes(d) == _bytes(ref_d), bad


def test_the_backward_scatters_nothing():
    """The point of the custom VJP: no scatter into an fp32 array of the logits' shape."""
    logits = jnp.zeros((2, 8, 512), jnp.bfloat16)
    targets = jnp.zeros((2, 8), jnp.int32)
    hlo = jax.jit(jax.grad(cross_entropy)).lower(logits, targets).compile().as_text()
    ref = jax.jit(jax.grad(cross_entropy_reference)).lower(logits, targets).compile().as_text()
    assert "scatter(" not in hlo and "scatter(" in ref


@pytest.mark.parametrize("shape", [(1, 5), (2, 1), (5,), (2, 5, 1)])
def test_targets_that_would_broadcast_are_refused(shape):
    """The backward divides by the number of targets: targets that only broadcast against the
    logits would scale the gradient wrongly, so they are refused, naming both shapes."""
    logits = jnp.zeros((2, 5, 37), jnp.float32)
    targets = jnp.zeros(shape, jnp.int32)
    with pytest.raises(ValueError, match=r"targets .* must have the logits' shape"):
        jax.grad(cross_entropy)(logits, targets)
    with pytest.raises(ValueError, match=r"targets .* must have the logits' shape"):
        cross_entropy(logits, targets)
