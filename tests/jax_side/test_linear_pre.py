"""An elementwise function applied inside a linear's quantize of x (``linear(name, h, pre=fn)``
in a unit program; the GPT's GELU before its MLP's second linear, issue 33): with the
``fp8_blocked`` GEMM the blocked-operand kernel applies ``fn`` to x's values as it loads them
(``quantize_blocked_2d(pre=...)``), so ``fn(h)`` is never written out, and the backward takes
the linear's dx through ``jax.vjp(fn, h)``. Elsewhere (another GEMM, a high-precision linear,
parts) ``jax.checkpoint(fn)(h)`` runs first, as before.

On the CPU (the Pallas kernels interpreted) the bytes are those of ``fn`` first: the kernels'
operands (both backends), the block's output and every gradient, kept and recomputed backwards.
On the GPU the compiled kernel's ``tanh`` is Triton's (libdevice), not XLA's, so the GELU may
differ in its last bf16 bit: there the results stay within a stated bound of ``fn`` first.
A function that is not elementwise, or changes x's shape or dtype, is refused by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.kernels import KernelConfig
from jax_side import unit_linear
from jax_side import unit_program as U
from jax_side.mxfp8 import blocked_operands, elementwise, resolve_kernels
from jax_side.mxfp8.pallas_blocked import quantize_blocked_2d
from models import gpt_math
from models.gpt_math import gelu_tanh
from tests.jax_side.test_linear_parts import _arrays, _inputs, _step, kept_and_recomputed

on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason=(
    "bytes: the compiled kernel's tanh is Triton's, not XLA's; the gpu-marked tests bound it"))

KERNEL_CALLS = [
    dict(rows=True, rows_t=False, tiles_t=False, block=(32, 128), num_warps=2),
    dict(rows=False, rows_t=False, tiles_t=True, num_warps=4),
    dict(rows=False, rows_t=True, tiles_t=False, block=(128, 64), num_warps=2),
    dict(rows=False, rows_t=True, tiles_t=False, block=(128, 64), whole=True),
    dict(rows=True, rows_t=True, tiles_t=False),
    dict(rows=True, rows_t=False, tiles_t=True, packed=True, num_warps=8),
]


def _u(shape=(256, 384), seed=0):
    x = 3.0 * jax.random.normal(jax.random.key(seed), shape)
    return x.at[5, 7].set(jnp.nan).at[9, 0].set(-jnp.inf).astype(jnp.bfloat16)


def _planes_bytes(planes):
    return [None if p is None else (np.asarray(p.data).view(np.uint8).tobytes(),
                                    np.asarray(p.scale).view(np.uint8).tobytes())
            for p in planes]


@on_cpu
@pytest.mark.parametrize("call", KERNEL_CALLS, ids=lambda c: "+".join(
    k for k in ("rows", "rows_t", "tiles_t") if c[k]) + ("-whole" if c.get("whole") else "")
    + ("-packed" if c.get("packed") else ""))
def test_the_kernel_with_pre_writes_the_bytes_of_pre_first(call):
    u = _u()
    got = quantize_blocked_2d(u, interpret=True, pre=gelu_tanh, **call)
    want = quantize_blocked_2d(gelu_tanh(u), interpret=True, **call)
    assert _planes_bytes(got) == _planes_bytes(want)


@on_cpu
def test_the_kernel_applies_pre_to_each_column_part():
    parts = (_u((128, 256), 1), _u((128, 128), 2))
    got = quantize_blocked_2d(parts, rows=True, rows_t=False, tiles_t=False, interpret=True,
                              pre=gelu_tanh, block=(32, 128))
    want = quantize_blocked_2d(tuple(gelu_tanh(p) for p in parts), rows=True, rows_t=False,
                               tiles_t=False, interpret=True, block=(32, 128))
    assert _planes_bytes(got) == _planes_bytes(want)


@on_cpu
@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("shape", [(256, 384), (200, 384)], ids=["aligned", "padded"])
def test_quantize_operands_with_pre_gives_the_operands_of_pre_first(backend, shape):
    kernels = resolve_kernels(KernelConfig(backend=backend, gemm="fp8_blocked"))
    u = _u(shape)
    got = blocked_operands.quantize_operands(u, rows=True, tiles_t=True, kernels=kernels,
                                             pre=gelu_tanh)
    want = blocked_operands.quantize_operands(gelu_tanh(u), rows=True, tiles_t=True,
                                              kernels=kernels)
    assert _planes_bytes(got) == _planes_bytes(want)


@pytest.fixture
def gelu_in_linear(monkeypatch):
    """``GELU_IN_LINEAR`` set per call (restored after the test) with the traces cleared; the
    GELU in the first GEMM's epilogue off, so that "apart" is XLA's GELU pass."""
    monkeypatch.setattr(gpt_math, "GELU_IN_GEMM", False)

    def use(on: bool) -> None:
        monkeypatch.setattr(gpt_math, "GELU_IN_LINEAR", on)
        jax.clear_caches()

    yield use
    jax.clear_caches()


def _spy(monkeypatch, name="unit_linear_pre"):
    """The linear indices that ``jax_side.unit_program``'s ``name`` ran for, as they run."""
    ran = []
    real = getattr(U, name)
    monkeypatch.setattr(U, name, lambda *a: ran.append(a[3]) or real(*a))
    return ran


