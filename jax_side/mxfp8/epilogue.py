"""The ``fp8_blocked`` GEMM with the MLP's GELU in its epilogue (issue 33): one pass over the output
instead of a GEMM and an elementwise pass.

- ``blocked_product_gelu(ra, rb, m, n)``: ``(GELU_tanh(acc), acc)`` rounded once each to
  bfloat16, acc the GEMM's fp32 accumulator -- an MLP's first linear writes its GELU's output
  (the second linear's input) and its input (the GELU's backward needs it) together.
- ``blocked_product_dgelu(ra, rb, aux, m, n)``: ``acc * GELU_tanh'(aux)`` rounded once to
  bfloat16, aux the bfloat16 GELU input -- the second linear's dgrad writes the gradient of the
  GELU's input directly.

On a GPU with the ``fp8_blocked`` GEMM these are cuBLASLt's ``GELU_AUX`` and ``DGELU``
epilogues (``cublaslt.blocked_gemm_gelu`` / ``blocked_gemm_dgelu``); elsewhere (the CPU, the
Pallas GEMM) the fp32 GEMM followed by ``gelu_aux_reference`` / ``dgelu_reference``, the numbers
the epilogues are held to: the same accumulator, the GELU (or its derivative) in fp32, one
rounding. These differ from the unfused path (``models.gpt_math.gelu_tanh`` of the bfloat16 GEMM
output; the GELU's gradient from the bfloat16 dgrad) by the rounding of the accumulator before
the GELU: the fused values are the more exact ones. cuBLASLt's own GELU arithmetic (its tanh) is
not XLA's: ``tests/jax_side/mxfp8/test_epilogue.py`` bounds the kernel against the references
on the GPU (``EPILOGUE_BOUND_ULPS`` bfloat16 units in the last place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_side.mxfp8 import cublaslt, reblock
from jax_side.mxfp8.fp8_blocked_kernel import blocked_matmul

__all__ = ["EPILOGUES", "EPILOGUE_BOUND_ULPS", "blocked_product_dgelu", "blocked_product_gelu",
           "check_post", "dgelu_reference", "gelu_aux_reference", "gelu_grad", "gelu_tanh"]

_F32, _BF16 = jnp.float32, jnp.bfloat16
# The largest difference, in bfloat16 units in the last place of the reference's magnitude,
# that the cuBLASLt epilogues may show against gelu_aux_reference / dgelu_reference (their GELU
# and its derivative are evaluated with other fp32 arithmetic than XLA's).
EPILOGUE_BOUND_ULPS = 2


def gelu_tanh(h: jax.Array) -> jax.Array:
    """GELU (tanh approximation) in fp32, rounded once to ``h``'s dtype: the GPT's
    (``models.gpt_math.gelu_tanh``; ``tests/jax_side/mxfp8/test_epilogue.py`` checks they give
    the same bytes), applied after a linear that cannot fuse it."""
    return jax.nn.gelu(h.astype(_F32), approximate=True).astype(h.dtype)


# The functions a unit program's linear can apply to its output in the GEMM's epilogue
# (``linear(name, x, post="gelu_tanh")``), by name; where it cannot (another GEMM, fp32
# activations, column parts), the function runs after the linear, checkpointed.
EPILOGUES = {"gelu_tanh": gelu_tanh}


def check_post(post: object, what: str) -> None:
    """A clear error unless ``post`` names one of ``EPILOGUES`` (``what`` names the caller)."""
    if not isinstance(post, str) or post not in EPILOGUES:
        raise ValueError(f"{what}: post={post!r} is not an epilogue the linear can apply; "
                         f"expected one of {sorted(EPILOGUES)} (apply other functions to the "
                         f"linear's output yourself)")


def gelu_grad(x: jax.Array) -> jax.Array:
    """fp32 d GELU_tanh(x) / dx (``jax.nn.gelu(approximate=True)``'s derivative by autodiff)."""
    xf = x.astype(_F32)
    _, pull = jax.vjp(lambda v: jax.nn.gelu(v, approximate=True), xf)
    return pull(jnp.ones_like(xf))[0]


def gelu_aux_reference(acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(bf16(GELU_tanh(acc)), bf16(acc)) of an fp32 accumulator: what ``GELU_AUX`` writes."""
    acc = acc.astype(_F32)
    return gelu_tanh(acc).astype(_BF16), acc.astype(_BF16)


def dgelu_reference(acc: jax.Array, aux: jax.Array) -> jax.Array:
    """bf16(acc * GELU_tanh'(aux)) of an fp32 accumulator and the GELU's bf16 input: what
    ``DGELU`` writes."""
    return (acc.astype(_F32) * gelu_grad(aux)).astype(_BF16)


def _fp32(ra: reblock.Reblocked, rb: reblock.Reblocked, pallas: bool) -> jax.Array:
    if pallas and jax.devices()[0].platform == "gpu":
        return lax.platform_dependent(ra, rb, cuda=lambda a, b: blocked_matmul(a, b),
                                      default=reblock.blocked_dot_reference)
    return reblock.blocked_dot_reference(ra, rb)


def _on_cuda(pallas: bool) -> bool:
    return not pallas and jax.devices()[0].platform == "gpu"


def blocked_product_gelu(ra: reblock.Reblocked, rb: reblock.Reblocked, m: int, n: int, *,
                         pallas: bool = False) -> tuple[jax.Array, jax.Array]:
    """(GELU output, GELU input), bfloat16 (m, n), of ``ra @ rb^T`` (module docstring)."""
    def exact(ra: reblock.Reblocked, rb: reblock.Reblocked) -> tuple[jax.Array, jax.Array]:
        return gelu_aux_reference(_fp32(ra, rb, pallas))

    if _on_cuda(pallas):
        g, h = lax.platform_dependent(ra, rb, cuda=cublaslt.blocked_gemm_gelu, default=exact)
    else:
        g, h = exact(ra, rb)
    return g[:m, :n], h[:m, :n]


def blocked_product_dgelu(ra: reblock.Reblocked, rb: reblock.Reblocked, aux: jax.Array, m: int,
                          n: int, *, pallas: bool = False) -> jax.Array:
    """bfloat16 (m, n) ``(ra @ rb^T) * GELU'(aux)`` (module docstring); ``aux``: the GELU's
    bfloat16 (m, n) input."""
    mp, np_ = ra.data.shape[0], rb.data.shape[0]
    if aux.dtype != _BF16 or tuple(aux.shape) != (m, n):
        raise ValueError(f"blocked_product_dgelu: aux must be bfloat16 {(m, n)}, got "
                         f"{aux.dtype}{list(aux.shape)}")
    auxp = jnp.pad(aux, ((0, mp - m), (0, np_ - n)))

    def exact(ra: reblock.Reblocked, rb: reblock.Reblocked, auxp: jax.Array) -> jax.Array:
        return dgelu_reference(_fp32(ra, rb, pallas), auxp)

    if _on_cuda(pallas):
        out = lax.platform_dependent(ra, rb, auxp, cuda=cublaslt.blocked_gemm_dgelu,
                                     default=exact)
    else:
        out = exact(ra, rb, auxp)
    return out[:m, :n]
