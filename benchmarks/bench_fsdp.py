"""FSDP with MXFP8 weights: the parity suite on a backend, and training step times.

Not a test: it runs, in spawned ranks (``tests/torch_side/multiprocess.py``),
1. ``--parity``: the sharded-vs-replicated parity cases and the wire-accounting cases of
   ``tests/torch_side`` (on NCCL each rank owns one GPU, which it sees as cuda:0, and runs the
   JAX kernels there through the bridge), printing PASS/FAIL per case;
2. ``--timing``: median training step time (forward + backward + ``FSDPOptimizer.step`` with the
   distributed MXFP8 quantization) of a residual MLP stack with MXFP8 linears, per strategy,
   with the bytes each step all-gathers / reduces per rank and the peak unsharded-bucket bytes.
   ``--check-collectives both`` times every strategy with the collective-consistency check off
   and on (``fully_shard(check_collectives=...)``), alternating the two models step by step so
   that both see the same machine load.
GPU timings synchronize Torch (and so JAX, through the bridge's ordering) at step boundaries.

Usage (repo root): ``python3 -m benchmarks.bench_fsdp --backend nccl --world-sizes 1 2``
(``--backend gloo`` runs on CPU). Prints a markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from bridge import MXFP8Linear
from tests.torch_side import test_training_parity, test_wire_and_errors
from tests.torch_side.fsdp import test_distributed_quantize
from tests.torch_side.multiprocess import run_cases
from torch_side import FSDPOptimizer, ShardingStrategy, fully_shard
from torch_side.comm.collectives import Collective, all_reduce_on

_CFG_ENV = "BENCH_FSDP_CONFIG"


class BenchBlock(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = MXFP8Linear(d, ff, bias=False)
        self.fc2 = MXFP8Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, d) -> (T, d)
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh"))


class BenchNet(nn.Module):
    def __init__(self, d: int, ff: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList([BenchBlock(d, ff) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _step(model, opt, x, device: str) -> float:
    """One timed training step (seconds)."""
    _sync(device)
    model.clear_wire_log()
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    _sync(device)
    return time.perf_counter() - t0


def case_step_time(ctx) -> None:
    """Spawned-rank worker: time steps per strategy (and check setting); rank 0 writes the rows
    as JSON."""
    cfg = json.loads(os.environ[_CFG_ENV])
    rows = []
    for strategy in cfg["strategies"]:
        runs = {}
        for check in cfg["checks"]:
            torch.manual_seed(0)
            net = BenchNet(cfg["d"], cfg["ff"], cfg["blocks"]).to(ctx.device)
            model = fully_shard(
                net, unit_modules=(BenchBlock,), strategy=strategy, check_collectives=check
            )
            runs[check] = (model, FSDPOptimizer(model, torch.optim.AdamW, lr=1e-4), [])
        x = torch.randn(cfg["tokens"], cfg["d"], device=ctx.device)
        for i in range(cfg["warmup"] + cfg["steps"]):
            for model, opt, times in runs.values():  # alternating: the same load for each
                t = _step(model, opt, x, ctx.device)
                if i >= cfg["warmup"]:
                    times.append(t)
        for check, (model, _, times) in runs.items():
            sent = sum(r.bytes_sent for r in model.wire_log())
            med = torch.tensor([statistics.median(times)], device=ctx.device)
            # the slowest rank sets the step time
            all_reduce_on(med, Collective.ALL_REDUCE_MAX, "the benchmark's step time")
            rows.append(
                {
                    "world_size": ctx.world_size,
                    "strategy": strategy,
                    "check_collectives": check,
                    "collectives_per_step": len(model.wire_log()),
                    "device": ctx.device,
                    "step_ms": round(med.item() * 1e3, 2),
                    "bytes_sent_per_rank": sent,
                    "peak_bucket_bytes": model.allocator.peak_bytes,
                    **cfg["shape"],
                }
            )
    if ctx.rank == 0:
        Path(cfg["out"], f"timing_ws{ctx.world_size}.json").write_text(json.dumps(rows))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _parity(world_sizes, backend: str, out: Path) -> bool:
    cases = {**test_distributed_quantize.CASES, **test_training_parity.CASES,
             **test_wire_and_errors.CASES}
    ok_all, report = True, []
    for ws in world_sizes:
        names = [n for n, sizes in cases.items() if ws in sizes]
        t0 = time.perf_counter()
        outcomes = run_cases(ws, names, backend)
        for name, o in outcomes.items():
            status = "PASS" if o.ok else "FAIL"
            ok_all &= o.ok
            print(f"parity {backend} world={ws} {name.split(':')[1]}: {status}", flush=True)
            if not o.ok:
                print(o.detail[-3000:], flush=True)
            report.append({"world_size": ws, "case": name, "ok": o.ok, "detail": o.detail})
        print(f"parity {backend} world={ws}: {time.perf_counter() - t0:.1f} s", flush=True)
    (out / f"parity_{backend}.json").write_text(json.dumps(report, indent=1))
    return ok_all


def _timing(world_sizes, backend: str, args, out: Path) -> bool:
    shape = {"d": args.d_model, "ff": args.d_ff, "blocks": args.blocks, "tokens": args.tokens}
    cfg = {
        **shape,
        "shape": shape,
        "strategies": args.strategies,
        "checks": {"off": [False], "on": [True], "both": [False, True]}[args.check_collectives],
        "warmup": args.warmup,
        "steps": args.steps,
        "out": str(out),
    }
    os.environ[_CFG_ENV] = json.dumps(cfg)
    ok, rows = True, []
    for ws in world_sizes:
        o = run_cases(ws, ["benchmarks.bench_fsdp:case_step_time"], backend)
        res = o["benchmarks.bench_fsdp:case_step_time"]
        ok &= res.ok
        if not res.ok:
            print(res.detail[-3000:], flush=True)
            continue
        rows += json.loads((out / f"timing_ws{ws}.json").read_text())
    print(
        "\n| world | strategy | check | collectives/step | step (ms) | sent/rank/step (MB) | "
        "peak buckets (MB) | model |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        check = "on" if r["check_collectives"] else "off"
        print(
            f"| {r['world_size']} | {r['strategy']} | {check} | {r['collectives_per_step']} | "
            f"{r['step_ms']} | "
            f"{r['bytes_sent_per_rank'] / 2**20:.2f} | {r['peak_bucket_bytes'] / 2**20:.2f} | "
            f"d={r['d']} ff={r['ff']} blocks={r['blocks']} tokens/rank={r['tokens']} |"
        )
    (out / f"timing_{backend}.json").write_text(json.dumps(rows, indent=1))
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--parity", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--strategies", nargs="+", default=[s.value for s in ShardingStrategy])
    p.add_argument(
        "--check-collectives", choices=["off", "on", "both"], default="off",
        help="time with fully_shard(check_collectives=...) off, on, or both (alternating steps)",
    )
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-ff", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/fsdp")))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ok = True
    if args.parity:
        ok &= _parity(args.world_sizes, args.backend, args.out)
    if args.timing:
        ok &= _timing(args.world_sizes, args.backend, args, args.out)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