@on_cpu
def test_the_gelu_inside_the_linear_gives_the_bytes_of_the_gelu_first(gelu_in_linear,
                                                                       monkeypatch):
    """The GPT block (fp8_blocked, the Pallas kernels): its output, dx and every weight's and
    norm's gradient. (On the XLA backend the linear computes the GELU before its quantize: the
    same values by construction, and bench_train_step's ':gelu-in' test trains both.)"""
    inputs = _inputs("pallas")
    ran = _spy(monkeypatch)
    gelu_in_linear(True)
    fused = _step(*inputs)
    assert ran == [3], "mlp.proj (linear 3) took the GELU as its pre"
    gelu_in_linear(False)
    apart = _step(*inputs)
    assert ran == [3]
    assert fused[0] == apart[0], "the block's output"
    assert fused[1] == apart[1], "dx and every gradient"


@dataclasses.dataclass(frozen=True)
class _GeluInputUsedTwice:
    """A block whose GELU input also reaches its output: its cotangent is a sum."""

    def __call__(self, params, linear, h):
        u = linear("mlp.fc", h)
        return linear("mlp.proj", u, pre=gelu_tanh) + u[..., :h.shape[-1]]


@dataclasses.dataclass(frozen=True)
class _GeluApart:
    def __call__(self, params, linear, h):
        u = linear("mlp.fc", h)
        return linear("mlp.proj", gpt_math._gelu(u)) + u[..., :h.shape[-1]]


@on_cpu
def test_a_gelu_input_with_another_use_has_the_bytes_of_the_gelu_apart():
    """The first linear's dy is then the sum of two cotangents: the block's output and
    gradients have the bytes of the GELU apart."""
    spec, params, rows, cols, x = _inputs("pallas")
    got = []
    for fn in (_GeluInputUsedTwice(), _GeluApart()):
        f = spec._replace(fn=fn)
        out, saved = U.unit_forward(params, rows, x, (), spec=f)
        kept = saved.forwarded.kept(params, rows, x, (), out)
        grads = U.unit_backward(saved, kept, jnp.ones_like(out), cols, spec=f).packed
        got.append((np.asarray(out).tobytes(), np.asarray(grads).tobytes()))
    assert got[0] == got[1]


