"""Weak references to the JAX residuals an autograd op hands to ``bridge.residuals.holder``
(the per-linear op's planes, a unit program's residuals), for the lifetime tests."""

from __future__ import annotations

import weakref

import jax


def recording_residuals(monkeypatch) -> list:
    """From now on (until the test ends), a weak reference to every JAX array held for a
    backward is appended to the returned list."""
    from bridge import residuals

    refs: list = []
    real = residuals.holder

    def holder(kept):
        refs.extend(weakref.ref(a) for a in jax.tree.leaves(kept) if isinstance(a, jax.Array))
        return real(kept)

    monkeypatch.setattr(residuals, "holder", holder)
    return refs
