"""What ``--telemetry`` costs per step, one in-process gloo rank (docs/training.md, "Cost").

    python benchmarks/bench_telemetry.py --config small            # CPU
    python benchmarks/bench_telemetry.py --config gpt2-124m --device cuda --data stdlib \\
        --seq-len 1024 --batch-size 8

Prints the Torch ops per step that the telemetry adds (torch.profiler: the sum of
``key_averages()`` counts over one warm step with minus without it, nested aten calls included),
those of one ``collect()`` alone, and the instrument's own time per step (its amax-observer calls
plus ``collect()``, synchronized on CUDA; median over ``--steps`` steps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from apps.training.job import RunOptions, TrainJob
from apps.training.loop import Trainer


def _ops(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages())


def _timed_telemetry(tel, sync) -> list[float]:
    """Wrap the observer and collect() so that their time adds up in the returned cell."""
    spent = [0.0]
    for g in tel.groups:
        def observe(packed, g=g):
            sync()
            t0 = time.perf_counter()
            tel._observe(g, packed)
            sync()
            spent[0] += time.perf_counter() - t0
        g.observe_amax(observe)
    collect = tel.collect

    def timed():
        sync()
        t0 = time.perf_counter()
        out = collect()
        spent[0] += time.perf_counter() - t0
        return out
    tel.collect = timed
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--data", default="markov")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    job = TrainJob(config=a.config, device=a.device, data=a.data, seq_len=a.seq_len,
                   batch_size=a.batch_size, micro_batches=1, steps=a.steps + 10)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    ops = {}
    for telemetry in (False, True):
        opts = RunOptions(progress=False, precompile=False, telemetry=telemetry)
        with Trainer(job, opts) as t:
            for _ in range(3):
                t.step()
            ops[telemetry] = _ops(t.step)
            if telemetry:
                tel = t.instruments.telemetry
                collect_ops = _ops(tel.collect)  # nothing observed since: no headroom part
                spent, per_step = _timed_telemetry(tel, sync), []
                for _ in range(a.steps):
                    spent[0] = 0.0
                    t.step()
                    per_step.append(spent[0])
    print(f"{a.config} on {a.device}: Torch ops per step without --telemetry {ops[False]}, "
          f"with {ops[True]} (+{ops[True] - ops[False]}); one collect() alone {collect_ops}; "
          f"telemetry time per step median {1e3 * statistics.median(per_step):.2f} ms "
          f"(min {1e3 * min(per_step):.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
