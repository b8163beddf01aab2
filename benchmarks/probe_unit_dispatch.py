"""Where the host time of a unit program call goes (issue 19): the GPT-2 training step's unit
programs, captured from a real warm step, replayed alone with JAX only.

For one block's ``unit_forward`` and ``unit_backward`` (and the head's) this prints the pytree
leaves in and out, the host time of one call as the step makes it (``jax.jit`` with the
``UnitSpec`` static argument), of the ahead-of-time compiled program (``.lower().compile()``),
and of the same program over a flat list of leaves; then the host time of the Torch-side pieces
of ``bridge.unit_op`` around it (``to_torch`` of the result, the shares of the inputs). With
``--pyprofile N`` a cProfile of N warm steps follows (top functions by own time).

    python3 -m benchmarks.probe_unit_dispatch --config gpt2-124m --batch-size 8 --seq-len 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def host_us(fn, n: int = 30, warm: int = 5, sync=None, clock=time.perf_counter) -> float:
    """Median host time of fn() in us (a sync every 10 calls keeps the GPU queue short);
    ``clock=time.thread_time``: the calling thread's CPU time instead."""
    for _ in range(warm):
        fn()
    if sync:
        sync()
    times = []
    for i in range(n):
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if sync and i % 10 == 9:
            sync()
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--config", default="gpt2-124m")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--pyprofile", type=int, default=0)
    p.add_argument("--ab", action="store_true",
                   help="only the step, gradients through the per-parameter hooks (A) against "
                        "the unit programs' grad-bucket sinks (B), and B with Python's cyclic "
                        "garbage collector off during the step (C), interleaved")
    args = p.parse_args(argv)
    from torch_side.launch import run_local_ranks

    run_local_ranks(_rank, 1, (args,), device=args.device)
    return 0


