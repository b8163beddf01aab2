"""``mxfp8-train``: option checking, the job it builds, and a run under torchrun (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from apps.training import cli
from apps.training.job import TrainJob

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "nan"], "expected a finite number > 0, got 'nan'"),
        (["--lr", "0"], "expected a finite number > 0"),
        (["--steps", "0"], "expected a finite number > 0"),
        (["--seed", "-1"], "expected an integer >= 0"),
        (["--save-every", "5"], "--save-every needs --save-dir"),
        (["--compare", "--resume", "x"], "--compare runs two trainings"),
        (["--config", "huge"], "invalid choice"),
        (["--plot", "c.png"], "--plot needs --metrics"),
        # flags that did nothing without another one (the run went on as if not given)
        (["--digest"], "--digest would do nothing here: its hashes go into the --metrics"),
        (["--telemetry"], "--telemetry would do nothing here: the MXFP8 numerics go into"),
        (["--metrics", "m.jsonl", "--telemetry-every", "5"],
         "--telemetry-every would do nothing here: it sets the steps --telemetry records"),
        (["--trace-steps", "3"], "--trace-steps would do nothing here: it sets how many steps"),
        (["--max-consecutive-skips", "3"], "add --on-nonfinite skip"),
        (["--no-progress", "--progress-every", "5"], "--progress-every would do nothing here"),
        (["--replicas", "3"], "--replicas 3 must divide the world size 2"),
        (["--replicas", "0"], "expected a finite number > 0"),
        (["--shared-pool"], "--shared-pool is a CUDA memory pool: use it with --device cuda"),
    ],
)
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_training(monkeypatch, capsys):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--metrics", "m.jsonl", "--plot", "c.png"])
    assert e.value.code == 2
    assert "--plot needs matplotlib, which is not installed" in capsys.readouterr().err
    cli.parse_args(["--metrics", "m.jsonl"])  # no --plot: matplotlib is not needed


def test_a_broken_matplotlib_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """One that is installed but fails to import failed only when the plot was drawn, after
    the whole training."""
    broken = tmp_path / "site" / "matplotlib"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libfreetype.so.6: cannot open')\n")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--metrics", str(tmp_path / "m.jsonl"), "--plot", str(tmp_path / "c.png")])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "--plot needs matplotlib, which fails to import here (ImportError: libfreetype" in err


def test_outputs_that_cannot_be_written_are_refused_before_training(tmp_path, capsys):
    """A trace, metrics file or figure at a path that is a directory, or under a file, failed
    after the training (the trace after its steps, the figure at the very end)."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    d, f = str(tmp_path / "dir"), str(tmp_path / "file")
    cases = [
        (["--nproc", "1", "--trace", d], f"--trace: {d!r} is an existing directory"),
        (["--trace", d], f"--trace: {d!r} is an existing directory"),  # 2 ranks: d.rank<r>
        (["--trace", f + "/t.json"], f"--trace: {f!r} is a file, so {f + '/t.json'!r} cannot"),
        (["--metrics", d], f"--metrics: {d!r} is an existing directory"),
        (["--metrics", d + "/m.jsonl", "--plot", d], f"--plot: {d!r} is an existing directory"),
        (["--metrics", d + "/m.jsonl", "--plot", f + "/x/c.png"], "--plot: "),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            cli.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, (argv, err)
    args = cli.parse_args(["--trace", d + "/new/t.json", "--metrics", d + "/new/m.jsonl"])
    assert args.trace == d + "/new/t.json"  # missing directories are created by the writers


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_in_a_read_only_directory_is_refused(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(SystemExit):
        cli.parse_args(["--trace", str(ro / "t.json")])
    assert f"no permission to create {str(ro / 't.json')!r}" in capsys.readouterr().err


def test_telemetry_of_a_run_without_mxfp8_weights_is_refused(capsys):
    """``--plot --telemetry --weights fp32`` trained, then failed to draw: "no step record
    carries telemetry" (an fp32 or bf16 run has no MXFP8 weights to record)."""
    for weights in ("fp32", "bf16"):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(["--weights", weights, "--telemetry", "--metrics", "m.jsonl"])
        assert e.value.code == 2
        assert f"--weights {weights} has none" in capsys.readouterr().err
    cli.parse_args(["--telemetry", "--metrics", "m.jsonl", "--compare"])  # mxfp8 + control


def test_a_learning_rate_that_overflows_adamw_is_refused_before_training(monkeypatch, capsys):
    """``--lr 1e38``: AdamW's first step divides it by 1 - beta1 = 0.1, beyond float32, and the
    run died at step 0 with a traceback from inside torch.optim ("value cannot be converted to
    type float without overflow")."""
    import torch_side.launch

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr(torch_side.launch, "run_local_ranks", no_launch)
    assert cli.main(["--lr", "1e38"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mxfp8-train: error: TrainJob.lr=1e+38: AdamW's first step divides "
                          "the learning rate by 1 - beta1 = 0.1, over the float32 maximum"), err
    assert "expected lr <= 3.4e+37" in err
    assert TrainJob(lr=3.4e37).lr == 3.4e37  # the largest rates are still accepted


def test_defaults_are_the_embedded_cpu_demo():
    args = cli.parse_args([])
    assert (args.device, args.nproc, args.config, args.weights) == ("cpu", 2, "tiny", "mxfp8")
    runs = cli._runs(cli.parse_args(["--compare", "--metrics", "out/run.jsonl"]))
    assert [label for label, _, _ in runs] == ["mxfp8", "fp32"]
    assert runs[1][2].metrics == str(Path("out/run.fp32.jsonl"))
    assert runs[0][1] == TrainJob()  # the CLI's defaults are the job's defaults


def test_job_validation():
    with pytest.raises(ValueError, match=r"lr=nan: expected a finite learning rate"):
        TrainJob(lr=float("nan"))
    with pytest.raises(ValueError, match="seq_len=100 exceeds max_seq_len=64"):
        TrainJob(seq_len=100)
    with pytest.raises(ValueError, match="config='huge'"):
        TrainJob(config="huge")
    with pytest.raises(ValueError, match="steps=0: expected an integer >= 1"):
        TrainJob(steps=0)
    assert TrainJob(device="cuda").resolved_activations.value == "bf16"
    assert TrainJob().policy().other_format.value == "fp32"
    assert TrainJob(device="cuda").policy().other_format.value == "bf16"
    assert TrainJob(weights="bf16").policy().other_format.value == "bf16"


@pytest.mark.slow
def test_the_command_under_torchrun_with_gloo_on_a_directory_of_text(tmp_path):
    """torchrun's rendezvous, a text directory, --plot, and HSDP (--replicas 2)."""
    data = tmp_path / "text"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 3000)
    (data / "sub" / "b.md").write_text("# notes\n" + "pack my box with five dozen jugs\n" * 3000)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun is installed with torch"
    metrics = tmp_path / "run.jsonl"
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "apps.training",
         "--data", str(data), "--steps", "3", "--batch-size", "2", "--micro-batches", "1",
         "--metrics", str(metrics), "--plot", str(tmp_path / "run.png"), "--no-progress",
         "--replicas", "2"],  # HSDP: 2 replicas of one shard
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT),
             "MXFP8_JAX_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out loss" in out.stdout and "vocab 256" in out.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[0]["world_size"] == 2 and records[0]["job"]["data"] == str(data)
    assert records[0]["mesh"] == [2, 1]  # (replicas, shards)
    assert [r["step"] for r in records if r["kind"] == "step"] == [0, 1, 2]
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((tmp_path / "cache").iterdir()), "the persistent compilation cache was not written"


