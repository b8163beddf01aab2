"""What it costs to lay a unit's weight gradients out as the FSDP grad bucket (issue 32, item 3).

One unit of ``--blocks`` GPT blocks of ``--config`` at ``--tokens`` tokens: each linear's wgrad
as a bf16 x bf16 -> fp32 dot (the producer the unit program has), then the gradients laid out
in the group's flat fp32 buffer (LayerNorm gradients too), per variant, in one process:

- ``dots``: the wgrads alone, returned as separate arrays (the floor: no layout at all);
- ``concat``: the layout before issue 32 (the group's buffer by concatenation,
  ``unit_grads.flat_group_reference``, then packed with dx into one uint8 array);
- ``concat_only``: the group's buffer by concatenation, returned on its own (no uint8 pack);
- ``dus``: ``unit_grads.flat_group``, what the unit programs run: a zero buffer, then one
  in-place ``dynamic_update_slice`` per gradient;
- ``add_donated``: the bucket passed in donated and each gradient added into its slice
  (``.at[].add``), returned aliased (what accumulating into the bucket in place costs);
- ``copy``: read and write the buffer's bytes once (x + 0), the streaming ceiling.

ms = median wall time per call over ``--reps`` repetitions of ``--calls`` back-to-back calls
(GPU-bound at these sizes). Layout cost = variant - ``dots``.

GPU: ``python -m benchmarks.bench_grad_layout --config gpt-1.3b --out grad_layout.json``
CPU smoke: ``python -m benchmarks.bench_grad_layout --config tiny --tokens 64 --calls 1 --reps 1``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from common.formats import round_up
from common.model_config import PRESETS as CONFIGS
from jax_side.unit_grads import ALIGN, GradGroup, flat_group, flat_group_reference, pack_grads


def _shapes(d: int, ff: int, blocks: int) -> list[tuple[str, tuple[int, ...]]]:
    per = [("ln1.w", (d,)), ("ln1.b", (d,)), ("qkv", (3 * d, d)), ("proj", (d, d)),
           ("ln2.w", (d,)), ("ln2.b", (d,)), ("fc1", (ff, d)), ("fc2", (d, ff))]
    return [(f"{b}.{n}", s) for b in range(blocks) for n, s in per]


def _group(shapes: list[tuple[str, tuple[int, ...]]]) -> GradGroup:
    slots, cursor = [], 0
    for i, (_, shape) in enumerate(shapes):
        slots.append((i, cursor))
        cursor = round_up(cursor + int(np.prod(shape)), 64)
    return GradGroup(cursor, "float32", tuple(slots))


def _inputs(shapes, tokens: int, key: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Per gradient (dy (T, N), x (T, K)) bf16 for a weight, (x (T, d)) for a vector."""
    out = []
    for i, (_, shape) in enumerate(shapes):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        if len(shape) == 2:
            n, k = shape
            out.append((jax.random.normal(k1, (tokens, n), jnp.bfloat16),
                        jax.random.normal(k2, (tokens, k), jnp.bfloat16)))
        else:
            out.append((jax.random.normal(k1, (tokens, shape[0]), jnp.bfloat16),))
    return out


