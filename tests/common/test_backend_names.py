"""``common.kernels.Backend``: the built-in names, and names registered at run time
(``Backend.register``, which ``jax_side.mxfp8.backends.register_backend`` calls with the
implementation). A registered name is a ``Backend`` like the members: parsed, hashed, compared
by identity, pickled by name, held by a ``KernelConfig``; iteration lists the built-ins only."""

from __future__ import annotations

import copy
import pickle

import pytest

from common.kernels import Backend, KernelConfig


@pytest.fixture
def mine():
    backend = Backend.register("mine")
    try:
        yield backend
    finally:
        if backend in Backend.known():  # a test may have unregistered it already
            Backend.unregister(backend)


def test_a_registered_name_is_a_backend_like_the_members(mine):
    assert isinstance(mine, Backend) and mine.value == "mine"
    assert repr(mine) == "<Backend.MINE: 'mine'>"
    assert Backend("mine") is mine and Backend.parse("MINE") is mine and Backend.parse(mine) is mine
    assert {mine: 1}[Backend("mine")] == 1 and mine != Backend.XLA
    assert pickle.loads(pickle.dumps(mine)) is mine and copy.deepcopy(mine) is mine
    config = KernelConfig("mine", "dequant_dot")
    assert config.backend is mine and pickle.loads(pickle.dumps(config)) == config
    assert list(Backend) == [Backend.XLA, Backend.PALLAS, Backend.TE]
    assert Backend.known() == (Backend.XLA, Backend.PALLAS, Backend.TE, mine)
    with pytest.raises(ValueError, match=r"unknown MXFP8 backend 'yours'.*'te', 'mine'\]"):
        Backend.parse("yours")


def test_unregistered_it_is_unknown_and_built_ins_stay(mine):
    Backend.unregister(mine)
    with pytest.raises(ValueError, match="unknown MXFP8 backend 'mine'"):
        KernelConfig("mine")
    with pytest.raises(ValueError, match="not a registered name"):
        Backend.unregister(mine)
    with pytest.raises(ValueError, match="built-in members cannot be removed"):
        Backend.unregister(Backend.TE)


def test_names_that_could_not_be_told_apart_are_refused(mine):
    with pytest.raises(ValueError, match="'mine' exists already"):
        Backend.register("mine")
    with pytest.raises(ValueError, match="'te' exists already"):
        Backend.register("te")
    for bad in ("Mine2", "2fast", "my-kernels", ""):
        with pytest.raises(ValueError, match="lower case letters"):
            Backend.register(bad)
