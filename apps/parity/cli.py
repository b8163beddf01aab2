"""Parity report CLI: TorchGPT (bridge MXFP8 op, optionally torch_side FSDP) vs FlaxGPT.

    python -m apps.parity                              # FSDP on 2 gloo CPU ranks, MXFP8
    python -m apps.parity --world-size 1               # one process, no FSDP
    python -m apps.parity --world-size 1 --mode high_precision   # the control
    python -m apps.parity --world-size 1 --device cuda           # on a GPU
    python -m apps.parity --config small --seed 3 --batch-size 4 --seq-len 50

Prints the table of ``apps.parity.ParityReport.format()`` and a one-line verdict.
"""

from __future__ import annotations

import argparse
import time

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m apps.parity", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", choices=["tiny", "small"], help="GPTConfig preset")
    p.add_argument("--seed", type=int, default=0, help="parameter and batch seed")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=40, help="tokens per sequence (any, <= max)")
    p.add_argument("--mode", default="mxfp8", choices=["mxfp8", "high_precision"])
    p.add_argument("--world-size", type=int, default=2,
                   help="1: single process, no FSDP; >1: torch_side FSDP on spawned ranks")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where Torch and Flax run; with --world-size > 1: cpu = gloo ranks, "
                        "cuda = NCCL ranks, one GPU each")
    p.add_argument("--strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="FSDP sharding strategy (world size > 1)")
    args = p.parse_args(argv)
    for flag in ("world_size", "batch_size", "seq_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from apps.parity import parity_report, sharded_parity_report
    from bridge import start_jax_backend
    from common.model_config import PRESETS
    from jax_side.mxfp8 import kernel_report

    cfg = PRESETS[args.config]
    start_jax_backend()  # before anything else starts JAX: keeps Torch's "cuda" on cuda:0
    kernels = kernel_report(None, "gpu" if args.device == "cuda" else "cpu")
    print(f"MXFP8 kernels for {args.device} tensors: {kernels['kernels']}; jax "
          f"{jax.__version__}", flush=True)
    start = time.perf_counter()
    if args.world_size > 1:
        report = sharded_parity_report(
            cfg, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len,
            world_size=args.world_size, strategy=args.strategy, mode=args.mode,
            device=args.device,
        )
    else:
        report = parity_report(
            cfg, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len,
            mode=args.mode, device=args.device,
        )
    print(report.format())
    print(f"\n{report.verdict()}")
    print(f"(wall time {time.perf_counter() - start:.1f} s, compilation included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