def _grads(inputs) -> list[jax.Array]:
    grads = []
    for pair in inputs:
        if len(pair) == 2:
            dy, x = pair
            grads.append(lax.dot_general(dy, x, (((0,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32))
        else:
            grads.append(jnp.sum(pair[0].astype(jnp.float32), axis=0))
    return grads


def variants(group: GradGroup, dx_shape: tuple[int, int]):
    def dots(inputs):
        return tuple(_grads(inputs))

    def concat(inputs):
        dx = jnp.zeros(dx_shape, jnp.bfloat16)
        flat = flat_group_reference(group, _grads(inputs))
        return pack_grads((dx, flat), [], ()).packed  # dx and the buffer in one uint8 array

    def concat_only(inputs):
        return flat_group_reference(group, _grads(inputs))

    def dus(inputs):
        return flat_group(group, _grads(inputs))

    def add_donated(bucket, inputs):
        for (_, start), g in zip(group.slots, _grads(inputs), strict=True):
            part = lax.dynamic_slice(bucket, (start,), (g.size,)) + g.reshape(-1)
            bucket = lax.dynamic_update_slice(bucket, part, (start,))
        return bucket

    def set_donated(bucket, inputs):
        for (_, start), g in zip(group.slots, _grads(inputs), strict=True):
            bucket = lax.dynamic_update_slice(bucket, g.reshape(-1), (start,))
        return bucket

    def copy(bucket, inputs):
        return bucket + 0.0

    out = {"dots": (jax.jit(dots), False), "concat": (jax.jit(concat), False),
           "concat_only": (jax.jit(concat_only), False), "dus": (jax.jit(dus), False),
           "add_donated": (jax.jit(add_donated, donate_argnums=0), True),
           "set_donated": (jax.jit(set_donated, donate_argnums=0), True),
           "copy": (jax.jit(copy, donate_argnums=0), True)}
    if jax.default_backend() == "gpu":  # XLA's dynamic-slice fusion: a GEMM writes its slice
        dsf = {"xla_gpu_enable_dynamic_slice_fusion": True}
        out["dus_dsf"] = (jax.jit(dus, compiler_options=dsf), False)
        out["set_donated_dsf"] = (jax.jit(set_donated, donate_argnums=0,
                                          compiler_options=dsf), True)
        out["add_donated_dsf"] = (jax.jit(add_donated, donate_argnums=0,
                                          compiler_options=dsf), True)
    return out


def _time(fn, donated: bool, bucket: jax.Array, inputs, calls: int, reps: int
          ) -> tuple[float, jax.Array]:
    def call(b: jax.Array) -> tuple[jax.Array, jax.Array]:  # (result, the bucket to pass next)
        if donated:
            b = fn(b, inputs)
            return b, b
        return fn(inputs), b

    for _ in range(2):  # compile and warm
        out, bucket = call(bucket)
        jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out, bucket = call(bucket)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(times), bucket


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="gpt-1.3b", choices=sorted(CONFIGS))
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cfg = CONFIGS[args.config]
    d, ff = cfg.d_model, cfg.d_ff
    shapes = _shapes(d, ff, args.blocks)
    group = _group(shapes)
    assert group.numel * 4 % ALIGN == 0
    inputs = _inputs(shapes, args.tokens, jax.random.key(0))
    bucket = jnp.zeros((group.numel,), jnp.float32)
    ref = np.asarray(variants(group, (args.tokens, d))["concat_only"][0](inputs))
    rows, kinds = {}, {}
    for name, (fn, donated) in variants(group, (args.tokens, d)).items():
        if donated:
            bucket = jnp.zeros((group.numel,), jnp.float32)
        ms, bucket = _time(fn, donated, bucket, inputs, args.calls, args.reps)
        if name.startswith("dus"):
            same = bool(np.array_equal(np.asarray(fn(inputs)), ref))
            if not same:
                raise SystemExit(f"{name}: bytes differ from concat_only")
        rows[name] = ms
        args_ = (bucket, inputs) if donated else (inputs,)
        try:
            text = fn.lower(*args_).compile().as_text()
            kinds[name] = {k: text.count(k) for k in
                           ("dynamic_address_computation", "address_computation",
                            "dynamic-slice-fusion", "concatenate", "custom-call")}
        except Exception as e:  # noqa: BLE001 -- a report only
            kinds[name] = repr(e)[:200]
    gb = group.numel * 4 / 1e9
    print(f"device {jax.devices()[0].device_kind}  config {args.config}  blocks {args.blocks}  "
          f"tokens {args.tokens}  bucket {gb:.2f} GB fp32")
    for name, ms in rows.items():
        extra = "" if name in ("dots", "copy") else f"  layout {ms - rows['dots']:+.2f} ms"
        print(f"  {name:16s} {ms:8.2f} ms{extra}  {kinds.get(name)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "config": args.config, "blocks": args.blocks, "tokens": args.tokens,
                       "bucket_gb": gb, "ms": rows, "hlo": kinds}, f, indent=1)


if __name__ == "__main__":
    main()
