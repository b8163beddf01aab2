"""Where a training step's GPU memory goes (issue 32's memory target): one run of
``bench_train_step`` (e.g. ``mxfp8:u4`` at 1.3B), warm, then per phase of one more step.

Prints, for the phases forward (``model(tokens, targets)``), backward and optimizer step:
- Torch's allocated and peak GiB, JAX's bytes in use and its peak so far (JAX's peak cannot be
  reset: the phase where it grows is the phase that set it);
- after the forward, JAX's live arrays grouped by (shape, dtype), largest totals first (the
  residuals the backward will read, and anything else held), and the CUDA tensors Torch holds,
  by storage, grouped the same way, each marked "jax" where JAX allocated it (DLPack);
- each distinct unit program the step ran (``bridge.unit_op``'s calls), compiled again
  ahead of time: XLA's argument, output, alias and temporary sizes (``memory_analysis``).

    python3 -m benchmarks.probe_memory --config gpt-1.3b --run mxfp8:u4 --gemm fp8_blocked

A diagnostic (no assertions, nothing recorded): its numbers go to BENCHMARKS.md by hand.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

GIB = 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--config", default="gpt-1.3b")
    p.add_argument("--run", default="mxfp8:u4")
    p.add_argument("--gemm", default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-programs", action="store_true", help="skip the programs' analyses")
    args = p.parse_args(argv)
    from torch_side.launch import run_local_ranks

    run_local_ranks(_rank, 1, (args,), device=args.device)
    return 0


def _group(items, top: int) -> str:
    """items: (shape, dtype, nbytes, tag) -> the largest groups, one line each."""
    groups: dict = collections.defaultdict(lambda: [0, 0])
    for shape, dtype, nbytes, tag in items:
        g = groups[(tuple(shape), str(dtype), tag)]
        g[0] += 1
        g[1] += nbytes
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for v in groups.values())
    lines = [f"  total {total / GIB:.2f} GiB in {sum(v[0] for v in groups.values())} buffers"]
    for (shape, dtype, tag), (n, b) in rows[:top]:
        lines.append(f"  {b / GIB:7.3f} GiB  {n:4d} x {dtype:>9} {shape} {tag}")
    return "\n".join(lines)


def _jax_live() -> tuple[list, set]:
    import jax

    items, ptrs = [], set()
    for a in jax.live_arrays():
        try:
            ptr = a.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 -- deleted or multi-device: counted, not deduplicated
            ptr = None
        if ptr is not None:
            if ptr in ptrs:
                continue
            ptrs.add(ptr)
        items.append((a.shape, a.dtype, a.nbytes, ""))
    return items, ptrs


def _torch_live(jax_ptrs: set) -> list:
    import torch

    seen, items = set(), []
    with warnings.catch_warnings():  # (isinstance on some torch modules' objects warns)
        warnings.simplefilter("ignore")
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objs:
        try:
            if not obj.is_cuda:
                continue
            st = obj.untyped_storage()
        except Exception:  # noqa: BLE001 -- fake or freed tensors
            continue
        ptr = st.data_ptr()
        if ptr in seen or st.nbytes() == 0:
            continue
        seen.add(ptr)
        items.append((obj.shape, obj.dtype, st.nbytes(), "jax" if ptr in jax_ptrs else ""))
    return items


class _Programs:
    """Records each distinct unit program call (function, abstract arguments, static spec)."""

    def __init__(self):
        self.calls: dict = {}

    def wrap(self, run):
        import jax

        def recorded(*a, **kw):
            fn = a[1] if run.__name__ == "run_in" else a[0]
            args = a[2:] if run.__name__ == "run_in" else a[1:]
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array) else x, args)
            key = (fn.__name__, kw.get("spec"))  # (units of equal specs: one program)
            self.calls.setdefault(key, (fn, abstract, kw))
            return run(*a, **kw)

        recorded.__name__ = run.__name__
        return recorded

    def report(self) -> str:
        lines = []
        for (name, _), (fn, abstract, kw) in self.calls.items():
            m = fn.lower(*abstract, **kw).compile().memory_analysis()
            if m is None:
                lines.append(f"  {name}: no memory analysis on this backend")
                continue
            lines.append(
                f"  {name:28s} args {m.argument_size_in_bytes / GIB:6.2f}  out "
                f"{m.output_size_in_bytes / GIB:6.2f}  alias {m.alias_size_in_bytes / GIB:6.2f}  "
                f"temp {m.temp_size_in_bytes / GIB:6.2f} GiB")
        return "\n".join(lines)


def _rank(args) -> None:
    import torch

    import bridge.unit_op as BU
    from benchmarks import bench_train_step as B
    from common.model_config import PRESETS

    cfg = PRESETS[args.config]
    args.world_size = 1
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    programs = _Programs()
    BU.run_or_compile = programs.wrap(BU.run_or_compile)
    BU.run_in = programs.wrap(BU.run_in)
    model, step, _ = B._build(args.run, cfg, args)
    for i in range(2):
        step(*B._batch(cfg, args, 0, i))
    sync()
    opt = step.optimizer

    def state(label: str) -> None:
        sync()
        jax_use, jax_peak = B._jax_memory()
        t_alloc = torch.cuda.memory_allocated() / GIB if cuda else 0.0
        t_peak = torch.cuda.max_memory_allocated() / GIB if cuda else 0.0
        print(f"{label:>10}: torch {t_alloc:6.2f} (peak in phase {t_peak:6.2f})  "
              f"jax {jax_use:6.2f} (peak so far {jax_peak:6.2f}) GiB", flush=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    tokens, targets = B._batch(cfg, args, 0, 2)
    state("start")
    loss = model(tokens, targets)
    state("forward")
    jax_items, ptrs = _jax_live()
    print("JAX live arrays after the forward:\n" + _group(jax_items, args.top))
    print("Torch CUDA storages after the forward ('jax': allocated by JAX):\n"
          + _group(_torch_live(ptrs), args.top), flush=True)
    loss.backward()
    state("backward")
    opt.step()
    opt.zero_grad()
    state("optimizer")
    if not args.no_programs:
        print("unit programs (XLA memory_analysis, compiled again):\n" + programs.report())


if __name__ == "__main__":
    raise SystemExit(main())
