"""The ``fp8_blocked`` GEMM with the MLP's GELU in its epilogue (issue 33): one pass over the output
instead of a GEMM and an elementwise pass.

``blocked_product_gelu(ra, rb, m, n)``: ``(GELU_tanh(acc), acc)`` rounded once each to bfloat16,
acc the GEMM's fp32 accumulator -- an MLP's first linear writes its GELU's output (the second
linear's input) and its input (the GELU's backward needs it) together. On a GPU with the
``fp8_blocked`` GEMM this is cuBLASLt's ``GELU_AUX`` epilogue (``cublaslt.blocked_gemm_gelu``);
elsewhere (the CPU, the Pallas GEMM) the fp32 GEMM followed by ``gelu_aux_reference``, the numbers
the epilogue is held to: the same accumulator, the GELU in fp32, one rounding. They differ from
the unfused path (``models.gpt_math.gelu_tanh`` of the bfloat16 GEMM output) by the rounding of
the accumulator before the GELU: the fused values are the more exact ones. The GELU's input is
the plain GEMM's bfloat16 output, byte for byte. cuBLASLt's own GELU arithmetic (its tanh) is
not XLA's: ``tests/jax_side/mxfp8/test_epilogue.py`` bounds the kernel against the reference on
the GPU (``EPILOGUE_BOUND_ULPS`` bfloat16 units in the last place, or 2^-16 of the accumulator
where 1 + tanh cancels).

cuBLASLt's ``DGELU`` epilogue (the second linear's dgrad times the GELU's derivative) was tried
and dropped: its heuristic offers one algorithm for these GEMMs on the H100, 3.6-5.4x the plain
GEMM's time, 2.2-2.7x the GEMM and XLA's GELU backward together (BENCHMARKS.md, session 20), so
the backward keeps XLA's pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_side.mxfp8 import cublaslt, reblock
from jax_side.mxfp8.gemm_impls import blocked_product

__all__ = ["EPILOGUES", "EPILOGUE_BOUND_ULPS", "Epilogue", "bf16_ulps", "blocked_product_gelu",
           "check_post", "gelu_aux_reference", "gelu_tanh"]

_F32, _BF16 = jnp.float32, jnp.bfloat16
# The largest difference, in bfloat16 units in the last place of the reference's magnitude,
# that the cuBLASLt epilogue may show against gelu_aux_reference (its GELU is evaluated with
# other fp32 arithmetic than XLA's)
EPILOGUE_BOUND_ULPS = 2


def gelu_tanh(h: jax.Array) -> jax.Array:
    """GELU (tanh approximation) in fp32, rounded once to ``h``'s dtype: the GPT's
    (``models.gpt_math.gelu_tanh``; ``tests/jax_side/mxfp8/test_epilogue.py`` checks they give
    the same bytes), applied after a linear that cannot fuse it."""
    return jax.nn.gelu(h.astype(_F32), approximate=True).astype(h.dtype)


def gelu_aux_reference(acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(bf16(GELU_tanh(acc)), bf16(acc)) of an fp32 accumulator: what ``GELU_AUX`` writes."""
    acc = acc.astype(_F32)
    return gelu_tanh(acc).astype(_BF16), acc.astype(_BF16)


def blocked_product_gelu(ra: reblock.Reblocked, rb: reblock.Reblocked, m: int, n: int, *,
                         pallas: bool = False) -> tuple[jax.Array, jax.Array]:
    """(GELU output, GELU input), bfloat16 (m, n), of ``ra @ rb^T`` (module docstring): on a
    GPU with cuBLASLt's GEMM its ``GELU_AUX`` epilogue, elsewhere ``gemm_impls.blocked_product``
    in fp32 (the exact dot, or the Pallas GEMM), then ``gelu_aux_reference``."""
    mp, np_ = ra.data.shape[0], rb.data.shape[0]

    def apart(ra: reblock.Reblocked, rb: reblock.Reblocked) -> tuple[jax.Array, jax.Array]:
        return gelu_aux_reference(blocked_product(ra, rb, mp, np_, _F32, pallas=pallas))

    if not pallas and jax.devices()[0].platform == "gpu":
        g, h = lax.platform_dependent(ra, rb, cuda=cublaslt.blocked_gemm_gelu, default=apart)
    else:
        g, h = apart(ra, rb)
    return g[:m, :n], h[:m, :n]


def bf16_ulps(got: object, ref: object) -> np.ndarray:
    """|got - ref| (float64) in bf16 units in the last place of |ref| (the smallest normal's
    below it): how ``EPILOGUE_BOUND_ULPS`` is measured."""
    g, r = (np.asarray(v).astype(np.float64) for v in (got, ref))
    exp = np.floor(np.log2(np.maximum(np.abs(r), 2.0 ** -126)))
    return np.abs(g - r) / 2.0 ** (exp - 7)


class Epilogue(NamedTuple):
    """A function a linear can apply to its output (``fn``: of the output, as after the
    linear) and the GEMM that applies it in its epilogue (``product``: ``blocked_product_gelu``'s
    signature, (fn's output, the linear's output))."""

    fn: Callable[[jax.Array], jax.Array]
    product: Callable[..., tuple[jax.Array, jax.Array]]


# The functions a unit program's linear can apply to its output in the GEMM's epilogue
# (``linear(name, x, post="gelu_tanh")``), by name; where it cannot (another GEMM, fp32
# activations), ``fn`` runs after the linear, checkpointed.
EPILOGUES = {"gelu_tanh": Epilogue(gelu_tanh, blocked_product_gelu)}


def check_post(post: object, what: str) -> None:
    """A clear error unless ``post`` names one of ``EPILOGUES`` (``what`` names the caller)."""
    if not isinstance(post, str) or post not in EPILOGUES:
        raise ValueError(f"{what}: post={post!r} is not an epilogue the linear can apply; "
                         f"expected one of {sorted(EPILOGUES)} (apply other functions to the "
                         f"linear's output yourself)")
