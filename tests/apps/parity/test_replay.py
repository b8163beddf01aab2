"""Multi-step cross-framework replay (``apps.parity.replay``): Torch FSDP + torch.optim.AdamW vs
the Flax twin + its AdamW, byte for byte per step.

- the Flax AdamW is Torch's ``foreach=False`` arithmetic (every moment and weight byte-equal,
  both lerp branches, weight decay, tensors of any size);
- 3 steps bit-identical at world size 1 under unit compute (fp32 and bf16 activations), from a
  seed and from a checkpoint of the training app;
- a deliberate difference (another lr on the Flax side, a flipped bit in one moment) is named at
  the right step and tensor; XLA's sqrt (correctly rounded, Torch's CPU one is not) at step 1;
- bad input is refused with a clear message.

Every replay runs in this process (a one-rank gloo group) on batches of one shape, so the JAX
programs compile once for the module.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from apps.parity.bytes_compare import Kind
from apps.parity.flax_adamw import AdamWConfig, AdamWState, Sqrt, adamw_step, init_state
from apps.parity.replay import FlaxState, replay
from apps.parity.replay_state import ReplaySetup, setup_from_checkpoint
from common.model_config import TINY
from torch_side.checkpoint.sharded_files import CheckpointError

SETUP = ReplaySetup(TINY, steps=3, batch_size=2, seq_len=32, adamw=AdamWConfig(weight_decay=0.1))
_CACHE: dict = {}


def _replay(setup: ReplaySetup = SETUP, perturb=None):
    from apps.parity.replay import replay_on_rank

    if perturb is not None:
        return replay_on_rank(setup, perturb=perturb)
    if setup not in _CACHE:
        _CACHE[setup] = replay(setup)
    return _CACHE[setup]


# ------------------------------------------------------------------------ the Flax AdamW alone


@pytest.mark.parametrize("hp", [AdamWConfig(lr=3e-3, weight_decay=0.1),
                                AdamWConfig(lr=1e-2, betas=(0.3, 0.95))],  # lerp's other branch
                         ids=["wd", "large-lerp-weight"])
def test_flax_adamw_is_torch_adamw_byte_for_byte(hp):
    rng = np.random.default_rng(1)
    shapes = {"big": (4099,), "matrix": (96, 64), "tiny": (5,)}  # vector bodies and tails
    start = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    tp = {n: torch.nn.Parameter(torch.from_numpy(p.copy())) for n, p in start.items()}
    opt = torch.optim.AdamW(list(tp.values()), foreach=False, **hp.torch_kwargs())
    params = {n: jnp.asarray(p) for n, p in start.items()}
    state = init_state(params)
    for _ in range(4):
        grads = {n: (rng.standard_normal(s) * 10.0 ** rng.integers(-6, 1)).astype(np.float32)
                 for n, s in shapes.items()}
        for n, t in tp.items():
            t.grad = torch.from_numpy(grads[n])
        opt.step()
        params, state = adamw_step(params, {n: jnp.asarray(g) for n, g in grads.items()},
                                   state, hp, Sqrt.TORCH)
        for n, t in tp.items():
            torch_state = opt.state[t]
            for mine, theirs in ((params[n], t), (state.exp_avg[n], torch_state["exp_avg"]),
                                 (state.exp_avg_sq[n], torch_state["exp_avg_sq"])):
                assert np.asarray(mine).tobytes() == theirs.detach().numpy().tobytes(), n
    assert state.step == 4


# ---------------------------------------------------------------------------------- replays


@pytest.fixture(scope="module")
def world(single_rank_world):
    return None


@pytest.mark.slow  # ~20 s on 2 cores (fast-suite budget)
def test_three_unit_steps_are_bit_identical(world):
    r = _replay()
    assert [s.step for s in r.steps] == [1, 2, 3] and r.world_size == 1 and r.start_step == 0
    assert r.first_divergence is None, r.format()
    assert r.verdict().startswith("verdict: 3 step(s) bit-identical"), r.verdict()
    assert len({s.torch_loss for s in r.steps}) == 3  # the model trains: three different losses


@pytest.mark.slow  # compiles the bf16 programs (~15 s)
def test_three_unit_steps_are_bit_identical_with_bf16_activations(world):
    r = _replay(dataclasses.replace(SETUP, activations="bf16"))
    assert r.first_divergence is None, r.format()


def test_another_lr_on_the_flax_side_diverges_at_the_first_main_weight(world):
    r = _replay(dataclasses.replace(SETUP, flax_adamw=AdamWConfig(lr=2e-3, weight_decay=0.1)))
    step, first = r.first_divergence
    assert step.step == 1 and first.kind is Kind.MAIN and first.name == "wte.weight", r.format()
    assert step.mismatches[0] == first and not any(
        m.kind in (Kind.LOSS, Kind.GRAD, Kind.EXP_AVG, Kind.EXP_AVG_SQ) for m in step.mismatches)
    assert "diverge at step 1 (of 3), layer wte, main wte.weight" in r.verdict()


def test_a_flipped_bit_in_one_moment_is_named_at_its_step_and_tensor(world):
    name = "h_1.attn.proj.weight"

    def flip(state: FlaxState) -> FlaxState:
        m = np.array(state.adamw.exp_avg[name])
        m.view(np.uint32)[3, 5] ^= 1 << 30  # the moments start at zero: this element now 2.0
        moments = {**state.adamw.exp_avg, name: jnp.asarray(m)}
        return state._replace(adamw=AdamWState(state.adamw.step, moments,
                                               state.adamw.exp_avg_sq))

    r = _replay(perturb=flip)
    step, first = r.first_divergence
    assert step.step == 1 and (first.kind, first.name) == (Kind.MAIN, name), r.format()
    assert first.differing == 1
    assert "layer h_1.attn.proj" in r.verdict()


def test_xla_sqrt_differs_from_torch_cpu_sqrt_after_the_first_update(world):
    """Torch's CPU sqrt (MKL VML, not correctly rounded) vs jnp.sqrt: the loss and gradients of
    step 1 agree, its update does not (the reason ``Sqrt.TORCH`` exists)."""
    torch_sqrt = torch.from_numpy(np.arange(1, 4097, dtype=np.float32)).sqrt().numpy()
    if np.array_equal(torch_sqrt, np.sqrt(np.arange(1, 4097, dtype=np.float32))):
        pytest.skip("this Torch build's CPU sqrt is correctly rounded")
    r = _replay(dataclasses.replace(SETUP, sqrt=Sqrt.XLA))
    step, first = r.first_divergence
    assert step.step == 1 and first.kind is Kind.MAIN, r.format()


def _one_step_saved(job, save_dir):
    """A ``_Model`` of ``job`` after one AdamW step, saved as step 1 into ``save_dir``."""
    from apps.training.checkpoint import CheckpointSaver
    from apps.training.data import DataPosition
    from apps.training.loop import _Model

    m = _Model(job)
    tokens = torch.randint(0, m.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    m.fsdp(tokens, tokens).backward()
    m.opt.step()
    with CheckpointSaver.start(save_dir) as saver:
        saver.save(step=1, fsdp=m.fsdp, opt=m.opt, position=DataPosition(2), job=job.describe(),
                   data_digest=m.corpus.content_digest())
    return m


@pytest.mark.slow
def test_a_training_checkpoint_replays_bit_identically(world, tmp_path):
    """mxfp8-train's model after one AdamW step, saved by its CheckpointSaver: the replay starts
    from its main weights, moments and step count."""
    from apps.training.job import TrainJob

    job = TrainJob(steps=1, micro_batches=1, batch_size=2, seq_len=32, seed=3, weight_decay=0.1)
    m = _one_step_saved(job, tmp_path)
    setup = setup_from_checkpoint(tmp_path, steps=2, batch_size=2, seq_len=32)
    assert setup.adamw == AdamWConfig(lr=job.lr, weight_decay=0.1) and setup.cfg == m.cfg
    r = _replay(setup)
    assert r.start_step == 1 and r.first_divergence is None, r.format()


@pytest.mark.slow
def test_a_bf16_training_checkpoint_replays_as_the_high_precision_control(world, tmp_path):
    """A ``--weights bf16`` run saves its AdamW step count under its groups' labels
    (``<root>/bf16/dp``), which the twin's fp32 groups do not have: it was refused ("names no
    parameter group of this optimizer"). It replays from its fp32 main weights and moments."""
    from apps.parity.replay_state import build_torch, optimizer_step_count
    from apps.training.job import TrainJob

    job = TrainJob(weights="bf16", steps=1, micro_batches=1, batch_size=2, seq_len=32, seed=3)
    m = _one_step_saved(job, tmp_path)
    assert {g.label for g in m.opt.groups} >= {"<root>/bf16/dp"}
    setup = setup_from_checkpoint(tmp_path, steps=1, batch_size=2, seq_len=32)
    assert setup.mode.value == "high_precision"
    side = build_torch(setup)
    assert optimizer_step_count(side.opt) == 1
    saved, loaded = m.fsdp.full_state_dict(), side.fsdp.full_state_dict()
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)
    r = _replay(setup)
    assert r.start_step == 1 and r.first_divergence is None, r.format()


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("steps", [0, -1])
def test_a_replay_of_fewer_than_one_step_is_refused(steps):
    with pytest.raises(ValueError, match=f"ReplaySetup.steps={steps}: replay at least one step"):
        ReplaySetup(TINY, steps=steps)


