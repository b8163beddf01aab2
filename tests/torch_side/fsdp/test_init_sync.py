"""Ranks that initialise differently end with rank 0's model, not a silent mix (issue 17;
cases_init_sync.py): the wrapped model is rank 0's init bit for bit and trains like the
replicated reference started from it; expert parameters come from rank 0 of their expert-DP
group; ``InitSync.VERIFY`` refuses on every rank, naming the first differing parameter."""

from __future__ import annotations

import pytest

from tests.torch_side import cases_init_sync as ci
from tests.torch_side.conftest import check_case

WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world_size", WORLDS)
def test_ranks_that_initialise_differently_start_from_rank0(spawned, world_size):
    check_case(spawned, ci, ci.case_ranks_that_initialise_differently_start_from_rank0, world_size)


@pytest.mark.parametrize("world_size", WORLDS)
def test_expert_parameters_start_from_rank0_of_their_expert_group(spawned, world_size):
    check_case(
        spawned, ci, ci.case_expert_parameters_start_from_rank0_of_their_expert_group, world_size
    )


def test_init_sync_verify_names_the_first_differing_parameter(spawned):
    check_case(spawned, ci, ci.case_init_sync_verify_names_the_first_differing_parameter, 2)
