"""Parity report and multi-step replay CLI: TorchGPT (optionally torch_side FSDP) vs FlaxGPT.

    python -m apps.parity                              # unit compute, FSDP on 2 gloo CPU ranks
    python -m apps.parity --world-size 1               # one process, no FSDP
    python -m apps.parity --compute op                 # the per-linear op report (hooks on each
                                                       # MXFP8Linear: x, y, dy, teacher-forced)
    python -m apps.parity --compute op --world-size 1 --mode high_precision   # the control
    python -m apps.parity --compute op --world-size 1 --device cuda          # on a GPU
    python -m apps.parity --steps 5                    # replay: 5 training steps side by side
    python -m apps.parity --steps 3 --from-checkpoint runs/a   # from mxfp8-train --save-dir

Prints the report (``ParityReport``, ``UnitParityReport`` or ``ReplayReport``) and a verdict.
Exit status 0; 2 for arguments it cannot honour, and for a checkpoint the replay cannot start
from (the reason on stderr).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from apps.training.job import ADAMW_FIRST_STEP_DIVISOR, FLOAT32_MAX
from common.model_config import PRESETS

__all__ = ["main", "parse_args"]

_EXCESS = "--xla_allow_excess_precision=false"


def _add_replay_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replay (--steps N)")
    g.add_argument("--steps", type=int, default=None,
                   help="train N steps with Torch FSDP + torch.optim.AdamW and the Flax twin + "
                        "its AdamW side by side and name the first step, layer and tensor where "
                        "they diverge (default world size 1)")
    g.add_argument("--from-checkpoint", default=None, metavar="DIR",
                   help="start the replay from an mxfp8-train --save-dir (its latest) or step_* "
                        "directory: its main weights, AdamW moments, step, lr and weight decay "
                        "(default --steps 5)")
    g.add_argument("--lr", type=float, default=None, help="AdamW lr (default 3e-3 or the job's)")
    g.add_argument("--weight-decay", type=float, default=None,
                   help="AdamW weight decay (default 0 or the job's)")
    g.add_argument("--adamw-sqrt", default="torch", choices=["torch", "xla"],
                   help="the Flax AdamW's square root: Torch's kernel (the same bytes) or "
                        "jnp.sqrt (correctly rounded; Torch's CPU sqrt is not)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m apps.parity", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", choices=list(PRESETS),
                   help="GPTConfig preset (gpt2-124m and gpt2-350m: slow on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="parameter and batch seed")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=40, help="tokens per sequence (any, <= max)")
    p.add_argument("--mode", default="mxfp8", choices=["mxfp8", "high_precision"])
    p.add_argument("--compute", default="unit", choices=["unit", "op"],
                   help="unit (default, as mxfp8-train): each block and the head + loss one JAX "
                        "program, compared byte for byte (loss, gradients, gathered planes); op: "
                        "one JAX op per linear, the per-linear report")
    p.add_argument("--activations", default="fp32", choices=["fp32", "bf16"],
                   help="activation dtype of both twins (bf16: unit compute only)")
    p.add_argument("--world-size", type=int, default=None,
                   help="1: single process, no FSDP (replay: FSDP on one rank); >1: torch_side "
                        "FSDP on spawned ranks (default 2, replay 1)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where Torch and Flax run (op report only; the unit report and the "
                        "replay run on the CPU); with --world-size > 1: cpu = gloo ranks, "
                        "cuda = NCCL ranks, one GPU each")
    p.add_argument("--strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="FSDP sharding strategy (world size > 1; the replay at any size)")
    _add_replay_args(p)
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("world_size", "batch_size", "seq_len", "steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    args.replay = args.steps is not None or args.from_checkpoint is not None
    if args.world_size is None:
        args.world_size = 1 if args.replay else 2
    if args.from_checkpoint is not None and not Path(args.from_checkpoint).is_dir():
        p.error(f"--from-checkpoint {args.from_checkpoint}: no such directory; pass the "
                f"--save-dir of an mxfp8-train run or one of its step_* directories")
    if args.replay and args.steps is None:
        args.steps = 5
    if args.activations == "bf16" and args.compute == "op" and not args.replay:
        p.error("--activations bf16 needs --compute unit: the op report compares the fp32 twin")
    if args.device == "cuda" and (args.compute == "unit" or args.replay):
        p.error("--device cuda: the unit report and the replay run on the CPU; use --compute op "
                "for the GPU report")
    if not args.replay and (args.lr is not None or args.weight_decay is not None):
        p.error("--lr / --weight-decay set the replay's AdamW; add --steps N")
    limit = FLOAT32_MAX * ADAMW_FIRST_STEP_DIVISOR  # above it AdamW's first step overflows
    if args.lr is not None and not (math.isfinite(args.lr) and 0 < args.lr <= limit):
        p.error(f"--lr {args.lr}: expected a finite learning rate > 0 and <= {limit:.3g} "
                f"(AdamW's first step divides it by 1 - beta1 = 0.1, in float32)")
    if args.weight_decay is not None and not (
            math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        p.error(f"--weight-decay {args.weight_decay}: expected a finite number >= 0")


def _replay(args, cfg):
    from apps.parity.flax_adamw import AdamWConfig
    from apps.parity.replay import replay
    from apps.parity.replay_state import ReplaySetup, setup_from_checkpoint

    common = dict(steps=args.steps, compute=args.compute, strategy=args.strategy,
                  sqrt=args.adamw_sqrt, seed=args.seed, batch_size=args.batch_size,
                  seq_len=args.seq_len)
    if args.from_checkpoint is not None:
        setup = setup_from_checkpoint(args.from_checkpoint, **common)
        hp = setup.adamw
    else:
        setup = ReplaySetup(cfg, mode=args.mode, activations=args.activations, **common)
        hp = AdamWConfig()
    hp = hp._replace(**{k: v for k, v in (("lr", args.lr), ("weight_decay", args.weight_decay))
                        if v is not None})
    import dataclasses

    return replay(dataclasses.replace(setup, adamw=hp), world_size=args.world_size)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # bf16 rounded at every XLA op, as the unit programs round it (bridge/units.py, "Exactness")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_EXCESS}".strip()
    import jax

    from apps import environment
    from apps.parity import parity_report, sharded_parity_report
    from apps.parity.unit_report import unit_parity_report
    from bridge import start_jax_backend
    from common.model_config import PRESETS
    from jax_side.mxfp8 import kernel_report

    cfg = PRESETS[args.config]
    start_jax_backend()  # before anything else starts JAX: keeps Torch's "cuda" on cuda:0
    config = environment.kernels(None)  # MXFP8_BACKEND / MXFP8_GEMM
    kernels = kernel_report(config, "gpu" if args.device == "cuda" else "cpu")
    print(f"MXFP8 kernels for {args.device} tensors: {kernels['kernels']}; jax "
          f"{jax.__version__}", flush=True)
    start = time.perf_counter()
    if args.replay:
        from torch_side.checkpoint.sharded_files import CheckpointError

        try:
            report = _replay(args, cfg)
        except CheckpointError as e:  # a checkpoint the replay cannot start from
            print(f"python -m apps.parity: error: {e}", file=sys.stderr)
            return 2
    elif args.compute == "unit":
        report = unit_parity_report(
            cfg, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len,
            mode=args.mode, activations=args.activations, world_size=args.world_size,
            strategy=args.strategy)
    elif args.world_size > 1:
        report = sharded_parity_report(
            cfg, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len,
            world_size=args.world_size, strategy=args.strategy, mode=args.mode,
            device=args.device, kernels=config,
        )
    else:
        report = parity_report(
            cfg, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len,
            mode=args.mode, device=args.device, kernels=config,
        )
    print(report.format())
    print(f"\n{report.verdict()}")
    print(f"(wall time {time.perf_counter() - start:.1f} s, compilation included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
