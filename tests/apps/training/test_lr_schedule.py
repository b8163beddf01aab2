"""``apps.training.lr_schedule``: warmup, constant / cosine / linear decay as pure functions of the
step, the scheduler writing them into an optimizer, and its state round trip (no process group)."""

from __future__ import annotations

import math

import pytest
import torch

from apps.training.lr_schedule import LRSchedule, LRScheduler, ScheduleConfig


def test_warmup_is_lr_times_step_plus_one_over_warmup():
    cfg = ScheduleConfig(1e-3, LRSchedule.CONSTANT, warmup_steps=4)
    assert [cfg.lr_at(s) for s in range(6)] == [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    assert ScheduleConfig(0.5).lr_at(0) == 0.5  # no warmup: the full lr from step 0


@pytest.mark.parametrize("kind", [LRSchedule.COSINE, LRSchedule.LINEAR])
def test_decay_runs_from_lr_at_the_end_of_warmup_to_min_lr_at_total_steps(kind):
    cfg = ScheduleConfig(1.0, kind, warmup_steps=2, total_steps=12, min_lr=0.1)
    assert cfg.lr_at(1) == 1.0 and cfg.lr_at(2) == 1.0  # warmup's last step, decay's first
    odd = ScheduleConfig(1e-2, kind, warmup_steps=3, total_steps=6, min_lr=1e-3)
    assert odd.lr_at(3) == 1e-2  # exactly lr (min_lr + (lr - min_lr) was 1 ulp above)
    assert cfg.lr_at(12) == pytest.approx(0.1) and cfg.lr_at(50) == pytest.approx(0.1)
    mid = 0.55 if kind is LRSchedule.LINEAR else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))
    assert cfg.lr_at(7) == pytest.approx(mid)  # halfway: p = 5 / 10
    lrs = [cfg.lr_at(s) for s in range(2, 13)]
    assert lrs == sorted(lrs, reverse=True)  # monotone


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"lr": 0.0}, "lr=0.0"), ({"lr": 1.0, "min_lr": 2.0}, "min_lr=2.0"),
     ({"lr": 1.0, "warmup_steps": -1}, "warmup_steps=-1"),
     ({"lr": 1.0, "schedule": "cosine"}, "total_steps > warmup_steps"),
     ({"lr": 1.0, "schedule": "linear", "warmup_steps": 5, "total_steps": 5},
      "total_steps > warmup_steps"),
     ({"lr": 1.0, "schedule": "exponential"}, "unknown learning-rate schedule")],
)
def test_bad_configs_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(**kwargs)


def test_the_scheduler_sets_each_steps_lr_and_resumes_at_a_saved_step():
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD(params, lr=123.0)
    cfg = ScheduleConfig(1.0, "cosine", warmup_steps=2, total_steps=6)
    sched = LRScheduler(opt, cfg)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        assert sched.lr == seen[-1]
        sched.step()
    assert seen == [cfg.lr_at(s) for s in range(4)]
    state = sched.state_dict()
    assert state["step"] == 4 and state["schedule"] == "cosine" and state["warmup_steps"] == 2
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=7.0)
    resumed = LRScheduler(other, cfg)
    resumed.load_state_dict(state)
    assert other.param_groups[0]["lr"] == cfg.lr_at(4) == opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="holds no step"):
        resumed.load_state_dict({"schedule": "cosine"})
    with pytest.raises(TypeError, match="no param_groups"):
        LRScheduler(object(), cfg)
