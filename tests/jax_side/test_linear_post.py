"""The GELU of a linear's output written by the GEMM's epilogue (``linear(name, h,
post="gelu_tanh")`` in a unit program; the GPT's MLP with ``models.gpt_math.GELU_IN_GEMM``,
issue 33): with the ``fp8_blocked`` GEMM and bfloat16 activations one GEMM writes the GELU's
output and its input (``unit_linear.unit_linear_post``: cuBLASLt's ``GELU_AUX`` on a GPU, the
exact dot and ``epilogue.gelu_aux_reference`` on the CPU), and the backward takes the GELU's
cotangent through ``jax.vjp(gelu, input)``. Elsewhere (another GEMM, fp32 activations, a
high-precision linear) ``jax.checkpoint(gelu)`` of the linear's output: the bytes of the GELU
apart.

The fused GELU is computed from the fp32 accumulator, the unfused one from its bf16 rounding, so
the block's numbers move by that rounding, re-rounded by the next linear's FP8 quantize: the
block's output and the second linear's dW stay within ``GELU_MOVE`` (relative Frobenius) of the
GELU apart, everything else is byte-equal; with that rounding put back, all of it is.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.kernels import KernelConfig
from jax_side import unit_program as U
from jax_side.mxfp8 import epilogue, resolve_kernels
from models import gpt_math
from tests.jax_side.test_linear_parts import _arrays, _inputs, _step, kept_and_recomputed
from tests.jax_side.test_linear_pre import _spy as spy

# How far the block's output and mlp.proj's dW may move when the GELU is of the fp32
# accumulator rather than of its bf16 rounding: 1 bf16 ulp in about a quarter of the GELU's
# outputs, some of which the FP8 quantize of the next linear's input then moves to the next
# e4m3 step (measured: 5.2e-3 and 1.3e-2 on the CPU)
GELU_MOVE = 2e-2


@pytest.fixture
def gelu_in_gemm(monkeypatch):
    """``GELU_IN_GEMM`` set per call (restored after the test) with the traces cleared."""
    def use(on: bool) -> None:
        monkeypatch.setattr(gpt_math, "GELU_IN_GEMM", on)
        jax.clear_caches()

    yield use
    jax.clear_caches()


def _spy(monkeypatch):
    return spy(monkeypatch, "unit_linear_post")


def _rels(inputs, got, want):
    """Relative Frobenius distances of the block's output, dx, each parameter's and each
    weight's gradient (``_arrays``' order)."""
    spec, params, rows, cols, x = inputs
    out = []
    g = [np.frombuffer(got[0], jnp.bfloat16).astype(np.float64),
         *_arrays(spec, params, x, got[1])]
    w = [np.frombuffer(want[0], jnp.bfloat16).astype(np.float64),
         *_arrays(spec, params, x, want[1])]
    for a, b in zip(g, w, strict=True):
        out.append(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
    return out


def test_the_gelu_in_the_gemm_has_the_bytes_of_the_gelu_apart_from_a_rounded_accumulator(
        gelu_in_gemm, monkeypatch):
    """With the epilogue's reference made to round the accumulator to bf16 before the GELU (as
    the unfused path does), the fused block's output, dx and every gradient are byte-equal to
    the GELU apart: the residuals, the GELU's backward and the wgrad operands are the same; the
    one difference is the documented rounding."""
    inputs = _inputs("xla")
    ran = _spy(monkeypatch)
    monkeypatch.setattr(epilogue, "gelu_aux_reference", lambda acc: (
        epilogue.gelu_tanh(acc.astype(jnp.bfloat16)), acc.astype(jnp.bfloat16)))
    gelu_in_gemm(True)
    fused = _step(*inputs)
    assert ran == [2], "mlp.fc (linear 2) took the GELU as its post"
    gelu_in_gemm(False)
    assert fused == _step(*inputs)


def test_the_gelu_in_the_gemm_moves_only_what_the_gelus_output_reaches(gelu_in_gemm):
    """The real epilogue (the GELU of the fp32 accumulator): the block's output and mlp.proj's
    dW (``dout^T GELU``) move by the GELU's bf16 rounding as FP8 re-rounds it -- within
    ``GELU_MOVE`` of the GELU apart (MXFP8's own error on a tensor is about 2.7e-2) and not
    equal; dx and every other gradient do not depend on the GELU's output: byte-equal."""
    inputs = _inputs("xla")
    gelu_in_gemm(True)
    fused = _step(*inputs)
    gelu_in_gemm(False)
    rels = _rels(inputs, fused, _step(*inputs))
    assert 0 < rels[0] <= GELU_MOVE and 0 < rels[-1] <= GELU_MOVE, rels
    assert rels[1:-1] == [0.0] * (len(rels) - 2), rels


def test_the_recompute_backward_with_post_has_the_kept_backwards_bytes(gelu_in_gemm):
    gelu_in_gemm(True)
    packed, redo, out, alone = kept_and_recomputed(*_inputs("xla"))
    assert packed == redo and out == alone


@pytest.mark.parametrize("case", ["exact GEMM", "fp32 activations"])
def test_where_post_cannot_be_fused_it_runs_after_with_the_bytes_of_the_gelu_apart(
        case, gelu_in_gemm, monkeypatch):
    spec, params, rows, cols, x = _inputs("xla")
    if case == "exact GEMM":
        spec = spec._replace(kernels=resolve_kernels(KernelConfig(backend="xla")))
    else:
        x = x.astype(jnp.float32)
        spec = spec._replace(fn=dataclasses.replace(spec.fn, activations=gpt_math.Activations.FP32))
    ran = _spy(monkeypatch)
    got = []
    for on in (True, False):
        gelu_in_gemm(on)
        got.append(_step(spec, params, rows, cols, x))
    assert ran == [] and got[0] == got[1]


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(post="relu"), r"post='relu' is not an epilogue the linear can apply"),
    (dict(post=gpt_math.gelu_tanh), r"expected one of \['gelu_tanh'\]"),
    (dict(post="gelu_tanh", parts=2), r"post applies to one output, not to parts=2"),
])
def test_a_post_that_is_no_epilogue_is_refused_by_name(kwargs, match):
    spec, params, rows, cols, x = _inputs("xla")

    @dataclasses.dataclass(frozen=True)
    class AsksPost:
        def __call__(self, params, linear, h):
            out = linear("attn.qkv", h, **kwargs)
            return out[0] if isinstance(out, tuple) else out[..., :h.shape[-1]]

    with pytest.raises(ValueError, match=match):
        U.unit_forward(params, rows, x, (), spec=spec._replace(fn=AsksPost()))


def test_the_mlp_takes_the_gelu_in_one_linear_only():
    x = jnp.ones((2, 4, 8))
    with pytest.raises(ValueError, match="gelu_in_proj or gelu_in_fc, not both"):
        gpt_math.mlp(x, fc=lambda v: v, proj=lambda v: v, gelu_in_proj=True, gelu_in_fc=True)
    assert np.asarray(gpt_math.mlp(x, fc=lambda v: -v, proj=lambda v: v,
                                   gelu_in_fc=True)).tolist() == (-x).tolist()


@pytest.mark.gpu
def test_on_the_gpu_the_gelu_in_the_gemm_stays_within_the_bound(gelu_in_gemm):
    """Compiled (cuBLASLt's GELU_AUX): the block's output and mlp.proj's dW within
    ``GELU_MOVE`` of the GELU apart, dx and the other gradients within 1e-3 (other programs may
    sum in other orders)."""
    inputs = _inputs("pallas")
    gelu_in_gemm(True)
    fused = _step(*inputs)
    gelu_in_gemm(False)
    rels = _rels(inputs, fused, _step(*inputs))
    assert rels[0] <= GELU_MOVE and rels[-1] <= GELU_MOVE, rels
    assert max(rels[1:-1]) <= 1e-3, rels
