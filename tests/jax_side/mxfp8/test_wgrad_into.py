"""Weight gradients written by their wgrad GEMM straight into the gradient group's buffer (the
FSDP grad bucket), issue 33: ``gemm_impls.blocked_product_into``, ``cublaslt.blocked_gemm_into``,
``blocked_operands.WgradOperands.into`` and the unit program's writers (``unit_grads.flat_group``,
``unit_program._deferrable``).

Every path gives the bytes of the plain one it replaces: the product, then an in-place
``dynamic_update_slice`` into the zero buffer. On the CPU the product is the exact dot of the
re-blocked values; on the GPU cuBLASLt writes it at its offset (the ``gpu`` tests compare it with
``blocked_gemm`` + the update, byte for byte, and count the in-place calls in the compiled unit
program).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from common.formats import Plane
from common.kernels import KernelConfig
from common.model_config import SMALL
from common.modes import Activations
from jax_side import mxfp8
from jax_side import unit_program as U
from jax_side.linear import quantize_weight
from jax_side.mxfp8 import blocked_operands, cublaslt, gemm_impls, resolve_kernels
from jax_side.mxfp8.reblock import reblock_rows, reblock_tiles
from models.gpt_math import GPTBlockFn

NORMS = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias")
# SMALL's linears: every dim a multiple of 128, so on the GPU each wgrad is written in place
LINEARS = {"attn.qkv": (3 * SMALL.d_model, SMALL.d_model), "attn.proj": (SMALL.d_model,) * 2,
           "mlp.fc": (SMALL.d_ff, SMALL.d_model), "mlp.proj": (SMALL.d_model, SMALL.d_ff)}


def _pair(m, n, k, seed):
    rng = np.random.default_rng(seed)

    def rows(shape):
        t = mxfp8.quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32))
        d, s = t.plane("rowwise")
        return d, lax.bitcast_convert_type(s, jnp.uint8)

    return reblock_rows(*rows((m, k))), reblock_tiles(*rows((n, k)))


def _updated(buf, start, ra, rb, m, n):
    out = gemm_impls.blocked_product(ra, rb, m, n, buf.dtype)
    return lax.dynamic_update_slice(buf, out.reshape(-1), (start,))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", ["whole", "cut", "unaligned"])
def test_blocked_product_into_is_the_update_of_the_product(dtype, case):
    ra, rb = _pair(256, 384, 256, 1)
    m, n = (200, 300) if case == "cut" else (256, 384)
    start = 67 if case == "unaligned" else 128  # 128 elements: 256-byte aligned in both dtypes
    buf = jnp.full((start + m * n + 77,), 7, dtype)  # what is not written stays as it was
    got = jax.jit(lambda b: gemm_impls.blocked_product_into(b, start, ra, rb, m, n))(buf)
    want = _updated(buf, start, ra, rb, m, n)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_wgrad_operands_refuse_a_buffer_of_another_dtype():
    ra, rb = _pair(128, 128, 128, 2)
    ops = blocked_operands.WgradOperands(ra, rb, 128, 128, jnp.dtype(jnp.float32), False)
    with pytest.raises(ValueError, match="buf is bfloat16, dW is float32"):
        ops.into(jnp.zeros((128 * 128,), jnp.bfloat16), 0)


# ----------------------------------------------------------------------- the unit program


def _shapes(spec):
    """The linears' weight shapes of ``spec`` (one block, or a span of blocks)."""
    return [LINEARS[name.split(".", 1)[1] if name[0].isdigit() else name] for name in spec.mxfp8]


