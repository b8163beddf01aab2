"""Sharded training matches a replicated single-process reference (cases_training.py).

Every strategy at world sizes 1 and 2 (ZeRO-3 also at 4, slow) trains ``ToyNet`` (MXFP8 linears
+ fp32 layers + a frozen parameter) for 2 Adam steps (the second with forward prefetch); losses
and main weights agree exactly at world size 1 and to a stated fp32 tolerance otherwise. Activation
recompute (whole unit, submodule inside a unit) and gradient accumulation over micro-batches are
covered under ZeRO-3 at world sizes 1 and 2, and once under ZeRO-1. Both weight gather modes
(MXFP8 planes, bf16) at world sizes 1 and 2 for every strategy (4: ZeRO-3), all slow: wire bytes
per element, the reference, and bit-identity between the modes.
"""

from __future__ import annotations

import pytest

from tests.torch_side import cases_training as ct
from tests.torch_side.conftest import check_case


@pytest.mark.parametrize(
    ("case", "world_size"),
    [(c, w) for c in (ct.case_no_shard, ct.case_optim, ct.case_optim_grads,
                      ct.case_optim_grads_params) for w in (1, 2)]
    + [pytest.param(ct.case_optim_grads_params, 4, marks=pytest.mark.slow)],
    ids=lambda v: f"w{v}" if isinstance(v, int) else v.__name__.removeprefix("case_"),
)
def test_strategy_matches_reference(spawned, case, world_size):
    check_case(spawned, ct, case, world_size)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "case",
    [
        ct.case_zero3_recompute_unit,
        ct.case_zero3_recompute_submodule,
        ct.case_zero3_grad_accumulation,
    ],
    ids=lambda f: f.__name__.removeprefix("case_"),
)
def test_recompute_and_accumulation_match_reference(spawned, case, world_size):
    check_case(spawned, ct, case, world_size)


@pytest.mark.slow
def test_zero1_accumulation_with_recompute(spawned):
    check_case(spawned, ct, ct.case_zero1_grad_accumulation_recompute, 2)


@pytest.mark.parametrize(
    ("case", "world_size"),
    [
        (ct.case_zero3_bf16_mixed_formats, 1),
        pytest.param(ct.case_zero3_bf16_mixed_formats, 2, marks=pytest.mark.slow),
        pytest.param(ct.case_zero2_bf16_mixed_formats, 2, marks=pytest.mark.slow),
    ],
    ids=["zero3-w1", "zero3-w2", "zero2-w2"],
)
def test_bf16_mixed_formats_match_reference(spawned, case, world_size):
    """MXFP8 linears + bf16 everything else (weights, activations, grads, grad communication)."""
    check_case(spawned, ct, case, world_size)


@pytest.mark.parametrize(
    ("case", "world_size"),
    [(ct.case_zero3_precompiled, 1),
     pytest.param(ct.case_zero3_precompiled, 2, marks=pytest.mark.slow),
     (ct.case_zero2_recompute_precompiled, 1)],
    ids=["zero3-w1", "zero3-w2", "zero2-recompute-w1"],
)
def test_precompiled_training_matches_reference(spawned, case, world_size):
    """torch_side.precompile before training: the same losses and weights as the reference
    (exactly at world size 1), nothing compiled in the steps after it, wire log untouched."""
    check_case(spawned, ct, case, world_size)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "world_size"),
    [(ct.case_gather_modes_no_shard, 1), (ct.case_gather_modes_no_shard, 2),
     (ct.case_gather_modes_optim, 1), (ct.case_gather_modes_optim, 2),
     (ct.case_gather_modes_optim_grads, 1), (ct.case_gather_modes_optim_grads, 2),
     (ct.case_gather_modes_optim_grads_params, 1), (ct.case_gather_modes_optim_grads_params, 2),
     (ct.case_gather_modes_optim_grads_params, 4)],
    ids=lambda v: v if isinstance(v, int) else v.__name__.removeprefix("case_gather_modes_"),
)
def test_bf16_and_mxfp8_weight_gathers_train_bit_identically(spawned, case, world_size):
    """GatherMode.BF16 moves 2 bytes per element where MXFP8 moves 1, matches the replicated
    reference like it, and gives the same losses, gradients and weights bit for bit."""
    check_case(spawned, ct, case, world_size)