def test_a_text_corpus_too_small_is_refused_before_ranks_start(tmp_path, monkeypatch, capsys):
    import torch_side.launch

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr(torch_side.launch, "run_local_ranks", no_launch)
    small = tmp_path / "small.txt"
    small.write_text("y" * 60_000)
    assert cli.main(["--data", str(small), "--seq-len", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"mxfp8-train: error: corpus {str(small)!r} is too small for seq_len=64" in err, err
    assert "train 60,000, heldout 0 bytes" in err, err
    assert cli.main(["--data", str(tmp_path / "gone.txt")]) == 2  # a missing path: early too
    assert "gone.txt' is neither a known name nor an existing path" in capsys.readouterr().err


def test_the_training_loop_checks_the_corpus_before_building_the_model(tmp_path):
    from apps.training.loop import _Model

    small = tmp_path / "small.txt"
    small.write_text("z" * 1000)
    with pytest.raises(ValueError, match="too small for seq_len=32"):
        _Model(TrainJob(data=str(small)))  # before fully_shard: no process group needed


def test_nonfinite_options_reach_the_run_options():
    runs = cli._runs(cli.parse_args(["--on-nonfinite", "skip", "--max-consecutive-skips", "3",
                                     "--compare"]))
    assert {(o.on_nonfinite.value, o.max_consecutive_skips) for _, _, o in runs} == {("skip", 3)}
    assert cli._runs(cli.parse_args([]))[0][2].on_nonfinite.value == "stop"


@pytest.mark.slow
def test_a_diverged_run_exits_nonzero_naming_the_step(tmp_path):
    """``mxfp8-train --lr 1e5`` used to train on NaN, exit 0 and leave ``latest`` naming a
    checkpoint of NaN weights."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MXFP8_JAX_CACHE": "off"}
    done = subprocess.run(
        [sys.executable, "-m", "apps.training", "--lr", "1e5", "--nproc", "1", "--steps", "8",
         "--micro-batches", "1", "--batch-size", "2", "--no-progress", "--no-precompile",
         "--save-dir", str(tmp_path / "ckpt"), "--save-every", "1",
         "--metrics", str(tmp_path / "m.jsonl")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    stopped = [r for r in lines if r.get("outcome") == "stopped"]
    assert len(stopped) == 1, lines
    k = stopped[0]["step"]
    assert f"mxfp8-train: error: mxfp8: step {k}: non-finite training (loss " in done.stderr
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "ckpt").glob("step_*"))
    assert saved and max(saved) <= k, (k, saved)


def test_help_and_refused_flags_import_no_framework():
    """``mxfp8-train --help`` took 3.6 s of CPU: the parser's module imported torch, and with it
    JAX. Now the parser, and the checks that refuse a flag or a combination, import neither (nor
    numpy): measured 0.06 s for --help against 1.9 s before on this machine."""
    code = textwrap.dedent("""
        import contextlib, io, json, sys
        from apps.training import cli
        codes = []
        for argv in (["--help"], ["--steps", "0"], ["--gather", "bf16", "--weights", "fp32"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    codes.append(cli.main(argv))
                except SystemExit as e:
                    codes.append(e.code)
        loaded = [m for m in ("torch", "jax", "jaxlib", "numpy") if m in sys.modules]
        print(json.dumps([codes, loaded]))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == [[0, 2, 2], []]


@pytest.mark.slow
def test_a_refused_checkpoint_is_a_clear_error_not_a_traceback(tmp_path):
    """A CheckpointError is raised on every rank alike: the command prints it and exits 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MXFP8_JAX_CACHE": "off"}
    done = subprocess.run(
        [sys.executable, "-m", "apps.training", "--nproc", "1", "--steps", "2", "--no-progress",
         "--resume", str(tmp_path / "nowhere")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    missing = tmp_path / "nowhere"
    assert f"mxfp8-train: error: mxfp8: rank 0: checkpoint {missing} does not exist" in (
        done.stderr), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_shared_pool_refuses_another_allocator_before_any_rank_starts(monkeypatch, capsys):
    """``--shared-pool`` with the environment asking JAX for another allocator: refused by name
    (exit status 2) before anything starts, nothing set."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert cli.main(["--device", "cuda", "--shared-pool", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "mxfp8-train: error: use_shared_pool: XLA_PYTHON_CLIENT_ALLOCATOR='platform'" in err
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
