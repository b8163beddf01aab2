"""``mxfp8-train`` (= ``python -m apps.training``): train a GPT with Torch FSDP + JAX MXFP8 GEMMs.

    mxfp8-train                                   # CPU, 2 gloo ranks it spawns, tiny GPT, MXFP8
    mxfp8-train --compare                         # ... and the same run with fp32 linears
    mxfp8-train --data stdlib --config small --steps 200 --metrics runs/s.jsonl --plot runs/s.png
    mxfp8-train --save-dir ckpt --save-every 20 ; mxfp8-train --resume ckpt --steps 80
    mxfp8-train --metrics a.jsonl --telemetry --digest --plot a.png  # + a.telemetry.png
    mxfp8-digest-diff a.jsonl b.jsonl             # first step/group/tensor where runs differ
    torchrun --nproc_per_node 2 -m apps.training --device cuda --config gpt2-124m --data stdlib

Without torchrun the command spawns ``--nproc`` local ranks itself (``torch_side.launch``); under
torchrun (its environment variables are set) it is one rank of torchrun's job, on one GPU per
process with ``--device cuda`` (``LOCAL_RANK`` picks it), so it runs across nodes the way torchrun
jobs do. Guide: docs/training.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from apps.training.job import RunOptions, TrainJob, Weights
from apps.training.options import Group, add_options, from_args, option, positive
from apps.training.output_path import unwritable_reason

if TYPE_CHECKING:  # imported where used: it starts torch
    from apps.training.loop import TrainResult

Runs = list[tuple[str, TrainJob, RunOptions]]  # (label, job, options) of each training

__all__ = ["Launch", "build_parser", "main", "parse_args"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Launch:
    """The command's own options: how it starts the ranks, and what it does besides training
    (the rest of the flags are ``TrainJob``'s and ``RunOptions``' fields)."""

    nproc: int | None = option(
        None, Group.WHERE, parse=positive(int),
        help="ranks to spawn locally (default 2 on cpu, 1 on cuda); not under torchrun")
    timeout: float | None = option(
        None, Group.WHERE, parse=positive(float),
        help="seconds before a local launch is stopped (stalled ranks are named)")
    shared_pool: bool = option(  # common.shared_pool, bridge.memory_pool
        False, Group.WHERE,
        help="Torch and JAX allocate GPU memory from one CUDA pool (cudaMallocAsync), so what "
             "one frees the other reuses: the unit programs' residuals and the main grads share "
             "memory (GPT 1.3B on one H200: 32.3 GiB at the peak instead of 38.4; "
             "docs/fsdp.md). --device cuda only")
    compare: bool = option(False, Group.OUTPUTS,
                           help="also run the fp32-linear control with the same seed and data")
    plot: str | None = option(None, Group.OUTPUTS,
                              help="PNG of the loss curves, drawn at the end")


def build_parser() -> argparse.ArgumentParser:
    """One flag per field of ``Launch``, ``TrainJob`` and ``RunOptions`` (``add_options``)."""
    p = argparse.ArgumentParser(
        prog="mxfp8-train", description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2],
    )
    add_options(p, TrainJob, Launch, RunOptions)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if under_torchrun() and args.nproc is not None:
        p.error("--nproc is for local launches; under torchrun use --nproc_per_node")
    if args.save_every and not args.save_dir:
        p.error("--save-every needs --save-dir")
    if args.compare and (args.resume or args.save_dir):
        p.error("--compare runs two trainings; use it without --resume / --save-dir")
    _refuse_idle_flags(p, args)
    if args.telemetry and args.weights != Weights.MXFP8.value:
        p.error(f"--telemetry records the numerics of MXFP8 weights, and --weights "
                f"{args.weights} has none (its records would carry no telemetry); use --weights "
                f"mxfp8 (with --compare for the fp32 control), or drop --telemetry")
    if args.shared_pool and args.device != "cuda":
        p.error("--shared-pool is a CUDA memory pool: use it with --device cuda")
    if args.nproc is None:
        args.nproc = 2 if args.device == "cpu" else 1
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    if world % args.replicas:
        p.error(f"--replicas {args.replicas} must divide the world size {world} (each replica is "
                f"sharded over world / replicas ranks); use --nproc (or torchrun's ranks) a "
                f"multiple of it")
    if args.plot:  # checked now, not after a training that has nothing to draw it with
        if not args.metrics:
            p.error("--plot needs --metrics (the curves are drawn from the metrics file)")
        _check_matplotlib(p)
    for flag, path in _outputs(args):
        if (why := unwritable_reason(path)) is not None:
            p.error(f"{flag}: {why}")
    return args


def _check_matplotlib(p: argparse.ArgumentParser) -> None:
    """--plot draws with matplotlib after training: import it now, as ``apps.training.plot``
    will (a broken install fails here, not after the run)."""
    if importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib, which is not installed; pip install matplotlib, "
                "or drop --plot (mxfp8-plot draws a --metrics file later)")
    try:
        importlib.import_module("matplotlib.backends.backend_agg")
    except Exception as e:  # whatever a broken install raises; the message names it
        p.error(f"--plot needs matplotlib, which fails to import here ({type(e).__name__}: "
                f"{e}); repair it (pip install --force-reinstall matplotlib), or drop --plot "
                f"(mxfp8-plot draws a --metrics file later)")


def _outputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, path) of every file the command writes besides checkpoints: every rank's trace,
    the metrics (and the --compare control's), the figures."""
    out = []
    if args.trace:  # PATH itself too: a directory there is a mistake at any world size
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
        traced = RunOptions(trace=args.trace)
        paths = dict.fromkeys([args.trace, *(traced.trace_path(r, world) for r in range(world))])
        out += [("--trace", path) for path in paths]
    if args.metrics:
        out.append(("--metrics", args.metrics))
        if args.compare:
            out.append(("--metrics (the --compare control's)", result_path(args.metrics, "fp32")))
    if args.plot:
        out.append(("--plot", args.plot))
        if args.telemetry:
            out.append(("--plot (its telemetry figure)", str(_telemetry_figure(args.plot))))
    return out


