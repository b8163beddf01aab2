"""``--telemetry-every N`` and the telemetry's per-step cost (in-process, one gloo rank, the tiny
GPT): only the steps whose index is a multiple of N carry ``telemetry``, changed blocks count
since the previous recorded step, the amax observer does nothing on the other steps; a
``collect()`` is a fixed handful of Torch calls per group and plane with ONE device-to-host copy,
and an observed refresh a fixed handful per group, whatever the number of parameters."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from apps.training.job import RunOptions, TrainJob
from apps.training.loop import Trainer

JOB = TrainJob(steps=4, micro_batches=1, batch_size=2, seq_len=32, eval_batches=1, seed=2)


class _Calls(TorchFunctionMode):
    """Counts the Torch calls (functions and tensor methods) made under it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _scale_bytes(tel) -> torch.Tensor:
    return torch.cat([g.scale_buffers[p] for g in tel.groups for p in g.planes])


@pytest.mark.slow  # ~30 s (compiles the tiny GPT)
def test_every_second_step_is_recorded_and_the_others_cost_nothing(single_rank_world):
    opts = RunOptions(progress=False, precompile=False, telemetry=True, telemetry_every=2)
    with Trainer(JOB, opts) as t:
        tel, seen = t.instruments.telemetry, {}
        extra = t.instruments.after_update
        t.instruments.after_update = lambda: seen.setdefault(t.done, extra())
        start = _scale_bytes(tel).clone()
        for step in range(4):
            t.step()
            assert not tel._headroom  # collected (steps 0, 2), or never summarised (1, 3)
            if step % 2:
                assert "telemetry" not in seen[step] and "telemetry_s" not in seen[step]
                continue
            groups = seen[step]["telemetry"]
            got = sum(p["changed_blocks"] for planes in groups.values() for p in planes.values())
            assert got == int((_scale_bytes(tel) != start).sum()) > 0  # since the last record
            assert all(p["headroom_bits"] is not None
                       for planes in groups.values() for p in planes.values())
            start = _scale_bytes(tel).clone()


@pytest.mark.slow  # ~30 s alone (compiles the tiny GPT)
def test_a_collect_is_a_few_calls_per_group_and_one_host_copy(single_rank_world):
    with Trainer(JOB, RunOptions(progress=False, precompile=False, telemetry=True)) as t:
        t.step()
        tel = t.instruments.telemetry
        g = max(tel.groups, key=lambda g: len(g.layout.slots))
        packed = torch.rand(2 * sum(s.numel for s in g.layout.slots) // 32)
        with _Calls() as observe:
            tel._observe(g, packed)
        with _Calls() as collect:
            tel.collect()
    rows = sum(len(g.planes) for g in tel.groups)
    assert len(g.layout.slots) >= 2
    assert len(observe.names) <= 30, observe.names  # was ~15 per parameter and plane
    assert len(collect.names) <= 12 * rows + 30, collect.names
    assert collect.names.count("cpu") == 1 and "item" not in collect.names, collect.names


def test_telemetry_every_must_be_positive():
    with pytest.raises(ValueError, match=r"RunOptions.telemetry_every=0: expected an integer"):
        RunOptions(telemetry_every=0)
