"""Communication overlapped with compute (cases_overlap.py): the bytes do not depend on the
prefetch depth or on asynchronous reductions, the bucket memory of a ZeRO-3 step is bounded by
the layout and the prefetch depth (also when gloo lets go of a bucket late, with the garbage
collector off), and the trace shows the next unit's gather issued during this one. World 2 in
the fast suite; world 4 and the recompute variant (world 2) are slow. Every other equality
against the replicated reference (worlds 1-4) runs with the default overlap on."""

from __future__ import annotations

import pytest

from tests.torch_side import cases_overlap as co
from tests.torch_side.conftest import check_case
from torch_side import Overlap

SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("case", "world_size"),
    [
        (co.case_overlap_unit_compute_bytes, 2),
        (co.case_peak_bucket_bytes_follow_the_layout, 2),
        (co.case_peak_bucket_bytes_do_not_depend_on_timing, 2),
        (co.case_trace_shows_the_gather_of_the_next_unit_issued_during_this_one, 2),
        pytest.param(co.case_overlap_unit_compute_bytes, 4, marks=SLOW),
        pytest.param(co.case_overlap_op_recompute_bytes, 2, marks=SLOW),
    ],
    ids=lambda v: v.__name__.removeprefix("case_") if callable(v) else f"w{v}",
)
def test_overlap(case, world_size):
    check_case(co, case, world_size)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prefetch": -1}, "prefetch must be an int >= 0"),
        ({"prefetch": True}, "prefetch must be an int >= 0"),
        ({"reductions_in_flight": 0}, "reductions_in_flight must be an int >= 1"),
        ({"async_reduce": "yes"}, "async_reduce must be a bool"),
        ({"freed_grad_buckets": -1}, "freed_grad_buckets must be an int >= 0"),
        ({"freed_grad_buckets": 1.0}, "freed_grad_buckets must be an int >= 0"),
    ],
)
def test_bad_overlap_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Overlap(**kwargs)


def test_the_model_s_pool_keeps_at_most_freed_grad_buckets_handed_over_buckets(
        single_rank_world):
    """``Overlap.freed_grad_buckets`` reaches the model's bucket pool (the bound itself:
    tests/torch_side/fsdp/test_bucket_allocator.py)."""
    from torch import nn

    from torch_side import fully_shard

    for overlap, limit in ((None, 2), (Overlap(freed_grad_buckets=0), 0)):
        model = fully_shard(nn.Sequential(nn.Linear(64, 64, bias=False)), overlap=overlap)
        assert model.allocator.retiring_limit == limit


def test_the_execution_order_gives_the_units_ahead_in_either_direction():
    from torch_side.fsdp.execution_order import ExecutionOrder

    order = ExecutionOrder()
    for u in "abcde":
        order.record(u)
    assert order.ahead("b", 2, +1) == []  # not frozen: nothing is known yet
    order.freeze()
    assert order.ahead("b", 2, +1) == ["c", "d"]
    assert order.ahead("d", 5, +1) == ["e"]
    assert order.ahead("d", 2, -1) == ["c", "b"]
    assert order.ahead("a", 3, -1) == []
    assert order.ahead("c", 0, +1) == []
