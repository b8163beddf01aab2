"""After an exception escapes a forward (with grad, or an evaluation forward under ``no_grad``) or
a backward, the next step is correct or refused before any main weight changes, and after
``zero_grad()`` training continues bit for bit like a run that never saw the exception (issue 17;
cases_exceptions.py; the user-facing rule: docs/fsdp.md, "Misuse, errors and recovery")."""

from __future__ import annotations

import pytest

from tests.torch_side import cases_exceptions as ce
from tests.torch_side.conftest import check_case


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_forward_that_raises_frees_its_planes_and_the_next_step_is_correct(spawned, world_size):
    check_case(spawned, ce, ce.case_forward_that_raises_then_step, world_size)


def test_a_forward_that_raises_mid_accumulation_keeps_the_other_micro_batches(spawned):
    check_case(spawned, ce, ce.case_forward_that_raises_mid_accumulation, 1)


def test_an_evaluation_forward_that_raises_under_no_grad_leaves_training_exact(spawned):
    check_case(spawned, ce, ce.case_evaluation_forward_that_raises, 1)


def test_a_step_after_a_forward_that_bypassed_the_root_is_refused_before_any_change(spawned):
    check_case(spawned, ce, ce.case_step_after_a_forward_that_bypassed_the_root_is_refused, 1)


def test_a_backward_that_raises_is_refused_at_the_step_then_recovered_by_zero_grad(spawned):
    check_case(spawned, ce, ce.case_backward_that_raises, 1)
