"""``mxfp8-train --replicas R`` (HSDP, ``torch_side.fsdp.hybrid_mesh``), end to end on four ranks
in threads of this process (``run_ranks``), slow:

- 2 replicas x 2 shards trains the same steps as plain FSDP over the 4 ranks (the same global
  batch: losses agree to fp32 summation order);
- its checkpoint (written by replica 0) resumes as 4 replicas of one shard with block-atomic
  MXFP8 shards (``--shard-layout block_atomic``), continuing the same curve to summation order;
- a replica count that does not divide the world size is refused before anything is built.
"""

from __future__ import annotations

import dataclasses

import pytest

from apps.training.job import TrainJob
from apps.training.loop import RunOptions, train_rank
from tests.torch_side.threaded_world import RankFailed, run_ranks

pytestmark = pytest.mark.slow

JOB = TrainJob(steps=4, micro_batches=1, batch_size=2, seq_len=32, lr=1e-2, seed=5, eval_batches=1)


def _losses(result) -> dict[int, float]:
    return {s.step: s.loss for s in result.steps}


def _runs(root: str) -> dict:
    full = train_rank(JOB, RunOptions(save_dir=root, save_every=2, progress=False, replicas=2))
    plain = train_rank(JOB, RunOptions(progress=False))
    # and in the other shard layout (block-atomic MXFP8 shards): checkpoints convert
    four = train_rank(dataclasses.replace(JOB, shard_layout="block_atomic"),
                      RunOptions(resume=f"{root}/step_000002", progress=False, replicas=4))
    return {"hsdp": _losses(full), "plain": _losses(plain), "four": _losses(four)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    return root, run_ranks(_runs, 4, (str(root),))


def test_two_replicas_train_as_plain_fsdp_over_every_rank(runs):
    _, results = runs
    assert results[0] == results[3]  # every rank reports the same
    hsdp, plain = results[0]["hsdp"], results[0]["plain"]
    assert sorted(hsdp) == [0, 1, 2, 3]
    for k, v in hsdp.items():
        assert v == pytest.approx(plain[k], rel=1e-4), (k, v, plain[k])


def test_the_checkpoint_resumes_at_another_mesh_shape_and_layout(runs):
    """(At a plain world of another size: tests/torch_side/fsdp/test_hsdp.py, library level.)"""
    _, results = runs
    hsdp = results[0]["hsdp"]
    four = results[0]["four"]  # 4 replicas of one shard, block-atomic shards
    assert sorted(four) == [2, 3]
    for k, v in four.items():
        assert v == pytest.approx(hsdp[k], rel=1e-4), (k, v, hsdp[k])


def test_a_replica_count_that_does_not_divide_the_world_is_refused():
    with pytest.raises(RankFailed,
                       match="replicas=3: the replica count must divide the world size 2"):
        run_ranks(train_rank, 2, (JOB, RunOptions(replicas=3, progress=False)))
