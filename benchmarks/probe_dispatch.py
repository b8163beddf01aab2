"""Host cost of one MXFP8 linear's pieces on a CUDA GPU, in isolation (no training step around
them): a trivial jitted call, one with the linear's signature, the forward and backward programs,
``to_jax`` and ``to_torch``. "host" = per-call time of 200 back-to-back calls without waiting;
"wall" = the same with the results waited for (host close to wall: the GPU, not dispatch, sets
the pace). Shape 8192 x 768 -> 3072, bf16 (the GPT-2 124M fc layer at batch 8 x 1024).

    python3 -m benchmarks.probe_dispatch        # needs a CUDA GPU
"""

from __future__ import annotations

import functools
import os
import time


def _timed(f, n: int = 200) -> str:
    import jax
    import torch

    jax.block_until_ready(f())
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        r = f()
    host = (time.perf_counter() - t) / n * 1e6
    jax.block_until_ready(r)
    t = time.perf_counter()
    for _ in range(n):
        r = f()
    jax.block_until_ready(r)
    wall = (time.perf_counter() - t) / n * 1e6
    return f"host {host:.1f} us/call, wall {wall:.1f} us/call"


def main() -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    import torch

    from bridge import start_jax_backend, to_jax, to_torch
    from common.formats import Plane
    from jax_side import linear as L
    from jax_side.mxfp8 import resolve_kernels

    if not torch.cuda.is_available():
        raise SystemExit("probe_dispatch: needs a CUDA GPU")
    start_jax_backend()
    k = resolve_kernels(None, "gpu")
    t, kk, n = 8192, 768, 3072
    xt = torch.randn(t, kk, device="cuda", dtype=torch.bfloat16)
    x_imp = to_jax(xt)
    x_jax = jnp.asarray(x_imp) + 0
    wq = L.quantize_weight(jnp.ones((n, kk), jnp.float32), kernels=k)
    w_row, w_col = wq.only(Plane.ROWWISE), wq.only(Plane.COLWISE)
    fwd = functools.partial(L.forward, out_dtype=jnp.bfloat16, keep_x_colwise=True, kernels=k)

    @functools.partial(jax.jit, static_argnames=("out_dtype", "keep_x_colwise", "kernels"))
    def same_signature(x2d, w, *, out_dtype, keep_x_colwise, kernels):
        return x2d

    one = jax.jit(lambda a: a)
    out = fwd(x_jax, w_row)
    dy = jnp.ones((t, n), jnp.bfloat16)
    bwd = functools.partial(L.backward, dx_dtype=jnp.bfloat16, dw_dtype=jnp.float32, kernels=k,
                            packed=True)
    rows = [
        ("trivial 1-argument jit", lambda: one(x_jax)),
        ("trivial, the forward's signature", lambda: same_signature(
            x_jax, w_row, out_dtype=jnp.bfloat16, keep_x_colwise=True, kernels=k)),
        ("forward, x made by JAX", lambda: fwd(x_jax, w_row)),
        ("forward, x imported from Torch", lambda: fwd(x_imp, w_row)),
        ("backward (dx + dW, packed)", lambda: bwd(dy, w_col, out.x_colwise)),
        ("to_jax (8192 x 768 bf16)", lambda: to_jax(xt)),
        ("to_torch (8192 x 3072 bf16)", lambda: to_torch(out.y)),
    ]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, torch {torch.__version__}")
    for name, f in rows:
        print(f"{name:36s} {_timed(f)}")


if __name__ == "__main__":
    main()
