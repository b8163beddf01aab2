"""``TrainJob``: the weights choice through the one recipe table, and what the job builds."""

from __future__ import annotations

import pytest

from apps.training.job import RECIPES, TrainJob, Weights
from common.modes import Activations, LinearMode
from torch_side import WeightFormat

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


def test_the_schedule_and_gather_fields_reach_the_schedule_and_the_policy():
    from apps.training.lr_schedule import LRSchedule
    from common.modes import GatherMode

    job = TrainJob(steps=10, lr=1e-3, lr_schedule="cosine", warmup_steps=2, min_lr=1e-4,
                   grad_clip=1.0, gather="bf16")
    sched = job.schedule()
    assert (sched.schedule, sched.warmup_steps, sched.total_steps, sched.min_lr) == (
        LRSchedule.COSINE, 2, 10, 1e-4)
    assert sched.lr_at(0) == 5e-4 and sched.lr_at(2) == 1e-3
    assert job.policy().gather is GatherMode.BF16 and TrainJob().policy().gather is GatherMode.MXFP8
    control = job.control()  # the fp32 control gathers its fp32 weights as they are
    assert control.weights is Weights.FP32 and control.gather is GatherMode.MXFP8
    assert job.describe()["lr_schedule"] == "cosine" and job.describe()["gather"] == "bf16"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"lr_schedule": "cosine", "warmup_steps": 40}, r"steps=40: .*total_steps > warmup"),
     ({"min_lr": 1.0}, r"min_lr=1.0: expected 0 <= min_lr <= lr"),
     ({"grad_clip": -1.0}, r"grad_clip=-1.0: expected a number >= 0"),
     ({"gather": "bf16", "weights": "fp32"}, r"gather=bf16 with weights=fp32"),
     ({"gather": "fp8"}, r"unknown weight gather mode 'fp8'")],
)
def test_bad_schedule_clip_and_gather_values_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainJob(**kwargs)
