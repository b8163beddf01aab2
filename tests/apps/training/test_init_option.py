"""``mxfp8-train --init meta`` (``TrainJob.init``): the model is built on the meta device and each
rank materialises its own shard by ``models.init_rule.GPTInit``; its initial main weights are
that rule's values, also at world 2 (in-process ranks), and it trains."""

from __future__ import annotations

import pytest
import torch

from apps.training.job import Init, TrainJob
from apps.training.loop import _Model
from models.init_rule import GPTInit
from models.torch_gpt import TorchGPT
from tests.torch_side.threaded_world import run_world
from torch_side import materialize

JOB = TrainJob(steps=1, micro_batches=1, batch_size=2, seq_len=32, seed=9, init=Init.META)


def _starts_from_the_rule(ctx) -> None:
    m = _Model(JOB)
    got = m.fsdp.full_state_dict()
    want = dict(materialize(TorchGPT(m.cfg, "mxfp8", seed=0), GPTInit(m.cfg, JOB.seed))
                .named_parameters())
    for name, v in got.items():
        assert torch.equal(v, want[name].detach()), name
    tokens = torch.arange(64).reshape(2, 32) % m.cfg.vocab_size
    loss = m.fsdp(tokens, tokens)
    loss.backward()
    m.opt.step()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("world", [1, 2])
def test_meta_init_starts_from_the_rule_and_trains(world):
    run_world(world, _starts_from_the_rule)


def test_the_option_is_on_the_command_line():
    import argparse

    from apps.training.options import add_options

    p = argparse.ArgumentParser()
    add_options(p, TrainJob)
    assert Init(p.parse_args(["--init", "meta"]).init) is Init.META
    assert Init(p.parse_args([]).init) is Init.SEEDED
