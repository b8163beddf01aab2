"""``distributed_mxfp8_quantize`` is byte-identical to whole-tensor quantization (DESIGN.md 5).

The cases run in spawned gloo ranks (tests/torch_side/cases_quantize.py): world sizes 1 to 4,
even splits that cut 32-blocks and rows, random splits with ranks that own nothing, one rank
owning everything.
"""

from __future__ import annotations

import pytest

from tests.torch_side import cases_quantize as cq
from tests.torch_side.conftest import check_case

SLOW = pytest.mark.slow  # worlds of 3 and 4 ranks: run by `make test-all` (CI), not `make test`


@pytest.mark.parametrize(
    "world_size", [1, 2, pytest.param(3, marks=SLOW), pytest.param(4, marks=SLOW)]
)
def test_even_split_matches_whole_tensor_quantize(spawned, world_size):
    check_case(spawned, cq, cq.case_even_split, world_size)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=SLOW)])
def test_random_split_with_empty_ranks(spawned, world_size):
    check_case(spawned, cq, cq.case_random_split_with_empty_ranks, world_size)


def test_one_rank_owns_everything(spawned):
    check_case(spawned, cq, cq.case_one_rank_owns_everything, 2)


def test_shape_not_multiple_of_32_is_a_clear_error(spawned):
    check_case(spawned, cq, cq.case_bad_shape_raises, 1)
