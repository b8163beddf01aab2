"""Misuse and edge cases that used to give silently wrong results (issue 10; cases_reliability.py).

Each test reads as the rule it pins: an exception escaping backward is recovered from; a second
backward over a retained graph accumulates; state dicts are full and checked; a plain optimizer
and an optimizer step between forward and backward are refused; experts that get no tokens keep
every rank's collectives in step, also as FSDP units of their own; wrapping arguments that match
nothing (or expert units no unit can host) are refused.
"""

from __future__ import annotations

import pytest

from tests.torch_side import cases_reliability as cr
from tests.torch_side.conftest import check_case


def test_exception_escaping_backward_is_recovered_from(spawned):
    """NaN loss + GradCheck.FINITE on every rank, caught; training then matches a clean run."""
    check_case(spawned, cr, cr.case_exception_in_backward_recovers, 2)


def test_zero_grad_resets_after_an_aborted_backward(spawned):
    check_case(spawned, cr, cr.case_zero_grad_after_an_aborted_backward_resets_quietly, 2)


def test_second_backward_over_a_retained_graph_accumulates(spawned):
    check_case(spawned, cr, cr.case_second_backward_over_retained_graph, 2)


def test_load_full_state_dict_refuses_other_shapes(spawned):
    check_case(spawned, cr, cr.case_load_full_state_dict_checks_shapes, 2)


def test_state_dict_is_the_full_model_and_round_trips(spawned):
    check_case(spawned, cr, cr.case_state_dict_is_full_and_round_trips, 2)


def test_plain_optimizer_over_fsdp_parameters_is_refused(spawned):
    check_case(spawned, cr, cr.case_plain_optimizer_is_refused, 2)


def test_optimizer_step_between_forward_and_backward_is_refused(spawned):
    check_case(spawned, cr, cr.case_step_between_forward_and_backward_is_refused, 2)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_experts_without_tokens_keep_ranks_in_step(spawned, world_size):
    check_case(spawned, cr, cr.case_moe_experts_without_tokens, world_size)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "case",
    [cr.case_expert_units_without_tokens, cr.case_expert_units_hosted_by_the_root,
     cr.case_expert_units_in_a_recomputed_moe_layer],
    ids=["moe_layer_hosts", "root_hosts", "recomputed_moe_layer"],
)
def test_expert_units_without_tokens_keep_ranks_in_step(spawned, case, world_size):
    """Experts as FSDP units of their own, not called (or called empty) on some ranks: the same
    collectives on every rank, training as the replicated reference (issue 30 item 12)."""
    check_case(spawned, cr, case, world_size)


def test_wrapping_arguments_that_match_nothing_are_refused(spawned):
    check_case(spawned, cr, cr.case_bad_wrapping_arguments, 2)