def _top_level_primitives(jaxpr) -> set[str]:
    """Primitive names of a jaxpr and its nested calls, not looking into Pallas kernels."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for v in eqn.params.values():
            inner = v if hasattr(v, "eqns") else getattr(v, "jaxpr", None)
            if hasattr(inner, "eqns"):
                names |= _top_level_primitives(inner)
    return names


@pytest.mark.parametrize("on", [True, False])
def test_the_forward_computes_the_gelu_only_inside_the_kernel(on, gelu_in_linear):
    """On the pallas backend the forward program has no tanh outside a Pallas kernel (the GELU
    is never written out); with the GELU apart it has one."""
    spec, params, rows, cols, x = _inputs("pallas")
    gelu_in_linear(on)
    fwd = jax.make_jaxpr(lambda *a: U.unit_forward(*a, spec=spec))(params, rows, x, ())
    assert ("tanh" in _top_level_primitives(fwd.jaxpr)) is (not on)


@on_cpu
def test_the_recompute_backward_with_pre_has_the_kept_backwards_bytes(gelu_in_linear):
    """Activation recompute with the GELU inside the kernel: the kept backward's bytes, and the
    forward alone the output's."""
    gelu_in_linear(True)
    packed, redo, out, alone = kept_and_recomputed(*_inputs("pallas"))
    assert packed == redo and out == alone


@pytest.mark.parametrize("case", ["exact GEMM", "parts", "high-precision linear"])
def test_where_pre_cannot_be_fused_it_runs_first_with_the_same_bytes(case, monkeypatch):
    """Another GEMM, a linear asked for parts, or a high-precision linear: ``jax.checkpoint(
    pre)`` first, then the linear -- the bytes of a unit function that does so itself."""
    spec, params, rows, cols, x = _inputs("xla")
    if case == "exact GEMM":
        spec = spec._replace(kernels=resolve_kernels(KernelConfig(backend="xla")))
    if case == "high-precision linear":
        weight = 0.05 * jax.random.normal(jax.random.key(9), (128, 128))
        spec = spec._replace(params=(*spec.params, "attn.proj.weight"),
                             mxfp8=("attn.qkv", "mlp.fc", "mlp.proj"),
                             hp_linears=("attn.proj",), dw_dtypes=("float32",) * 3)
        params, rows, cols = (*params, weight), rows[::2] + rows[3:], cols[::2] + cols[3:]
    name, parts = ("attn.qkv", 2) if case == "parts" else ("attn.proj", 1)
    ran = _spy(monkeypatch)

    @dataclasses.dataclass(frozen=True)
    class Block:
        inside: bool

        def __call__(self, params, linear, h):
            pre = (lambda v: gelu_tanh(v))  # noqa: E731 -- not hashable-equal across calls
            if self.inside:
                out = linear(name, h, parts=parts, pre=gelu_tanh)
            else:
                out = linear(name, jax.checkpoint(pre)(h), parts=parts)
            return out[0] if parts > 1 else out

    outs = []
    for inside in (True, False):
        f = spec._replace(fn=Block(inside))
        out, saved = U.unit_forward(params, rows, x, (), spec=f)
        kept = saved.forwarded.kept(params, rows, x, (), out)
        dx = U.unit_backward(saved, kept, jnp.ones_like(out), cols, spec=f).packed
        outs.append((np.asarray(out).tobytes(), np.asarray(dx).tobytes()))
    assert ran == [] and outs[0] == outs[1]


@pytest.mark.parametrize(("pre", "match"), [
    (jax.nn.softmax, "is not known to be elementwise"),
    (lambda v: v.astype(jnp.float32), "must return one array of its input's shape and dtype"),
    (lambda v: v.T, "must return one array"),
    (lambda v: v - jnp.mean(v), r"reduce_sum"),
    ("gelu", "must be a function"),
])
def test_a_pre_that_is_not_elementwise_is_refused_by_name(pre, match):
    spec, params, rows, cols, x = _inputs("pallas")

    @dataclasses.dataclass(frozen=True)
    class AsksPre:
        def __call__(self, params, linear, h):
            return linear("attn.proj", h, pre=pre)

    with pytest.raises((ValueError, TypeError), match=match) as err:
        U.unit_apply(params, rows, x, (), spec=spec._replace(fn=AsksPre()))
    assert "linear 'attn.proj'" in str(err.value)
    with pytest.raises((ValueError, TypeError), match=match):
        quantize_blocked_2d(_u(), rows=True, rows_t=False, tiles_t=False, interpret=True,
                            pre=pre)