def _meta(step_dir, **job_changes):
    """A step directory whose meta.json holds a tiny MXFP8 job, edited by ``job_changes``
    (None: the field removed). Only meta.json: enough for ``setup_from_checkpoint``."""
    job = {"config": "tiny", "weights": "mxfp8", "activations": "fp32", "lr": 3e-3,
           "weight_decay": 0.0}
    job.update(job_changes)
    step_dir.mkdir()
    meta = {"job": {k: v for k, v in job.items() if v is not None}, "optimizer": "AdamW",
            "params": {"wte.weight": [128, 64]}}
    (step_dir / "meta.json").write_text(json.dumps(meta))
    return step_dir


@pytest.mark.parametrize(("change", "message"), [
    ({"config": None}, "job field 'config' holds None, expected one of ['tiny'"),
    ({"config": "huge"}, "job field 'config' holds huge, expected one of ['tiny'"),
    ({"weights": "fp8"}, "job field 'weights' holds fp8, expected one of ['mxfp8', 'bf16'"),
    ({"activations": None}, "job field 'activations' holds None, expected one of ['fp32'"),
    ({"lr": "fast"}, "job field 'lr' holds fast, expected a finite number > 0"),
    ({"lr": 0}, "job field 'lr' holds 0, expected a finite number > 0"),
    ({"weight_decay": [1]}, "job field 'weight_decay' holds [1], expected a finite number >= 0"),
])
def test_an_edited_checkpoint_job_is_refused_naming_the_field(tmp_path, change, message):
    """A ``meta.json`` whose job lacks a field (or holds a bad one) raised a bare KeyError."""
    step_dir = _meta(tmp_path / "step_000001", **change)
    with pytest.raises(CheckpointError) as e:
        setup_from_checkpoint(step_dir)
    assert str(e.value).startswith(f"{step_dir / 'meta.json'}: {message}"), str(e.value)
    assert "restore it, or replay another step_* directory" in str(e.value)
    assert setup_from_checkpoint(_meta(tmp_path / "good")).adamw.lr == 3e-3  # unedited: read


def test_a_missing_checkpoint_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointError, match="no-such: no such directory; pass the --save-dir"):
        setup_from_checkpoint(tmp_path / "no-such")
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        setup_from_checkpoint(tmp_path)  # exists, but holds no checkpoint


# ------------------------------------------------------------ the unit-compute parity report


def test_the_unit_report_is_bit_identical_at_world_size_1():
    from apps.parity.unit_report import unit_parity_report

    r = unit_parity_report(TINY, seed=0, batch_size=2, seq_len=32)
    assert r.identical, r.format()
    assert dict(r.compared) == {Kind.LOSS: 1, Kind.GRAD: 21}
    assert r.verdict() == "verdict: all 22 compared tensors bit-identical (loss, every gradient)"


def test_the_unit_report_under_fsdp_compares_the_gathered_planes_too(ranks_in_threads):
    from apps.parity.unit_report import unit_parity_report

    r = unit_parity_report(TINY, seed=0, batch_size=2, seq_len=32, world_size=2)
    assert ranks_in_threads == [2]
    assert r.identical and r.world_size == 2, r.format()
    assert dict(r.compared)[Kind.PLANES] == len(TINY.linear_shapes())
