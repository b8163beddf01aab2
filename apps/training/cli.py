"""The hybrid training prototype: a small GPT trained with Torch FSDP + JAX MXFP8 GEMMs.

    python -m apps.training                         # 2 gloo CPU ranks, ZeRO-3, MXFP8, 40 steps
    python -m apps.training --compare               # the same run again with fp32 linears
    python -m apps.training --device cuda --world-size 2 --config small --steps 100

Every rank runs ``apps.training.loop.train_rank``: the Torch GPT twin wrapped by
``torch_side.fully_shard`` (one unit per block; linear weights MXFP8, everything else fp32),
``FSDPOptimizer`` (AdamW over the fp32 main-weight shards, then the distributed MXFP8
re-quantization), trained on a seeded Markov-chain corpus whose exact loss floor is printed.
"""

from __future__ import annotations

import argparse
import time

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m apps.training", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", choices=["tiny", "small"], help="GPTConfig preset")
    p.add_argument("--world-size", type=int, default=2, help="data-parallel ranks (processes)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo ranks; cuda: NCCL, one GPU per rank")
    p.add_argument("--strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    p.add_argument("--weights", default="mxfp8", choices=["mxfp8", "fp32"],
                   help="linear layers: MXFP8 weights and GEMMs, or the fp32 control")
    p.add_argument("--compare", action="store_true",
                   help="also run the fp32 control with the same seed and print both curves")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="per rank and micro-batch")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-every", type=int, default=5)
    return p.parse_args(argv)


def _job(args, weights):
    from apps.training.loop import TrainJob, WeightMode
    from torch_side.strategy import ShardingStrategy

    return TrainJob(
        config=args.config, weights=WeightMode(weights), strategy=ShardingStrategy(args.strategy),
        steps=args.steps, micro_batches=args.micro_batches, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, seed=args.seed, device=args.device,
    )


def _run(args, weights):
    from apps.training.loop import train_rank
    from torch_side.launch import run_local_ranks

    t0 = time.perf_counter()
    result = run_local_ranks(train_rank, args.world_size, (_job(args, weights),),
                             device=args.device)[0]
    return result, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [args.weights] + (["fp32"] if args.compare and args.weights != "fp32" else [])
    results = {}
    for weights in runs:
        print(f"training: {weights} linears, {args.world_size} {args.device} ranks, "
              f"{args.strategy}, {args.steps} steps ...", flush=True)
        results[weights] = _run(args, weights)
    first = results[runs[0]][0]
    print(f"\nGPT '{args.config}', Markov corpus: uniform loss {first.initial_loss:.3f}, "
          f"exact floor {first.loss_floor:.3f} nats/token")
    header = "step  " + "  ".join(f"{w:>8s} loss" for w in runs)
    print(header)
    for i in range(0, args.steps, max(1, args.print_every)):
        row = "  ".join(f"{results[w][0].steps[i].loss:13.4f}" for w in runs)
        print(f"{i:4d}  {row}")
    last = "  ".join(f"{results[w][0].steps[-1].loss:13.4f}" for w in runs)
    print(f"{args.steps - 1:4d}  {last}")
    for w in runs:
        r, wall = results[w]
        steady = [s.seconds for s in r.steps[len(r.steps) // 2:]]
        print(f"{w:>6s}: held-out loss {r.eval_loss_start:.3f} -> {r.eval_loss_end:.3f} "
              f"(floor {r.loss_floor:.3f}); median step {sorted(steady)[len(steady) // 2]:.3f} s; "
              f"wall {wall:.1f} s incl. spawn and compilation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