def test_the_elementwise_check_looks_into_nested_calls():
    elementwise.check(jax.nn.relu, jnp.float32, "t")  # a custom_jvp of max
    elementwise.check(jax.jit(gelu_tanh), jnp.bfloat16, "t")
    elementwise.check(lambda v: jnp.where(v > 0, v, 0.1 * v), jnp.bfloat16, "t")
    with pytest.raises(ValueError, match="cumsum"):
        elementwise.check(jax.jit(lambda v: jnp.cumsum(v, axis=1)), jnp.float32, "t")
    ramp = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
    with pytest.raises(ValueError, match=r"a captured array of shape \(32, 128\)"):
        elementwise.check(lambda v: v * ramp, jnp.float32, "t")  # per position


def test_fuses_says_when_the_linear_takes_pre():
    kernels = resolve_kernels(KernelConfig(gemm="fp8_blocked"))
    spec, params, rows, cols, x = _inputs("xla")
    assert unit_linear.fuses(rows[3], kernels)
    assert not unit_linear.fuses(rows[3], resolve_kernels(KernelConfig()))
    assert not unit_linear.fuses(jnp.ones((128, 512)), kernels)


def _rel(got, want):
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _values(p, tiles):
    """An operand's fp32 values: codes times their block's power of two."""
    codes = np.asarray(p.data.astype(jnp.float32), np.float64)
    scale = np.exp2(np.asarray(p.scale, np.float64) - 127.0)
    scale = np.repeat(scale, 128, axis=1)
    return codes * (np.repeat(scale, 128, axis=0) if tiles else scale)


def _assert_near(got, want, what):
    """Operands within a bf16 rounding of a GELU (or its gradient) computed elsewhere: at most
    1 % of codes differ and the dequantized values are within 1e-3 (relative Frobenius; NaN
    codes in the same places)."""
    for name, g, w in zip(got._fields, got, want, strict=True):
        assert (g is None) == (w is None), (what, name)
        if g is None:
            continue
        gd, wd = (np.asarray(p.data).view(np.uint8) for p in (g, w))
        assert np.mean(gd != wd) <= 0.01, (what, name)
        gv, wv = _values(g, name == "tiles_t"), _values(w, name == "tiles_t")
        assert np.array_equal(np.isnan(gv), np.isnan(wv)), (what, name)
        finite = np.isfinite(gv) & np.isfinite(wv)
        assert _rel(gv[finite], wv[finite]) <= 1e-3, (what, name)


def _assert_block_near(inputs, got, want):
    """The block's output and every gradient within 1e-3 (relative Frobenius) -- the bound of
    the qkv parts' test (tests/jax_side/test_linear_parts.py)."""
    spec, params, rows, cols, x = inputs
    g = [np.frombuffer(got[0], jnp.bfloat16).astype(np.float64), *_arrays(spec, params, x, got[1])]
    w = [np.frombuffer(want[0], jnp.bfloat16).astype(np.float64),
         *_arrays(spec, params, x, want[1])]
    for i, (a, b) in enumerate(zip(g, w, strict=True)):
        assert _rel(a, b) <= 1e-3, f"result {i}"


@pytest.mark.gpu
def test_on_the_gpu_the_kernels_gelu_stays_within_a_bf16_rounding_of_xlas():
    """Compiled: Triton's tanh (libdevice) against XLA's may move the GELU's bf16 result by one
    bit; the operands stay within ``_assert_near``'s bound of those of XLA's GELU first."""
    u = (3.0 * jax.random.normal(jax.random.key(4), (1024, 2048))).astype(jnp.bfloat16)
    for call in KERNEL_CALLS:
        _assert_near(quantize_blocked_2d(u, pre=gelu_tanh, **call),
                     quantize_blocked_2d(gelu_tanh(u), **call), call)


@pytest.mark.gpu
def test_on_the_gpu_the_gelu_inside_the_linear_stays_within_the_gemms_bound(gelu_in_linear):
    """Compiled: the block's output and every gradient within 1e-3 (relative Frobenius) of the
    GELU first -- the bound of the qkv parts' test (tests/jax_side/test_linear_parts.py)."""
    inputs = _inputs("pallas")
    gelu_in_linear(True)
    fused = _step(*inputs)
    gelu_in_linear(False)
    _assert_block_near(inputs, fused, _step(*inputs))
