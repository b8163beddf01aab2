"""The in-process world harness (threaded_world.py): ranks and default groups per thread, a
failing rank fails the test naming it, a rank missing from a collective is reported as a stall
naming it (the others released), never a hang; warnings are recorded per rank."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.torch_side.threaded_world import RankFailed, RankWarnings, WorldStalled, run_world


def _ranks_and_sum(ctx, seen: list) -> None:
    assert (dist.get_rank(), dist.get_world_size()) == (ctx.rank, ctx.world_size)
    assert ctx.device == "cpu" and torch.get_num_threads() == 1
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    every = [None] * ctx.world_size
    dist.all_gather_object(every, ctx.rank)
    seen.append((ctx.rank, float(t), every))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_thread_is_a_rank_of_its_own_default_group(world_size):
    seen: list = []
    run_world(world_size, _ranks_and_sum, seen)
    total = float(world_size * (world_size + 1) // 2)
    assert sorted(seen) == [(r, total, list(range(world_size))) for r in range(world_size)]


def test_a_threaded_world_without_comms_is_destroyed_cleanly(monkeypatch):
    """Torch 2.11's threaded world has no ``comms``, which its ``destroy_process_group`` reads
    (measured on the GPU machine: every world failed at teardown); the shim supplies it for the
    time of a world and takes it away after."""
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    if hasattr(threaded.ThreadLocalWorld, "comms"):
        monkeypatch.delattr(threaded.ThreadLocalWorld, "comms")
    seen: list = []
    run_world(2, _ranks_and_sum, seen)
    assert sorted(seen) == [(0, 3.0, [0, 1]), (1, 3.0, [0, 1])]
    assert not hasattr(threaded.ThreadLocalWorld, "comms")


def _rank_1_raises(ctx) -> None:
    if ctx.rank == 1:
        raise ValueError("bad on one rank")
    dist.barrier()  # released: the test ends, it does not wait for rank 1


def test_a_failing_rank_fails_the_test_naming_it():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1/2 failed: ValueError: bad on one rank") as e:
        run_world(2, _rank_1_raises)
    assert isinstance(e.value.__cause__, ValueError)
    assert time.monotonic() - start < 10


def _rank_1_skips(ctx) -> None:
    if ctx.rank == 0:
        dist.barrier()  # rank 1 never joins


def test_a_rank_missing_from_a_collective_is_named_within_the_stall_limit():
    start = time.monotonic()
    with pytest.raises(WorldStalled, match=r"ranks \[0\] of 2 waited 1 s .* ranks \[1\] did not"):
        run_world(2, _rank_1_skips, stall_s=1.0)
    assert time.monotonic() - start < 10


def _warn_twice(ctx, seen: RankWarnings) -> None:
    dist.barrier()  # both ranks inside the recording block at once
    for _ in range(2):  # the same warning again: recorded again (filter "always")
        warnings.warn(f"from rank {ctx.rank}", RuntimeWarning, stacklevel=1)
    assert [str(w.message) for w in seen.mine()] == [f"from rank {ctx.rank}"] * 2


def test_warnings_are_recorded_per_rank():
    with RankWarnings().record() as seen:
        run_world(2, _warn_twice, seen)
    assert {n: [str(w.message) for w in ws] for n, ws in seen.by_thread.items()} == {
        f"rank {r}/2": [f"from rank {r}"] * 2 for r in range(2)
    }


def test_this_torch_has_every_private_entry_point_the_worlds_use():
    """Where one is missing every world test skips (naming it): here none may be missing."""
    from tests.torch_side.threaded_world import missing_entry_points

    assert missing_entry_points() == []