def _rank(args) -> None:
    import torch

    import bridge.unit_op as BU
    from benchmarks import bench_train_step as B
    from common.model_config import PRESETS

    cfg = PRESETS[args.config]
    args.world_size = 1
    sync = (lambda: torch.cuda.synchronize()) if args.device == "cuda" else (lambda: None)
    if args.ab:
        _ab(args, cfg, sync)
        return
    model, step, _ = B._build("mxfp8", cfg, args)
    for i in range(3):
        step(*B._batch(cfg, args, 0, i))
    sync()
    # the step with the benchmark's timed refresh (two syncs) and without it
    for label in ("with the timed refresh (syncs)", "plain refresh (no sync in the step)"):
        host, total = [], []
        for i in range(8):
            batch = B._batch(cfg, args, 0, 100 + i)
            sync()
            t0 = time.perf_counter()
            step(*batch)
            t1 = time.perf_counter()
            sync()
            host.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        print(f"step {label}: host {1e3 * statistics.median(host):.1f} ms, step "
              f"{1e3 * statistics.median(total):.1f} ms", flush=True)
        model.__dict__.pop("refresh_model_weights", None)  # the class's own from now on
    import threading

    print(f"threads: {threading.active_count()} Python, switch interval "
          f"{sys.getswitchinterval() * 1e3:.1f} ms", flush=True)
    # each unit program call's host time inside the step, by program
    per: dict = {}
    real_roc0, real_run_in0 = BU.run_or_compile, BU.run_in

    def timed_call(real):
        def call(*a, **static):
            fn = a[0] if real is real_roc0 else a[1]
            t0, c0 = time.perf_counter(), time.thread_time()
            out = real(*a, **static)
            key = (fn.__name__, static["spec"].fn.__class__.__name__)
            per.setdefault(key, []).append(
                (time.perf_counter() - t0, time.thread_time() - c0))
            return out
        return call

    BU.run_or_compile, BU.run_in = timed_call(real_roc0), timed_call(real_run_in0)
    for i in range(4):
        step(*B._batch(cfg, args, 0, 200 + i))
    sync()
    BU.run_or_compile, BU.run_in = real_roc0, real_run_in0
    for key, ts in per.items():
        wall = [w for w, _ in ts]
        cpu = [c for _, c in ts]
        print(f"in the step, {key}: {1e6 * statistics.median(wall):.0f} us median, "
              f"{1e6 * max(wall):.0f} max over {len(ts)} calls; this thread's CPU time "
              f"{1e6 * statistics.median(cpu):.0f} us median (the rest it waited)", flush=True)
    captured = {}
    real_roc, real_run_in = BU.run_or_compile, BU.run_in

    def roc(fn, *a, **static):
        captured.setdefault((fn.__name__, static["spec"].fn.__class__.__name__), (fn, a, static))
        return real_roc(fn, *a, **static)

    def run_in(ahead, fn, *a, **static):
        captured.setdefault((fn.__name__, static["spec"].fn.__class__.__name__), (fn, a, static))
        return real_run_in(ahead, fn, *a, **static)

    BU.run_or_compile, BU.run_in = roc, run_in
    t0 = time.perf_counter()
    step(*B._batch(cfg, args, 0, 10))
    sync()
    print(f"one step with capture: {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    BU.run_or_compile, BU.run_in = real_roc, real_run_in

    for (name, block), (fn, a, static) in captured.items():
        _replay(name, block, fn, a, static, args, sync)
    x = torch.zeros(args.batch_size, args.seq_len, cfg.d_model, dtype=torch.bfloat16,
                    device=args.device)
    print(f"\n_share(x) (one DLPack import): {host_us(lambda: BU._share(x), sync=sync):.0f} us")
    if args.pyprofile:
        print(B._pyprofile(step, cfg, args, 0), flush=True)


def _replay(name, block, fn, a, static, args, sync) -> None:
    """One captured program call replayed alone: its host time as the step makes it, ahead of
    time compiled, over flat leaves; its pieces."""
    import jax
    import torch

    import bridge.unit_op as BU

    leaves_in, treedef = jax.tree.flatten(a)
    leaves_out = jax.tree.leaves(fn(*a, **static))
    print(f"\n=== {name} ({block}): {len(leaves_in)} leaves in, {len(leaves_out)} out",
          flush=True)
    print(f"jit call as the step makes it: {host_us(lambda: fn(*a, **static), sync=sync):.0f} us"
          f" (this thread's CPU time: "
          f"{host_us(lambda: fn(*a, **static), sync=sync, clock=time.thread_time):.0f} us)")
    compiled = fn.lower(*a, **static).compile()
    print(f"AOT compiled call: {host_us(lambda: compiled(*a), sync=sync):.0f} us")
    flat = jax.jit(lambda *xs: jax.tree.leaves(fn(*jax.tree.unflatten(treedef, xs), **static)))
    print(f"flat leaves in and out: {host_us(lambda: flat(*leaves_in), sync=sync):.0f} us")
    print(f"jax.tree.flatten of the arguments: "
          f"{host_us(lambda: jax.tree.flatten(a), n=200):.1f} us")
    print(f"hash(spec): {host_us(lambda: hash(static['spec']), n=500):.2f} us")
    if name == "unit_forward":
        xt = torch.zeros(*a[2].shape, dtype=torch.bfloat16, device=args.device)
        fresh = host_us(lambda: fn(a[0], a[1], BU._share(xt), a[3], **static), sync=sync)
        print(f"with x imported afresh each call (import included): {fresh:.0f} us")
    first, device = leaves_out[0], torch.device(args.device)
    print(f"to_torch of one result: "
          f"{host_us(lambda: BU._result(first, device), sync=sync):.0f} us")


def _plain_step(args, cfg, sinks: bool):
    """The mxfp8 run's step without the benchmark's timed refresh; ``sinks=False``: the unit
    programs return every gradient to autograd (the per-parameter hooks stage them)."""
    from benchmarks import bench_train_step as B
    from torch_side.fsdp.fsdp_unit import ParamShare, WeightPlanes

    saved = WeightPlanes.grad_target, ParamShare.grad_target
    if not sinks:
        WeightPlanes.grad_target = ParamShare.grad_target = None
    try:
        model, step, _ = B._build("mxfp8", cfg, args)
        model.__dict__.pop("refresh_model_weights", None)
        for i in range(3):  # specs (with or without sinks) are made and cached here
            step(*B._batch(cfg, args, 0, i))
    finally:
        WeightPlanes.grad_target, ParamShare.grad_target = saved
    return model, step


def _ab(args, cfg, sync) -> None:
    import gc

    from benchmarks import bench_train_step as B

    sinks = _plain_step(args, cfg, True)

    def without_gc(*batch, _step=sinks[1]):
        gc.disable()
        try:
            return _step(*batch)
        finally:
            gc.enable()

    runs = {"A hooks": _plain_step(args, cfg, False), "B sinks": sinks,
            "C sinks, Python's cyclic GC off during the step": (sinks[0], without_gc)}
    res = {k: ([], []) for k in runs}
    for rnd in range(4):
        for name, (_, step) in runs.items():
            for i in range(5):
                batch = B._batch(cfg, args, 0, 1000 * rnd + i)
                sync()
                t0 = time.perf_counter()
                step(*batch)
                t1 = time.perf_counter()
                sync()
                res[name][0].append(t1 - t0)
                res[name][1].append(time.perf_counter() - t0)
    for name, (host, total) in res.items():
        print(f"{name}: host {1e3 * statistics.median(host):.1f} ms, step "
              f"{1e3 * statistics.median(total):.1f} ms (median of {len(total)}, 4 rounds "
              f"interleaved)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