def _telemetry_figure(plot: str) -> Path:
    """Where --plot a.png --telemetry draws the telemetry: a.telemetry.png."""
    return Path(plot).with_suffix(".telemetry.png")


def _refuse_idle_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A flag whose output or effect goes through another flag does nothing without it: the
    run would go on as if it were not given. Refused instead, naming what to add."""
    def given(dest: str) -> bool:
        return getattr(args, dest) != p.get_default(dest)

    idle = (
        ("--digest", given("digest") and not args.metrics,
         "its hashes go into the --metrics step records: add --metrics PATH"),
        ("--telemetry", given("telemetry") and not args.metrics,
         "the MXFP8 numerics go into the --metrics step records: add --metrics PATH"),
        ("--telemetry-every", given("telemetry_every") and not args.telemetry,
         "it sets the steps --telemetry records: add --telemetry (and --metrics PATH)"),
        ("--trace-steps", given("trace_steps") and not args.trace,
         "it sets how many steps --trace records: add --trace PATH"),
        ("--max-consecutive-skips", given("max_consecutive_skips")
         and args.on_nonfinite != "skip",
         "it bounds the skipped steps of --on-nonfinite skip: add --on-nonfinite skip"),
        ("--progress-every", given("progress_every") and not args.progress,
         "it paces the progress lines that --no-progress turns off: drop one of them"),
    )
    for flag, does_nothing, fix in idle:
        if does_nothing:
            p.error(f"{flag} would do nothing here: {fix}")


def under_torchrun() -> bool:
    return all(v in os.environ for v in _TORCHRUN_VARS)


def result_path(metrics: str | None, suffix: str) -> str | None:
    """``run.jsonl`` -> ``run.<suffix>.jsonl`` (the --compare control's metrics file)."""
    if metrics is None:
        return None
    p = Path(metrics)
    return str(p.with_name(f"{p.stem}.{suffix}{p.suffix}"))


def _runs(args: argparse.Namespace) -> Runs:
    """(label, job, RunOptions) of every training this command runs (no torch imported: a
    refused combination answers at once)."""
    job = from_args(TrainJob, args)
    opts = from_args(RunOptions, args, label=job.weights.value)
    runs = [(job.weights.value, job, opts)]
    if args.compare and job.weights is not Weights.FP32:
        # parse_args: no --save-dir / --resume with --compare, so the control saves nothing
        runs.append(("fp32", job.control(), dataclasses.replace(
            opts, metrics=result_path(args.metrics, "fp32"), label="fp32 control")))
    return runs


def _check_text_corpus(job: TrainJob, seq_len: int) -> None:
    """A text or token corpus too small for --seq-len, token ids outside the --config's
    vocabulary, or a missing path are refused before any rank starts; the ranks check again
    (``Corpus.check_fits``), this only makes the error early and plain. The standard library is
    megabytes: not read here."""
    if job.data in ("markov", "stdlib"):
        return
    job.corpus().check_fits(seq_len)  # the corpus the ranks open, with the model's vocabulary


def _check_jax_cache() -> None:
    """An unsafe compilation cache directory is refused before any rank starts
    (``jax_side.compile_cache``: it holds executables every rank loads and runs)."""
    from apps import environment
    from jax_side.compile_cache import prepare_cache_dir

    prepare_cache_dir(environment.jax_cache_dir())


class Stopped(NamedTuple):
    """What every rank returns when a training stopped early: on a non-finite loss or gradient
    norm (exit status 1), a refused checkpoint (2), or SIGTERM / SIGINT
    (``apps.training.interrupts``: 128 + signal)."""

    reason: str
    status: int = 1


def _rank_entry(runs: Runs, shared_pool: bool = False) -> list[TrainResult] | Stopped:
    """What every rank runs: the trainings in order, then the results (rank 0's matter), or
    ``Stopped`` when one diverged (every rank stops at the same step: the values are global),
    a checkpoint was refused (every rank raises the same error; exit status 2), or a signal
    interrupted it. With ``shared_pool`` (``--shared-pool``, set up by ``main`` before the
    ranks started) it first checks that Torch and JAX really allocate from the one pool."""
    if shared_pool:
        import torch

        from bridge.memory_pool import require_shared_pool

        if any(job.deterministic for _, job, _ in runs):
            from bridge.determinism import make_deterministic

            make_deterministic()  # (the check starts JAX, after which XLA_FLAGS are read)
        try:
            require_shared_pool(torch.cuda.current_device())
        except RuntimeError as e:
            return Stopped(str(e), 2)
    from apps import environment
    from apps.training.interrupts import Interrupted, unwinding
    from apps.training.loop import NonFiniteTraining, train_rank
    from jax_side.compile_cache import enable_compilation_cache
    from torch_side.checkpoint.sharded_files import CheckpointError

    with unwinding():  # SIGTERM / SIGINT: the lock released, a save in progress abandoned
        # a second launch starts warm (MXFP8_JAX_CACHE=off disables it)
        enable_compilation_cache(environment.jax_cache_dir())
        results = []
        for label, job, opts in runs:
            try:
                results.append(train_rank(job, opts))
            except NonFiniteTraining as e:
                return Stopped(f"{label}: {e}")
            except CheckpointError as e:  # refused on every rank alike (sharded_files.agree)
                return Stopped(f"{label}: {e}", 2)
            except Interrupted as e:
                return Stopped(f"{label}: {e}; {_after_interrupt(opts)}", e.exit_status)
        return results


def _after_interrupt(opts: RunOptions) -> str:
    if not opts.save_dir:
        return "nothing was saved (no --save-dir)"
    return (f"the last complete checkpoint in {opts.save_dir} stays ('latest' names it) and its "
            f"lock is released: the same command with --resume {opts.save_dir} continues")


def _torchrun_main(args: argparse.Namespace, runs: Runs) -> list[TrainResult] | Stopped:
    from torch_side.launch import LaunchDevice, RankSetup, bootstrap_rank

    # torchrun's variables say where this rank runs; the bootstrap is the local launcher's
    local, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = (visible.split(",")[local] if visible else str(local)) if args.device == "cuda" else None
    threads = max(1, (os.cpu_count() or 1) // world)
    bootstrap_rank(RankSetup(LaunchDevice(args.device), gpu, threads), args.collective_timeout)
    import torch.distributed as dist

    try:
        results = _rank_entry(runs, args.shared_pool)
    finally:
        dist.destroy_process_group()
    if isinstance(results, Stopped):
        return results  # every rank: each exits nonzero
    return results if int(os.environ["RANK"]) == 0 else []


def _local_main(args: argparse.Namespace, runs: Runs) -> list[TrainResult] | Stopped:
    """Spawn ``--nproc`` local ranks; what rank 0 returned, or ``Stopped`` when this launcher
    was sent SIGTERM or SIGINT (it stops its ranks, which unwind: torch_side.launch)."""
    from apps.training.interrupts import Interrupted
    from torch_side.launch import run_local_ranks

    print(f"mxfp8-train: {args.nproc} local {args.device} ranks; runs: "
          f"{', '.join(label for label, _, _ in runs)}", flush=True)
    try:
        return run_local_ranks(
            _rank_entry, args.nproc, (runs, args.shared_pool), device=args.device,
            timeout=args.timeout,
            collective_timeout=args.collective_timeout,
        )[0]
    except (KeyboardInterrupt, SystemExit) as e:
        status = 130 if isinstance(e, KeyboardInterrupt) else e.code
        if not (isinstance(status, int) and status > 128):
            raise
        return Stopped(f"{Interrupted(status - 128)}: the ranks were stopped and unwound; "
                       f"{_after_interrupt(runs[0][2])}", status)


def _print_summary(args: argparse.Namespace, runs: Runs, results: list[TrainResult],
                   wall: float) -> None:
    first = results[0]
    job = first.job
    print(f"\nGPT {args.config!r} ({job.resolved_activations.value} activations), data "
          f"{first.corpus}", flush=True)
    floor = "" if first.loss_floor is None else f", exact floor {first.loss_floor:.3f}"
    print(f"uniform loss {first.initial_loss:.3f}{floor} nats/token; {first.world_size} "
          f"{args.device} ranks, {job.strategy.value}")
    labels = [label for label, _, _ in runs]
    if not first.steps:
        print(f"nothing to train: the run was already at step {first.start_step} >= --steps "
              f"{job.steps}; held-out loss {first.heldout_loss:.4f}")
        return
    print("step  " + "  ".join(f"{w:>8s} loss" for w in labels))
    n = len(first.steps)
    every = max(1, n // 8)
    for i in sorted({*range(0, n, every), n - 1}):
        row = "  ".join(f"{r.steps[i].loss:13.4f}" for r in results)
        print(f"{first.steps[i].step:4d}  {row}")
    for label, r in zip(labels, results, strict=True):
        steady = sorted(s.seconds for s in r.steps[len(r.steps) // 2:]) or [float("nan")]
        tps = sorted(s.tokens_per_s for s in r.steps[len(r.steps) // 2:]) or [float("nan")]
        skipped = sum(s.outcome.value == "skipped" for s in r.steps)
        if skipped:
            print(f"{label:>8s}: {skipped} steps skipped (non-finite loss or gradient norm)")
        print(f"{label:>8s}: held-out loss {r.heldout_loss:.4f}; median step "
              f"{steady[len(steady) // 2]:.3f} s ({tps[len(tps) // 2]:,.0f} tokens/s); first "
              f"step {r.first_step_s:.1f} s" + (
                  f" after {r.precompile_s:.1f} s compiling {r.precompiled_programs} programs "
                  f"in parallel" if r.precompiled_programs else ""))
    print(f"wall {wall:.1f} s (spawn and compilation included)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.shared_pool:  # first: before the ranks start, and under torchrun before this
        from common.shared_pool import use_shared_pool  # rank imports torch

        try:
            use_shared_pool()
        except (ValueError, RuntimeError) as e:
            print(f"mxfp8-train: error: {e}", file=sys.stderr)
            return 2
    try:
        runs = _runs(args)
        _check_text_corpus(runs[0][1], args.seq_len)
        _check_jax_cache()
    except (ValueError, TypeError, OSError) as e:
        print(f"mxfp8-train: error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if under_torchrun():
        results = _torchrun_main(args, runs)
    else:
        results = _local_main(args, runs)
    if isinstance(results, Stopped):
        print(f"mxfp8-train: {'error: ' if results.status <= 128 else ''}{results.reason}",
              file=sys.stderr)
        return results.status
    if results:  # rank 0 (or the launching process)
        _print_summary(args, runs, results, time.perf_counter() - start)
        if args.plot:
            from apps.training.plot import plot_runs

            paths = [o.metrics for _, _, o in runs if o.metrics]  # parse_args: at least one
            print(f"loss curves: {plot_runs(paths, args.plot)}")
            if args.telemetry:  # the first run's MXFP8 numerics, beside the curves
                from apps.training.plot_telemetry import plot_telemetry

                print(f"MXFP8 telemetry: "
                      f"{plot_telemetry(paths[0], _telemetry_figure(args.plot))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
