"""One global batch split into a different number of micro-batches per rank trains the same to
fp32 summation order (issue 17 item 8.6), which is what resuming at another world size relies on.

3 ranks x 1 micro-batch against 1 rank x 3 micro-batches (the same sample ids per step): the
ratio 3 is not a power of two. The loop used to scale each micro-batch's loss by 1/micro_batches
before backward; MXFP8 scaling absorbs only powers of two, so dy's MXFP8 bytes differed and the
losses drifted apart by ~1e-4 relative within a few steps. Backward now runs on token-loss sums
(dy exactly 1 per token) and the mean is taken on the accumulated fp32 gradients.
"""

from __future__ import annotations

import dataclasses

import pytest

from apps.training.job import TrainJob
from apps.training.loop import RunOptions, train_rank
from tests.torch_side.threaded_world import run_ranks

pytestmark = pytest.mark.slow

JOB = TrainJob(steps=4, micro_batches=1, batch_size=2, seq_len=32, lr=3e-3, seed=1,
               eval_batches=1)
RTOL = 2e-6  # fp32 summation order; observed 6.8e-8 (5.4e-4 with the old loss scaling)


def test_the_micro_batch_count_changes_the_losses_only_by_summation_order():
    # ranks are threads of this process (run_ranks; world 1 reuses world 3's programs)
    opts = RunOptions(progress=False, precompile=False)
    three = run_ranks(train_rank, 3, (JOB, opts))[0]
    one = run_ranks(train_rank, 1, (dataclasses.replace(JOB, micro_batches=3), opts))[0]
    worst = max(abs(a.loss - b.loss) / abs(a.loss)
                for a, b in zip(three.steps, one.steps, strict=True))
    print(f"max relative loss difference over {JOB.steps} steps: {worst:.3g}")
    assert worst < RTOL, [(a.loss, b.loss) for a, b in zip(three.steps, one.steps, strict=True)]
