"""``benchmarks/bench_train_step.py`` runs end to end on the CPU (one rank, the tiny GPT): the
project's MXFP8 step beside PyTorch FSDP2's, one row each, memory and ratio columns filled; a
``:r`` run (activation recompute) runs the recompute programs and trains as its plain run."""

from __future__ import annotations

import dataclasses
import json

from benchmarks import bench_train_step
from common.model_config import PRESETS


def test_the_step_benchmark_runs_ours_beside_fsdp2_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "step.json"
    bench_train_step.main(["--device", "cpu", "--nproc", "1", "--config", "tiny", "--steps", "1",
                           "--warmup", "1", "--runs", "mxfp8,fsdp2", "--out", str(out)])
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"mxfp8", "fsdp2"}
    assert rows["fsdp2"]["ratio_to_fsdp2"] == 1.0 and rows["mxfp8"]["ratio_to_fsdp2"] > 0
    assert (rows["mxfp8"]["peak_torch_gib"], rows["mxfp8"]["peak_jax_gib"]) == (0.0, 0.0)
    assert "| mxfp8 |" in capsys.readouterr().out


def test_an_unknown_gemm_is_refused_by_name(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench_train_step.main(["--gemm", "fp9"])
    assert "fp9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_train_step.main(["--backend", "nope"])
    assert "nope" in capsys.readouterr().err


def test_a_recompute_run_trains_as_the_plain_run_through_recompute_programs(single_rank_world):
    """``mxfp8:u2:r`` through the benchmark's own run (``_run_one``, in this process: one rank,
    no spawn): the blocks' backward is the recompute program (the trace's spans), and the losses
    are ``mxfp8:u2``'s bit for bit -- the backward runs the same forward program again (equal
    with and without XLA's excess bf16 precision; measured). No precompile: ~4 s less on the
    CPU (the CLI's ``:r`` runs show no compile in their first step after it)."""
    import argparse

    from common import trace

    args = argparse.Namespace(device="cpu", precompile=False, batch_size=4, seq_len=32, warmup=1,
                              steps=1, world_size=1, profile=False, pyprofile=0, gemm="",
                              shared_pool=False)
    rows, spans = {}, {}
    for run in ("mxfp8:u2", "mxfp8:u2:r"):
        with trace.recording(trace.Recorder()) as rec:
            result = bench_train_step._run_one(run, PRESETS["tiny"], args, rank=0)
        rows[run] = dataclasses.asdict(result)
        names = [e["name"] for e in rec.events()]
        spans[run] = {n: names.count(n) for n in ("unit_backward", "unit_recompute_backward")}
    # 2 steps (warm-up, timed), each backward through 2 units: the tiny GPT's 2 blocks as one
    # (recomputing under ':r') and the head with the loss (never: it is no block; TorchGPT's
    # recompute is the blocks', as training's Recompute.BLOCK)
    assert spans["mxfp8:u2:r"] == {"unit_backward": 2, "unit_recompute_backward": 2}
    assert spans["mxfp8:u2"] == {"unit_backward": 2 * 2, "unit_recompute_backward": 0}
    assert len(rows["mxfp8:u2:r"]["losses"]) == 2
    assert rows["mxfp8:u2:r"]["losses"] == rows["mxfp8:u2"]["losses"]
    assert "| mxfp8:u2:r |" in bench_train_step._table(list(rows.values()), args)


def test_the_recompute_suffix_reaches_the_models_units(single_rank_world):
    """The run's model has every block's unit forward in recompute mode (what ``:r`` asks for),
    and the plain run's none."""
    import argparse

    from bridge.units import UnitForward

    args = argparse.Namespace(device="cpu", gemm="")
    for run, want in (("mxfp8:u2:r", True), ("mxfp8:u2", False)):
        model = bench_train_step._build(run, PRESETS["tiny"], args)[0]
        units = [m.forward for m in model.modules() if isinstance(m.forward, UnitForward)]
        assert units and all(u.recompute is want for u in units), run


def test_freed_grad_buckets_reaches_the_models_bucket_pool(single_rank_world):
    """``--freed-grad-buckets N`` sets ``Overlap.freed_grad_buckets`` of this project's runs
    (the sync run's too); unset, Overlap's default."""
    import argparse

    for run, n, want in (("mxfp8:u2", None, 2), ("mxfp8:u2", 0, 0), ("mxfp8-sync", 3, 3)):
        args = argparse.Namespace(device="cpu", gemm="", freed_grad_buckets=n)
        model = bench_train_step._build(run, PRESETS["tiny"], args)[0]
        assert model.allocator.retiring_limit == want, (run, n)


def test_the_streams_suffix_reaches_the_models_communicators(single_rank_world):
    """``:streams`` sends the run's world-size-1 copies through FSDP's communication streams
    (``Overlap.streams_at_world_1``), and touches no unit-program knob; the plain run keeps
    them on the current stream."""
    import argparse

    args = argparse.Namespace(device="cpu", gemm="")
    for run, want in (("mxfp8:u2:streams", True), ("mxfp8:u2", False)):
        model = bench_train_step._build(run, PRESETS["tiny"], args)[0]
        assert model.comms["dp"].streams_at_world_1 is want, run
        assert model.state.overlap.streams_at_world_1 is want, run


def test_fsdps_own_work_runs_on_the_models_kernels(single_rank_world):
    """``--gemm`` / ``--backend`` reach ``fully_shard`` as well as the model (as apps.training
    passes them): FSDP's refresh resolves the same kernels, so with an ``fp8_blocked`` GEMM its
    images start with only their gaps zeroed on a GPU; unset, both take the device default."""
    import argparse

    from common.kernels import KernelConfig

    for gemm, want in (("fp8_blocked", KernelConfig(gemm="fp8_blocked")), ("", None)):
        args = argparse.Namespace(device="cpu", gemm=gemm)
        fsdp = bench_train_step._build("mxfp8:u2", PRESETS["tiny"], args)[0]
        assert fsdp.kernels == want, gemm
        assert all(g.kernels == want for g in fsdp.param_groups), gemm


def test_a_negative_freed_grad_buckets_is_refused_by_name(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench_train_step.main(["--freed-grad-buckets", "-1"])
    assert "freed_grad_buckets must be an int >= 0" in capsys.readouterr().err


def test_recompute_on_a_peer_run_is_refused_by_name(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench_train_step.main(["--runs", "mxfp8:u4:r,fsdp2:r"])
    err = capsys.readouterr().err
    assert "'fsdp2:r'" in err and "drop ':r'" in err and "run 'mxfp8:u4:r'" not in err


def test_a_finished_run_leaves_no_model_behind(single_rank_world, monkeypatch):
    """After ``_run_one`` returns, nothing of its model is alive -- the FSDP model, its groups,
    their main weights: a later run of the same process (and its memory peak) starts from
    nothing of it (the unit programs' path: bindings, grad sinks, shared buffers)."""
    import argparse
    import gc
    import weakref

    refs = []
    build = bench_train_step._build

    def spy(run, cfg, args):
        model, step, timing = build(run, cfg, args)
        refs.extend(weakref.ref(o) for o in (model, *model.param_groups))
        refs.extend(weakref.ref(g.main) for g in model.param_groups)
        return model, step, timing

    monkeypatch.setattr(bench_train_step, "_build", spy)
    args = argparse.Namespace(device="cpu", precompile=False, batch_size=4, seq_len=32, warmup=1,
                              steps=1, world_size=1, profile=False, pyprofile=0, gemm="",
                              shared_pool=False)
    bench_train_step._run_one("mxfp8:u2", PRESETS["tiny"], args, rank=0)
    gc.collect()
    assert len(refs) > 3 and [r for r in refs if r() is not None] == []


def test_a_switched_run_trains_as_the_default_run(single_rank_world, monkeypatch):
    """``mxfp8:u2:qkv1:gelu-in`` (the qkv linear as one GEMM and a split, the GELU inside the
    MLP's second linear) against ``mxfp8:u2:gelu-apart`` (q, k and v from three GEMMs, the GELU
    a pass of its own: ``fp8_blocked`` on the small GPT, whose 128-wide parts are whole tiles):
    the same losses, bit for bit on the CPU; the parts ran in the other run only, the fused
    GELU in the switched run only, the GELU in the GEMM's epilogue (the default, which
    ``GELU_IN_LINEAR`` overrides) in neither (each switch's parsing:
    tests/benchmarks/test_plain_gpt.py; the default's GPT block against the GELU apart:
    tests/jax_side/test_linear_post.py)."""
    import argparse

    import jax

    from jax_side import unit_linear
    from jax_side import unit_program as U
    from models import gpt_math

    for knob, default in bench_train_step.KNOB_DEFAULTS.items():
        monkeypatch.setattr(gpt_math, knob, default)  # restored after the test
    ran: list[str] = []
    real = unit_linear.row_parts
    monkeypatch.setattr(unit_linear, "row_parts",
                        lambda w, n: ran.append("parts") or real(w, n))
    real_pre, real_post = U.unit_linear_pre, U.unit_linear_post
    monkeypatch.setattr(U, "unit_linear_pre", lambda *a: ran.append("gelu") or real_pre(*a))
    monkeypatch.setattr(U, "unit_linear_post", lambda *a: ran.append("post") or real_post(*a))
    jax.clear_caches()
    args = argparse.Namespace(device="cpu", precompile=False, batch_size=2, seq_len=64, warmup=1,
                              steps=1, world_size=1, profile=False, pyprofile=0,
                              gemm="fp8_blocked", shared_pool=False)
    losses, calls = {}, {}
    switched, apart = "mxfp8:u2:qkv1:gelu-in", "mxfp8:u2:gelu-apart"
    for run in (apart, switched):
        ran.clear()
        losses[run] = bench_train_step._run_one(run, PRESETS["small"], args, rank=0).losses
        calls[run] = set(ran)
    jax.clear_caches()
    assert calls[switched] == {"gelu"} and calls[apart] == {"parts"}  # no "post" in either
    assert len(losses[apart]) == 2 and losses[switched] == losses[apart]


def test_the_run_switches_set_the_knobs_and_the_pair_entries_for_their_run(monkeypatch):
    """``_apply_switches``: each knob off for its switch and back on without it, the pair
    entries (``PAIR_CHOICE``) set for ``:pairs`` and removed without it, and whether anything
    changed (the unit programs are then traced anew). The pair calls' bytes equal one call per
    output (tests/jax_side/mxfp8/test_blocked_operands.py), so a ``:pairs`` run trains as the
    default does."""
    import types

    from jax_side.mxfp8 import blocked_operands

    monkeypatch.setattr(blocked_operands, "KERNEL_CONFIG",
                        dict(blocked_operands.KERNEL_CONFIG))  # restored after the test
    knobs = types.SimpleNamespace(QKV_PARTS=True, GELU_IN_LINEAR=False, GELU_IN_GEMM=True)
    apply = bench_train_step._apply_switches
    assert not apply(frozenset(), knobs)
    assert apply(frozenset({"PAIRS", "QKV_PARTS"}), knobs)
    assert (knobs.QKV_PARTS, knobs.GELU_IN_LINEAR) == (False, False)
    pair = blocked_operands.KernelChoice(*bench_train_step.PAIR_CHOICE)
    assert {e: c for e, c in blocked_operands.KERNEL_CONFIG.items() if "+" in e} == {
        "rows+rows_t": pair, "rows+tiles_t": pair}
    assert pair.whole and pair.block == (128, 128)
    assert not apply(frozenset({"PAIRS", "QKV_PARTS"}), knobs)  # already so
    assert apply(frozenset({"GELU_IN_LINEAR"}), knobs)
    assert (knobs.QKV_PARTS, knobs.GELU_IN_LINEAR) == (True, True)
    assert apply(frozenset({"GELU_IN_GEMM"}), knobs)  # ``:gelu-apart`` flips its knob alone
    flipped = not bench_train_step.KNOB_DEFAULTS["GELU_IN_GEMM"]
    assert (knobs.GELU_IN_LINEAR, knobs.GELU_IN_GEMM) == (False, flipped)
    assert apply(frozenset({"GELU_IN_LINEAR"}), knobs)
    assert [e for e in blocked_operands.KERNEL_CONFIG if "+" in e] == []
    config = blocked_operands.KERNEL_CONFIG  # ``:packed`` flips the transposed outputs' packing
    default = {e: config[e] for e in bench_train_step.TRANSPOSED}
    assert apply(frozenset({"GELU_IN_LINEAR", "PACKED"}), knobs)
    assert {e: config[e] for e in default} == {e: c._replace(packed=not c.packed)
                                               for e, c in default.items()}
    assert not apply(frozenset({"GELU_IN_LINEAR", "PACKED"}), knobs)  # already so
    assert apply(frozenset({"GELU_IN_LINEAR"}), knobs)
    assert {e: config[e] for e in default} == default
    assert apply(frozenset({"PAIRS", "PACKED"}), knobs)  # pairs from row-strided quarters
    packed_pair = blocked_operands.KernelChoice(*bench_train_step.PACKED_PAIR_CHOICE)
    assert packed_pair.packed and not packed_pair.whole
    assert {e: c for e, c in config.items() if "+" in e} == {
        "rows+rows_t": packed_pair, "rows+tiles_t": packed_pair}
    assert all(config[e].packed for e in default)
    assert apply(frozenset({"GIVEN"}), knobs)  # ``:given``: their scales from the rows' call
    assert {e: config[e] for e in default} == {e: c._replace(given=not c.given)
                                               for e, c in default.items()}
    assert [e for e in config if "+" in e] == []
    assert not apply(frozenset({"GIVEN"}), knobs)  # already so
    assert apply(frozenset(), knobs)
    assert {e: config[e] for e in default} == default
    from jax_side.mxfp8 import cublaslt  # ``:graphs``: the cuBLASLt calls in command buffers

    monkeypatch.setattr(cublaslt, "COMMAND_BUFFERS", False)  # restored after the test
    assert apply(frozenset({"COMMAND_BUFFERS"}), knobs) and cublaslt.COMMAND_BUFFERS
    assert not apply(frozenset({"COMMAND_BUFFERS"}), knobs)  # already so
    assert apply(frozenset(), knobs) and not cublaslt.COMMAND_BUFFERS
