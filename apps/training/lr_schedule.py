"""Learning-rate schedules: a pure ``lr_at(step)`` and a scheduler that applies it.

``ScheduleConfig`` is the whole schedule (frozen, validated); ``lr_at(step)`` is a pure function
of the step index (0-based: the step about to run), so a resumed run at step k continues with
exactly ``lr_at(k)`` and the schedule's only state is the step index:

- **warmup** (``warmup_steps`` W > 0): steps 0 .. W-1 take ``lr * (step + 1) / W`` -- the
  torchtitan / nanoGPT convention without a wasted lr-0 step: step 0 already trains at lr / W,
  step W-1 at the full lr;
- then ``CONSTANT``: ``lr``; ``COSINE``: ``lr - (lr - min_lr) * (1 - cos(pi p)) / 2``;
  ``LINEAR``: ``lr + (min_lr - lr) * p``, where ``p = (step - W) / (total_steps - W)`` runs from 0
  at step W to 1 at step ``total_steps`` (the step after the last one; ``min_lr`` from there on).

``LRScheduler(optimizer, config)`` writes ``lr_at(step)`` into every parameter group of a Torch
optimizer (or of ``FSDPOptimizer``'s inner one) at construction and at each ``step()``, and
saves/loads its step through ``state_dict`` / ``load_state_dict`` (the config comes with it, for
the record). Torch only sets the optimizer's lr: the module itself needs nothing of Torch.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from common.enums import Parseable

__all__ = ["LRSchedule", "LRScheduler", "ScheduleConfig"]


class LRSchedule(Parseable, enum.Enum, what="learning-rate schedule"):
    """The decay after warmup (``--lr-schedule``)."""

    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"ScheduleConfig.{name}={value!r}: expected an integer >= {low}")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """lr: the peak learning rate; warmup_steps: linear warmup length (0: none); total_steps:
    the run's length (decaying schedules reach ``min_lr`` there; None only for CONSTANT)."""

    lr: float
    schedule: LRSchedule = LRSchedule.CONSTANT
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", LRSchedule.parse(self.schedule))
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"ScheduleConfig.lr={self.lr!r}: expected a finite number > 0")
        if not (isinstance(self.min_lr, int | float) and 0 <= self.min_lr <= self.lr):
            raise ValueError(
                f"ScheduleConfig.min_lr={self.min_lr!r}: expected 0 <= min_lr <= lr={self.lr}"
            )
        _check_int("warmup_steps", self.warmup_steps, 0)
        if self.total_steps is not None:
            _check_int("total_steps", self.total_steps, 1)
        if self.schedule is not LRSchedule.CONSTANT and (
            self.total_steps is None or self.total_steps <= self.warmup_steps
        ):
            raise ValueError(
                f"ScheduleConfig: a {self.schedule.value} schedule decays from the end of warmup "
                f"(step {self.warmup_steps}) to total_steps, got total_steps={self.total_steps}; "
                f"pass total_steps > warmup_steps"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based), a pure function (module note)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"ScheduleConfig.lr_at: step={step!r}, expected an integer >= 0")
        w = self.warmup_steps
        if step < w:
            return self.lr * (step + 1) / w
        if self.schedule is LRSchedule.CONSTANT:
            return float(self.lr)
        assert self.total_steps is not None  # __post_init__ requires it for a decaying schedule
        p = min(1.0, (step - w) / (self.total_steps - w))
        if self.schedule is LRSchedule.COSINE:
            # written from lr down, so that step W (p = 0) takes exactly lr, as warmup's last step
            return self.lr - (self.lr - self.min_lr) * 0.5 * (1.0 - math.cos(math.pi * p))
        return self.lr + (self.min_lr - self.lr) * p

    def describe(self) -> dict[str, Any]:
        """JSON-safe fields (checkpoint and metrics records)."""
        out = dataclasses.asdict(self)
        out["schedule"] = self.schedule.value
        return out


class LRScheduler:
    """Applies ``config.lr_at(step)`` to an optimizer: at construction (step ``start``), then
    after each ``step()`` (the next step's lr). ``optimizer``: a ``torch.optim.Optimizer`` or an
    object with one in ``.optimizer`` (``FSDPOptimizer``)."""

    def __init__(self, optimizer: object, config: ScheduleConfig, start: int = 0):
        if not isinstance(config, ScheduleConfig):
            raise TypeError(f"LRScheduler: config={config!r}, expected a ScheduleConfig")
        inner = getattr(optimizer, "optimizer", optimizer)
        if not hasattr(inner, "param_groups"):
            raise TypeError(
                f"LRScheduler: {type(optimizer).__name__} has no param_groups; pass a "
                f"torch.optim.Optimizer or an FSDPOptimizer"
            )
        self.optimizer, self.config = inner, config
        self.set_step(start)

    @property
    def lr(self) -> float:
        """The learning rate of the current step (the one the next optimizer step uses)."""
        return self.config.lr_at(self.last_step)

    def set_step(self, step: int) -> None:
        """Go to step ``step`` (0-based) and write its lr into the optimizer."""
        lr = self.config.lr_at(step)  # validates step
        self.last_step = step
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """The current step is done (applied or skipped): the next step's lr."""
        self.set_step(self.last_step + 1)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.last_step, **self.config.describe()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved step; this scheduler's own config stays in force (as torch's
        schedulers do), so a resume with the same config is bit-exact."""
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                f"LRScheduler.load_state_dict: state {state!r} holds no step (an integer >= 0); "
                f"pass what state_dict() returned"
            )
        self.set_step(step)
