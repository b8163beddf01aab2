"""``TrainJob``: the weights choice through the one recipe table, and what the job builds."""

from __future__ import annotations

import pytest

from apps.training.job import RECIPES, TrainJob, Weights
from common.modes import LinearMode
from torch_side import WeightFormat
from common.modes import Activations

# (weights, activations) -> (linear mode, FSDP format of the other weights): the module docstring
# table, written out.
EXPECTED = {
    ("mxfp8", "fp32"): (LinearMode.MXFP8, WeightFormat.FP32),
    ("mxfp8", "bf16"): (LinearMode.MXFP8, WeightFormat.BF16),
    ("bf16", "fp32"): (LinearMode.HIGH_PRECISION, WeightFormat.BF16),
    ("bf16", "bf16"): (LinearMode.HIGH_PRECISION, WeightFormat.BF16),
    ("fp32", "fp32"): (LinearMode.HIGH_PRECISION, WeightFormat.FP32),
    ("fp32", "bf16"): (LinearMode.HIGH_PRECISION, WeightFormat.FP32),
}


@pytest.mark.parametrize(("weights", "activations"), sorted(EXPECTED))
def test_the_recipe_table_gives_linear_mode_and_policy(weights, activations):
    job = TrainJob(weights=weights, activations=activations)
    mode, other = EXPECTED[weights, activations]
    assert job.linear_mode is mode and job.recipe is RECIPES[Weights(weights)]
    policy = job.policy()
    assert policy.other_format is other
    assert policy.linear_weight_format is WeightFormat.MXFP8_E4M3  # used in LinearMode.MXFP8
    assert policy.main_grad_dtype.is_floating_point and policy.main_grad_dtype.itemsize == 4


def test_every_weights_choice_has_a_recipe_for_every_activation_dtype():
    assert set(RECIPES) == set(Weights)
    for recipe in RECIPES.values():
        assert set(recipe.other_format) == set(Activations)


def test_activations_default_by_device():
    assert TrainJob().resolved_activations is Activations.FP32
    assert TrainJob(device="cuda").resolved_activations is Activations.BF16
    assert TrainJob(device="cuda", activations="fp32").resolved_activations is Activations.FP32


def test_the_job_branching_reaches_the_markov_corpus(single_rank_world):
    """``TrainJob.branching`` was recorded in checkpoints and compared on resume, but the corpus
    was always built with 4 successors per token."""
    from apps.training.loop import _Model

    assert _Model(TrainJob(branching=2)).corpus.branching == 2
    assert _Model(TrainJob()).corpus.branching == 4
    with pytest.raises(ValueError, match="branching=0: expected an integer >= 1"):
        TrainJob(branching=0)
