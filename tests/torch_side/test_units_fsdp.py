"""The GPT under unit compute, sharded by FSDP, matches a replicated reference (cases_units.py):
every strategy at world sizes 1 and 2 (ZeRO-3 also at 4), activation recompute inside the backward
programs with micro-batches, bf16 weight gathers, and both blocks as one FSDP unit (one program
per direction). World 1 is exact; the rest is slow
(``make test-all``)."""

from __future__ import annotations

import pytest

from tests.torch_side import cases_units as cu
from tests.torch_side.conftest import check_case

SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("case", "world_size"),
    [
        (cu.case_unit_optim_grads_params, 1),
        pytest.param(cu.case_unit_zero3_recompute_accumulation, 1, marks=SLOW),
        *[pytest.param(c, w, marks=SLOW)
          for c in (cu.case_unit_no_shard, cu.case_unit_optim, cu.case_unit_optim_grads)
          for w in (1, 2)],
        pytest.param(cu.case_unit_optim_grads_params, 2, marks=SLOW),
        pytest.param(cu.case_unit_optim_grads_params, 4, marks=SLOW),
        pytest.param(cu.case_unit_zero3_recompute_accumulation, 2, marks=SLOW),
        pytest.param(cu.case_unit_zero3_bf16_gather, 1, marks=SLOW),
        pytest.param(cu.case_unit_zero3_bf16_gather, 2, marks=SLOW),
        pytest.param(cu.case_unit_zero3_blocks_in_one_unit_recompute_accumulation, 2,
                     marks=SLOW),
    ],
    ids=lambda v: v.__name__.removeprefix("case_unit_") if callable(v) else f"w{v}",
)
def test_unit_compute_matches_the_replicated_reference(spawned, case, world_size):
    check_case(spawned, cu, case, world_size)
