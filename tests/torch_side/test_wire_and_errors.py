"""What goes over the wire, bad input, the NaN check and expert-DP groups (cases_wire.py)."""

from __future__ import annotations

import pytest

from tests.torch_side import cases_wire as cw
from tests.torch_side.conftest import check_case


def test_forward_gathers_rowwise_bytes_backward_colwise_only(spawned):
    """MXFP8 all-gather: 1 byte per element, no scales; forward rowwise, backward colwise; the
    optimizer step sends ONE packed amax all-reduce for all the MXFP8 groups of the communicator
    (the batched refresh), none per group."""
    check_case(spawned, cw, cw.case_wire_forward_rowwise_backward_colwise, 2)


def test_weights_cross_the_bridge_once_per_bucket_not_per_layer(spawned):
    check_case(spawned, cw, cw.case_bridge_crossings_per_step, 2)


def test_batched_refresh_writes_the_bytes_of_the_per_group_refresh(spawned):
    """Every strategy, one rank: the batched MXFP8 refresh of 3 groups equals each group's own
    refresh byte for byte (model buffers and scales), with one amax all-reduce for the batch."""
    check_case(spawned, cw, cw.case_batched_refresh_matches_per_group, 1)


def test_batched_refresh_writes_the_bytes_of_the_per_group_refresh_two_ranks(spawned):
    """The same with main weights sharded over two ranks (each rank its own main values)."""
    check_case(spawned, cw, cw.case_batched_refresh_matches_per_group, 2)


def test_recompute_forward_gathers_both_planes_once(spawned):
    check_case(spawned, cw, cw.case_wire_recompute_gathers_both_planes_once, 2)


def test_no_shard_forward_sends_nothing(spawned):
    check_case(spawned, cw, cw.case_wire_no_shard_forward_is_silent, 2)


def test_bad_input_gives_clear_errors(spawned):
    """Unaligned MXFP8 weight (raise or fallback by policy), a format FSDP does not implement,
    unknown strategy, tied weights, a process group without this rank."""
    check_case(spawned, cw, cw.case_bad_input_errors, 2)


def test_nan_gradient_check_names_parameter_and_rank(spawned):
    check_case(spawned, cw, cw.case_nan_grad_check_names_param_and_rank, 2)


@pytest.mark.slow
def test_expert_parameters_use_their_own_dp_group(spawned):
    check_case(spawned, cw, cw.case_expert_dp_groups, 4)


def test_plane_states_are_explicit_and_checked(spawned):
    check_case(spawned, cw, cw.case_plane_states_are_explicit_and_checked, 2)


def test_gathered_weights_and_full_state_dict_round_trip(spawned):
    check_case(spawned, cw, cw.case_gathered_weights_and_state_dict, 2)


def test_resharded_bucket_stays_alive_while_jax_reads_it(spawned):
    check_case(spawned, cw, cw.case_bucket_outlives_reshard_while_jax_reads, 2)
