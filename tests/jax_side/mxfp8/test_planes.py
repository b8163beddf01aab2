"""Planes are one mapping ``{Plane: PlaneData}`` in both tensor classes, asked for by a set of
``Plane``s (not rowwise=/colwise= booleans)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from common.formats import ALL_PLANES, Plane, PlaneData, parse_planes
from jax_side import mxfp8


@pytest.mark.parametrize(
    "asked,want",
    [
        (Plane.COLWISE, (Plane.COLWISE,)),
        ("rowwise", (Plane.ROWWISE,)),
        ([Plane.COLWISE, "rowwise", Plane.COLWISE], ALL_PLANES),  # Plane order, no repeats
    ],
)
def test_quantize_makes_exactly_the_planes_asked_for(asked, want):
    t = mxfp8.quantize(jnp.ones((32, 64), jnp.float32), planes=asked)
    assert tuple(t.planes) == want and parse_planes(asked, "t") == want
    for p in want:
        assert isinstance(t.plane(p), PlaneData) and t.plane(p).data.shape == (32, 64)
    missing = [p for p in Plane if p not in want]
    for p in missing:
        assert not t.has_plane(p) and getattr(t, f"{p.value}_data") is None
        with pytest.raises(ValueError, match=f"planes including Plane.{p.name}"):
            t.plane(p)


def test_one_plane_tensor_is_a_pytree_of_that_plane_only():
    t = mxfp8.quantize(jnp.ones((32, 64), jnp.float32), planes=Plane.COLWISE)
    leaves, treedef = jax.tree_util.tree_flatten(t)
    assert [leaf.shape for leaf in leaves] == [(32, 64), (1, 64)]
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert tuple(back.planes) == (Plane.COLWISE,) and back.shape == t.shape
    out = jax.jit(lambda u: u)(t)
    assert tuple(out.planes) == (Plane.COLWISE,)


def test_asking_for_no_plane_or_an_unknown_one_is_refused():
    with pytest.raises(ValueError, match="asks for nothing"):
        mxfp8.partial_block_amax(jnp.ones(64, jnp.float32), (32, 32), 0, planes=())
    with pytest.raises(ValueError, match="MXFP8 plane"):
        mxfp8.quantize(jnp.ones((32, 32), jnp.float32), planes=("diagonal",))
    with pytest.raises(TypeError, match="planes must be a mapping"):
        mxfp8.MXFP8Tensor([None, None], (32, 32), jnp.dtype(jnp.float32))