def _grouped_spec(spec):
    """All dW of the block(s) and the LayerNorm parameters in one fp32 group, each start
    256-element aligned (as FSDP's FlatLayout places them)."""
    slots, cursor = [], 0
    n = len(spec.params)
    for i in range(n):
        slots.append((i, cursor))
        cursor += 256
    for j, shape in enumerate(_shapes(spec)):
        slots.append((n + j, cursor))
        cursor += -(-int(np.prod(shape)) // 256) * 256
    return spec._replace(grad_groups=(U.GradGroup(cursor, "float32", tuple(slots)),))


@dataclasses.dataclass(frozen=True)
class _Undeclared:
    """The block without ``linears_at_top``: its dW leave through autodiff."""

    fn: object

    def __call__(self, params, linear, x):
        return self.fn(params, linear, x)


@dataclasses.dataclass(frozen=True)
class _TwiceProj:
    """The block, then attn.proj applied once more (a linear called twice: autodiff sums its
    two dW, so it takes no writer)."""

    fn: object
    linears_at_top = True

    def __call__(self, params, linear, x):
        h = self.fn(params, linear, x)
        return h + linear("attn.proj", h)


def _grads(spec, params, rows, cols, x):
    out, saved = U.unit_forward(params, rows, x, (), spec=spec)
    kept = saved.forwarded.kept(params, rows, x, (), out)
    dout = (0.5 * jax.random.normal(jax.random.key(5), x.shape)).astype(x.dtype)
    if isinstance(spec.fn, U.SpanFn):  # a cotangent for the last block's output only
        dout = (None,) * (len(spec.fn.fns) - 1) + (dout,)
    return U.unit_backward(saved, kept, dout, cols, spec=spec)


def _placed_reference(spec, grads, x, params):
    """The group's bytes from the ungrouped run: each gradient at its start, zeros elsewhere."""
    (group,) = _grouped_spec(spec).grad_groups
    layout = U.grad_layout([(x.shape, x.dtype)], [p.shape for p in params],
                           ["float32"] * len(params), _shapes(spec), spec.dw_dtypes)
    raw = np.asarray(grads.packed)
    want = np.zeros(group.numel, np.float32)
    for i, start in group.slots:
        offset, shape, _ = (*layout.params, *layout.mxfp8)[i]
        n = int(np.prod(shape))
        want[start:start + n] = raw[offset:offset + 4 * n].view(np.float32)
    return want


def _fp8_blocked_inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    params = tuple(1.0 + 0.1 * jax.random.normal(keys[4], (SMALL.d_model,)) if n.endswith("weight")
                   else jnp.zeros(SMALL.d_model) for n in NORMS)
    weights = [0.05 * jax.random.normal(k, s) for k, s in zip(keys[:4], LINEARS.values(),
                                                               strict=True)]
    x = jax.random.normal(keys[5], (2, 64, SMALL.d_model)).astype(jnp.bfloat16)
    spec = U.UnitSpec(GPTBlockFn(SMALL, Activations.BF16), NORMS, tuple(LINEARS), (),
                      ("float32",) * 4, resolve_kernels(KernelConfig(gemm="fp8_blocked")))
    planes = [quantize_weight(w) for w in weights]
    rows = tuple(p.only(Plane.ROWWISE) for p in planes)
    cols = tuple(p.only(Plane.COLWISE) for p in planes)
    return spec, params, rows, cols, x


@pytest.mark.parametrize("fn", ["declared", "undeclared", "twice"])
def test_unit_backward_writes_wgrads_into_the_group_with_the_plain_bytes(fn, monkeypatch):
    spec, params, rows, cols, x = _fp8_blocked_inputs()
    spec = spec._replace(fn={"declared": spec.fn, "undeclared": _Undeclared(spec.fn),
                             "twice": _TwiceProj(spec.fn)}[fn])
    written = []
    real = blocked_operands.blocked_product_into
    monkeypatch.setattr(blocked_operands, "blocked_product_into",
                        lambda buf, start, *a, **k: written.append(start) or real(buf, start,
                                                                                   *a, **k))
    plain = _grads(spec, params, rows, cols, x)
    assert written == [], "an ungrouped backward writes no group"
    grouped = _grads(_grouped_spec(spec), params, rows, cols, x)
    (flat,) = grouped.groups
    (group,) = _grouped_spec(spec).grad_groups
    starts = {i: s for i, s in group.slots}
    want = {"declared": [starts[4 + j] for j in (3, 2, 1, 0)],  # in the backward's order
            "undeclared": [],
            "twice": [starts[4 + j] for j in (3, 2, 0)]}[fn]  # attn.proj (1) called twice
    assert written == want
    assert np.asarray(flat).tobytes() == _placed_reference(spec, plain, x, params).tobytes()


def test_a_span_of_blocks_writes_each_wgrad_into_the_group_with_the_plain_bytes(monkeypatch):
    """An FSDP unit of two blocks (``SpanFn``, one program): all eight wgrads are written by
    their GEMMs, each at its own start, with the bytes of the ungrouped run."""
    spec, params, rows, cols, x = _fp8_blocked_inputs()
    span = spec._replace(fn=U.SpanFn((spec.fn, spec.fn)),
                         params=tuple(f"{b}.{n}" for b in range(2) for n in spec.params),
                         mxfp8=tuple(f"{b}.{n}" for b in range(2) for n in spec.mxfp8),
                         dw_dtypes=spec.dw_dtypes * 2)
    params2, rows2, cols2 = params * 2, rows * 2, cols * 2
    written = []
    real = blocked_operands.blocked_product_into
    monkeypatch.setattr(blocked_operands, "blocked_product_into",
                        lambda buf, start, *a, **k: written.append(start) or real(buf, start,
                                                                                   *a, **k))
    plain = _grads(span, params2, rows2, cols2, x)
    (flat,) = _grads(_grouped_spec(span), params2, rows2, cols2, x).groups
    starts = dict(_grouped_spec(span).grad_groups[0].slots)
    assert sorted(written) == sorted(starts[8 + j] for j in range(8))
    assert np.asarray(flat).tobytes() == _placed_reference(span, plain, x, params2).tobytes()


def test_writers_that_update_leave_the_group_a_fill_not_a_pad():
    """Where the writers take the product-and-update path (the CPU here), the group's zero
    buffer keeps its barrier: a fill and in-place updates, not one pad of the whole buffer."""
    spec, params, rows, cols, x = _fp8_blocked_inputs()
    grouped = _grouped_spec(spec)
    ra, rb = _pair(128, 128, 128, 2)
    ops = blocked_operands.WgradOperands(ra, rb, 128, 128, jnp.dtype(jnp.float32), False)
    assert ops.direct(jnp.dtype(jnp.float32), 0) == (jax.devices()[0].platform == "gpu")
    _, saved = U.unit_forward(params, rows, x, (), spec=grouped)
    kept = saved.forwarded.kept(params, rows, x, ())
    hlo = U.unit_backward.lower(saved, kept, jnp.ones_like(x), cols,
                                spec=grouped).compile().as_text()
    numel = grouped.grad_groups[0].numel
    if jax.devices()[0].platform != "gpu":
        assert f"f32[{numel}]{{0}} pad(" not in hlo and f"f32[{numel}]{{0}} broadcast(" in hlo


def test_a_group_of_another_dtype_takes_the_update():
    spec, params, rows, cols, x = _fp8_blocked_inputs()
    (group,) = _grouped_spec(spec).grad_groups
    bf16 = spec._replace(grad_groups=(group._replace(dtype="bfloat16"),))
    assert U._deferrable(bf16) == frozenset()
    assert U._deferrable(_grouped_spec(spec)) == frozenset(range(4))
    exact = _grouped_spec(spec)._replace(kernels=resolve_kernels(KernelConfig(gemm="dequant_dot")))
    assert U._deferrable(exact) == frozenset()


@dataclasses.dataclass(frozen=True)
class _CheckpointedButDeclared:
    """Breaks ``linears_at_top``: the block runs under ``jax.checkpoint``, so its rules run in an
    inner trace that has ended when the group would take their operands."""

    fn: object
    linears_at_top = True

    def __call__(self, params, linear, x):
        return jax.checkpoint(lambda p, h: self.fn(p, linear, h))(params, x)


def test_a_declared_function_that_breaks_the_promise_fails_loudly():
    """docs/extending.md: a function declaring ``linears_at_top`` that calls its linears under a
    transformation of its own is refused by JAX (a leaked tracer), never run with wrong bytes."""
    spec, params, rows, cols, x = _fp8_blocked_inputs()
    undeclared = _grouped_spec(spec._replace(fn=_Undeclared(_CheckpointedButDeclared(spec.fn))))
    (fine,) = _grads(undeclared, params, rows, cols, x).groups  # undeclared: autodiff, fine
    assert np.isfinite(np.asarray(fine)).all()
    broken = _grouped_spec(spec._replace(fn=_CheckpointedButDeclared(spec.fn)))
    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.block_until_ready(_grads(broken, params, rows, cols, x).groups)


# ------------------------------------------------------------------------------ on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cublaslt_writes_into_the_buffer_the_bytes_of_gemm_then_update(dtype):
    assert cublaslt.status().ok, cublaslt.status().reason
    ra, rb = _pair(512, 768, 1024, 3)
    start = 1024
    buf = jnp.full((start + 512 * 768 + 300,), 3, dtype)
    got = jax.jit(lambda b: cublaslt.blocked_gemm_into(b, start, ra, rb))(buf)
    out = cublaslt.blocked_gemm(ra, rb, out_dtype=dtype)
    want = lax.dynamic_update_slice(buf, out.reshape(-1), (start,))
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    for bad in (start + 3, buf.shape[0] - 100):  # unaligned; overflowing
        with pytest.raises(ValueError, match="do not fit|aligned"):
            cublaslt.blocked_gemm_into(buf, bad, ra, rb)


@pytest.mark.gpu
@pytest.mark.parametrize("start", [16, 4, 2, 67], ids=["64B", "16B", "8B", "4B"])
def test_the_handler_writes_at_an_output_aligned_less_than_256_bytes(start):
    """An output XLA places less than 256-byte aligned (its own in-place dynamic-update-slice
    of the GEMM's result at an odd offset): the handler writes an aligned scratch buffer with
    the same algorithm and copies it into place; the bytes are the same every time."""
    assert cublaslt.status().ok, cublaslt.status().reason
    ra, rb = _pair(256, 384, 512, 4)
    sa, sb = cublaslt._scales(ra, rb, cublaslt.status().layout)
    buf = jnp.full((start + 256 * 384 + 64,), 5, jnp.float32)
    got = jax.jit(lambda b: cublaslt.raw_call_into(b, start, ra.data, rb.data, sa, sb))(buf)
    want = lax.dynamic_update_slice(buf, cublaslt.blocked_gemm(ra, rb).reshape(-1), (start,))
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.gpu
def test_an_unaligned_output_in_a_command_buffer_is_written_or_refused_never_wrong(monkeypatch):
    """With ``cublaslt.COMMAND_BUFFERS`` on, an unaligned output inside a program with XLA's
    kernels around the call (a command buffer can form): where XLA records the call into a CUDA
    graph the twin refuses by name (its scratch allocation cannot be recorded), elsewhere it
    writes the scratch path's bytes -- never other bytes."""
    assert cublaslt.status().ok, cublaslt.status().reason
    ra, rb = _pair(256, 384, 512, 4)
    sa, sb = cublaslt._scales(ra, rb, cublaslt.status().layout)
    start = 4
    buf = jnp.full((start + 256 * 384 + 64,), 5, jnp.float32)

    def program(b):
        b = jnp.tanh(b * 0.5) + jnp.cos(b) * 2.0 - 1.0  # XLA's kernels before and after
        b = cublaslt.raw_call_into(b, start, ra.data, rb.data, sa, sb)
        return jnp.exp(b * 1e-3) * 3.0 - b

    runs = {}
    for graphs in (False, True):  # the plain handler's scratch path, then the twin
        monkeypatch.setattr(cublaslt, "COMMAND_BUFFERS", graphs)
        jax.clear_caches()  # the knob is read when a program is traced
        try:
            runs[graphs] = np.asarray(jax.jit(program)(buf)).tobytes()
        except Exception as e:  # noqa: BLE001 -- XLA wraps the handler's error
            assert graphs, str(e)
            assert "command buffer" in str(e) and "COMMAND_BUFFERS = False" in str(e), str(e)
    print("the twin", "wrote the bytes" if True in runs else "refused inside a graph")
    if True in runs:
        assert runs[True] == runs[False]
    jax.clear_caches()


@pytest.mark.gpu
def test_the_unit_program_writes_each_wgrad_in_place_on_the_gpu():
    spec, params, rows, cols, x = _fp8_blocked_inputs()
    plain = _grads(spec, params, rows, cols, x)
    grouped_spec = _grouped_spec(spec)
    (flat,) = _grads(grouped_spec, params, rows, cols, x).groups
    assert np.asarray(flat).tobytes() == _placed_reference(spec, plain, x, params).tobytes()
    _, saved = U.unit_forward(params, rows, x, (), spec=grouped_spec)
    kept = saved.forwarded.kept(params, rows, x, ())
    hlo = U.unit_backward.lower(saved, kept, jnp.ones_like(x), cols,
                                spec=grouped_spec).compile().as_text()
    assert hlo.count(f'custom_call_target="{cublaslt.TARGET_INTO}"') == 4
    # the bucket is not filled first: only the gaps between the slots are zeroed
    numel = grouped_spec.grad_groups[0].numel
    assert hlo.count(f'custom_call_target="{cublaslt.TARGET_GAPS}"') == 1
    assert f"f32[{numel}]{{0}} broadcast(" not in hlo and f"f32[{numel}]{{0}} pad(" not in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_zeroed_gaps_zeroes_the_gaps_of_dirty_memory(dtype):
    """``cublaslt.zeroed_gaps`` on memory that held NaN (a freed buffer of the same size, which
    the allocator hands out again): the gaps come back zero; every other element is left as it
    was (the caller writes it)."""
    assert cublaslt.status().ok, cublaslt.status().reason
    numel, holes = 1 << 20, ((0, 5), (1000, 24), (4096, 1), ((1 << 20) - 7, 7))
    make = jax.jit(lambda: cublaslt.zeroed_gaps(numel, dtype, holes))
    jax.block_until_ready(make())  # compiled before the dirty buffer is freed
    dirty = jnp.full((numel,), jnp.nan, dtype).block_until_ready()
    del dirty
    got = np.asarray(make())
    for start, length in holes:
        assert not got[start:start + length].any(), (start, length)
    rest = np.ones(numel, bool)
    for start, length in holes:
        rest[start:start + length] = False
    if not np.isnan(got[rest]).all():
        pytest.skip("the allocator did not hand the freed NaN buffer out again; the gaps' zeros "
                    "prove nothing on memory that was zero already")
    with pytest.raises(ValueError, match="lies outside"):
        cublaslt.zeroed_gaps(10, dtype, ((8, 3),))
