"""``clip_grad_norm_`` on sharded gradients equals ``torch.nn.utils.clip_grad_norm_`` on the
unsharded model's full gradients, for every strategy at world sizes 1 and 2 (ZeRO-3 also at 4),
and leaves a
non-finite norm's gradients untouched (cases_grad_clip.py; spawned worlds, marked slow)."""

from __future__ import annotations

import pytest

from tests.torch_side import cases_grad_clip as cc
from tests.torch_side.conftest import check_case

pytestmark = pytest.mark.slow

CLIP = [cc.case_clip_no_shard, cc.case_clip_optim, cc.case_clip_optim_grads,
        cc.case_clip_optim_grads_params]
NONFINITE = [cc.case_clip_nonfinite_no_shard, cc.case_clip_nonfinite_zero3]


def _name(case) -> str:
    return case.__name__.removeprefix("case_clip_")


@pytest.mark.parametrize(
    ("case", "world_size"),
    [(c, w) for c in CLIP for w in (1, 2)] + [(cc.case_clip_optim_grads_params, 4)],
    ids=lambda v: f"w{v}" if isinstance(v, int) else _name(v),
)
def test_clip_matches_torch_on_the_unsharded_model(spawned, case, world_size):
    check_case(spawned, cc, case, world_size)


@pytest.mark.parametrize("case", NONFINITE, ids=_name)
def test_a_nonfinite_norm_leaves_the_gradients_alone(spawned, case):
    check_case(spawned, cc, case, 2)
