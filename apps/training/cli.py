"""``mxfp8-train`` (= ``python -m apps.training``): train a GPT with Torch FSDP + JAX MXFP8 GEMMs.

    mxfp8-train                                   # CPU, 2 gloo ranks it spawns, tiny GPT, MXFP8
    mxfp8-train --compare                         # ... and the same run with fp32 linears
    mxfp8-train --data stdlib --config small --steps 200 --metrics runs/s.jsonl --plot runs/s.png
    mxfp8-train --save-dir ckpt --save-every 20 ; mxfp8-train --resume ckpt --steps 80
    torchrun --nproc_per_node 2 -m apps.training --device cuda --config gpt2-124m --data stdlib

Without torchrun the command spawns ``--nproc`` local ranks itself (``torch_side.launch``); under
torchrun (its environment variables are set) it is one rank of torchrun's job, on one GPU per
process with ``--device cuda`` (``LOCAL_RANK`` picks it), so it runs across nodes the way torchrun
jobs do. Guide: docs/training.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import sys
import time
from typing import NamedTuple

__all__ = ["main", "parse_args"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mxfp8-train", description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2],
    )
    g = p.add_argument_group("where it runs")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo ranks; cuda: NCCL, one GPU per rank")
    g.add_argument("--nproc", type=_positive(int), default=None,
                   help="ranks to spawn locally (default 2 on cpu, 1 on cuda); not under torchrun")
    g.add_argument("--timeout", type=_positive(float), default=None,
                   help="seconds before a local launch is stopped (stalled ranks are named)")
    g.add_argument("--collective-timeout", type=_positive(float), default=300.0,
                   help="seconds a collective may wait for the other ranks")
    m = p.add_argument_group("model and numerics")
    m.add_argument("--config", default="tiny",
                   choices=["tiny", "small", "gpt2-124m", "gpt2-350m"], help="GPTConfig preset")
    m.add_argument("--weights", default="mxfp8", choices=["mxfp8", "bf16", "fp32"],
                   help="linear layers: MXFP8, or the bf16 / fp32 high-precision controls")
    m.add_argument("--activations", default=None, choices=["fp32", "bf16"],
                   help="activation dtype (default fp32 on cpu, bf16 + fused attention on cuda)")
    m.add_argument("--strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    m.add_argument("--recompute", default="none", choices=["none", "block"],
                   help="activation checkpointing of the transformer blocks")
    m.add_argument("--backend", default=None, choices=["xla", "pallas", "te"],
                   help="MXFP8 quantize backend (default: the device's, reported)")
    m.add_argument("--deterministic", action="store_true",
                   help="the same bits in every GPU launch and across a resume: no XLA GEMM "
                        "autotuning, deterministic Torch kernels (bridge.determinism; costs "
                        "~10-25%% of a 124M step on the H200). CPU runs are reproducible anyway")
    m.add_argument("--gemm", default=None,
                   choices=["dequant_dot", "dequant_bf16_dot", "scaled_matmul"],
                   help="MXFP8 GEMM implementation (default: the device's, reported)")
    t = p.add_argument_group("optimisation and data")
    t.add_argument("--steps", type=_positive(int), default=40)
    t.add_argument("--micro-batches", type=_positive(int), default=2)
    t.add_argument("--batch-size", type=_positive(int), default=8,
                   help="sequences per rank and micro-batch")
    t.add_argument("--seq-len", type=_positive(int), default=32)
    t.add_argument("--lr", type=_positive(float), default=3e-3)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--seed", type=_non_negative_int, default=0)
    t.add_argument("--data", default="markov",
                   help="'markov' (exact loss floor), 'stdlib' (the Python standard library's "
                        "sources as bytes) or a text file / directory of text files")
    t.add_argument("--eval-batches", type=_positive(int), default=4,
                   help="held-out batches evaluated at the end")
    t.add_argument("--on-nonfinite", default="stop", choices=["stop", "skip"],
                   help="a step whose loss or global gradient norm is NaN/Inf: stop training "
                        "with an error (default), or skip its update and go on")
    t.add_argument("--max-consecutive-skips", type=_positive(int), default=10,
                   help="with --on-nonfinite skip: stop after this many skipped steps in a row")
    o = p.add_argument_group("outputs and checkpoints")
    o.add_argument("--metrics", default=None, help="JSONL metrics file (one object per step)")
    o.add_argument("--plot", default=None, help="PNG of the loss curves, drawn at the end")
    o.add_argument("--save-dir", default=None, help="directory for sharded checkpoints")
    o.add_argument("--save-every", type=_non_negative_int, default=0,
                   help="steps between checkpoints (0: one at the end, with --save-dir)")
    o.add_argument("--resume", default=None,
                   help="a --save-dir (its latest checkpoint) or a step_* directory")
    o.add_argument("--compare", action="store_true",
                   help="also run the fp32-linear control with the same seed and data")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--no-precompile", action="store_true",
                   help="compile the JAX programs as the first step reaches them, one after "
                        "another, instead of all at once in parallel before it")
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
    if args.plot:  # checked now, not after a training that has nothing to draw it with
        if not args.metrics:
            p.error("--plot needs --metrics (the curves are drawn from the metrics file)")
        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib, which is not installed; pip install matplotlib, "
                    "or drop --plot (mxfp8-plot draws a --metrics file later)")
    if args.nproc is None:
        args.nproc = 2 if args.device == "cpu" else 1
    return args


def under_torchrun() -> bool:
    return all(v in os.environ for v in _TORCHRUN_VARS)


def _job(args, weights: str):
    from apps.training.job import TrainJob
    from common.kernels import KernelConfig

    kernels = None if args.backend is None and args.gemm is None else KernelConfig(
        args.backend, args.gemm)
    return TrainJob(
        config=args.config, weights=weights, activations=args.activations,
        strategy=args.strategy, recompute=args.recompute, steps=args.steps,
        micro_batches=args.micro_batches, batch_size=args.batch_size, seq_len=args.seq_len,
        lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, data=args.data,
        eval_batches=args.eval_batches, device=args.device, kernels=kernels,
        deterministic=args.deterministic,
    )


def _runs(args) -> list[tuple[str, object, object]]:
    """(label, job, RunOptions) of every training this command runs."""
    from apps.training.loop import RunOptions, result_path

    common = {"progress": not args.no_progress, "precompile": not args.no_precompile,
              "on_nonfinite": args.on_nonfinite,
              "max_consecutive_skips": args.max_consecutive_skips}
    runs = [(args.weights, _job(args, args.weights), RunOptions(
        metrics=args.metrics, save_dir=args.save_dir, save_every=args.save_every,
        resume=args.resume, label=args.weights, **common))]
    if args.compare and args.weights != "fp32":
        runs.append(("fp32", _job(args, "fp32"), RunOptions(
            metrics=result_path(args.metrics, "fp32"), label="fp32 control", **common)))
    return runs


def _check_text_corpus(args) -> None:
    """A text corpus too small for --seq-len (or a missing path) is refused before any rank
    starts; the ranks check again (``Corpus.check_fits``), this only makes the error early and
    plain. The standard library is megabytes: not read here."""
    if args.data in ("markov", "stdlib"):
        return
    from apps.training.data import BYTE_VOCAB, make_corpus

    make_corpus(args.data, vocab_size=BYTE_VOCAB, seed=args.seed).check_fits(args.seq_len)


class Stopped(NamedTuple):
    """What every rank returns when a training stopped on a non-finite loss or gradient norm."""

    reason: str


def _rank_entry(runs):
    """What every rank runs: the trainings in order, then the results (rank 0's matter), or
    ``Stopped`` when one diverged (every rank stops at the same step: the values are global)."""
    from apps.training.loop import NonFiniteTraining, train_rank
    from jax_side.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # a second launch starts warm (MXFP8_JAX_CACHE=off disables)
    results = []
    for label, job, opts in runs:
        try:
            results.append(train_rank(job, opts))
        except NonFiniteTraining as e:
            return Stopped(f"{label}: {e}")
    return results


def _torchrun_main(args, runs) -> list:
    import torch
    import torch.distributed as dist

    if args.device == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        chosen = visible.split(",")[local] if visible else str(local)
        os.environ["CUDA_VISIBLE_DEVICES"] = chosen  # before CUDA starts: this rank's GPU only
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        torch.cuda.set_device(0)
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    backend = "nccl" if args.device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", 0)} if args.device == "cuda" else {}
    dist.init_process_group(
        backend, timeout=datetime.timedelta(seconds=args.collective_timeout), **kwargs
    )
    try:
        results = _rank_entry(runs)
    finally:
        dist.destroy_process_group()
    if isinstance(results, Stopped):
        return results  # every rank: each exits nonzero
    return results if int(os.environ["RANK"]) == 0 else []


def _print_summary(args, runs, results, wall: float) -> None:
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
    try:
        runs = _runs(args)
        _check_text_corpus(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"mxfp8-train: error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if under_torchrun():
        results = _torchrun_main(args, runs)
    else:
        from torch_side.launch import run_local_ranks

        print(f"mxfp8-train: {args.nproc} local {args.device} ranks; runs: "
              f"{', '.join(label for label, _, _ in runs)}", flush=True)
        results = run_local_ranks(
            _rank_entry, args.nproc, (runs,), device=args.device, timeout=args.timeout,
            collective_timeout=args.collective_timeout,
        )[0]
    if isinstance(results, Stopped):
        print(f"mxfp8-train: error: {results.reason}", file=sys.stderr)
        return 1
    if results:  # rank 0 (or the launching process)
        _print_summary(args, runs, results, time.perf_counter() - start)
        if args.plot:
            from apps.training.plot import plot_runs

            paths = [o.metrics for _, _, o in runs if o.metrics]  # parse_args: at least one
            print(f"loss curves: {plot_runs(paths, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
