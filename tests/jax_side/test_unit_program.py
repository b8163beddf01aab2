"""``jax_side.unit_program`` on its own (no Torch): residuals that are inputs are not returned,
the packed gradient layout, the kept-residual backward equals the recompute backward, and the
weight gradients leave through autodiff, so a unit function under ``jax.checkpoint`` gives the
same bytes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from common.formats import Plane
from common.model_config import TINY
from common.modes import Activations
from jax_side import unit_grads
from jax_side import unit_program as U
from jax_side.linear import quantize_weight
from jax_side.mxfp8 import resolve_kernels
from models.gpt_math import GPTBlockFn

NORMS = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias")
LINEARS = {"attn.qkv": (3 * TINY.d_model, TINY.d_model), "attn.proj": (TINY.d_model,) * 2,
           "mlp.fc": (TINY.d_ff, TINY.d_model), "mlp.proj": (TINY.d_model, TINY.d_ff)}


def _inputs():
    keys = jax.random.split(jax.random.key(0), 8)
    params = tuple(jnp.ones(TINY.d_model) if n.endswith("weight") else jnp.zeros(TINY.d_model)
                   for n in NORMS)
    weights = [0.05 * jax.random.normal(k, s)
               for k, s in zip(keys[:4], LINEARS.values(), strict=True)]
    x = jax.random.normal(keys[-1], (2, 32, TINY.d_model)).astype(jnp.bfloat16)
    spec = U.UnitSpec(GPTBlockFn(TINY, Activations.BF16), NORMS, tuple(LINEARS), (),
                      ("float32",) * 4, resolve_kernels(None, "cpu"))
    return spec, params, weights, x


def test_the_block_input_is_kept_by_the_caller_not_returned_by_the_program():
    spec, params, weights, x = _inputs()
    planes = [quantize_weight(w) for w in weights]
    rows = tuple(p.only(Plane.ROWWISE) for p in planes)
    _, saved = U.unit_forward(params, rows, x, (), spec=spec)
    flat_inputs = jax.tree.leaves((params, rows, x, ()))
    x_index = next(i for i, a in enumerate(flat_inputs) if a is x)
    assert any(i == x_index for _, i in saved.forwarded.positions), saved.forwarded
    leaves = jax.tree.leaves(saved.vjp)
    assert all(leaves[k].shape == () for k, _ in saved.forwarded.positions)
    assert any(a is x for a in saved.forwarded.kept(params, rows, x, ()))
    # the parameters can be left out at forward and given again at backward (FSDP's pool)
    held = saved.forwarded.kept_without_params(params, rows, x, ())
    n = len(jax.tree.leaves(params))
    assert [k is None for k in held] == [i < n for _, i in saved.forwarded.positions]
    assert any(k is None for k in held), "the LayerNorm weights are residuals of the block"
    again = tuple(jnp.array(p) for p in params)  # the same values in other buffers
    filled = saved.forwarded.with_params(held, again)
    want = saved.forwarded.kept(again, rows, x, ())
    assert all(a is b for a, b in zip(filled, want, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("given", ["planes", "weights"])
def test_the_kept_backward_equals_the_recompute_backward(given):
    spec, params, weights, x = _inputs()
    planes = [quantize_weight(w) for w in weights]
    if given == "planes":  # FSDP's case: rowwise in forward, colwise in backward
        rows = tuple(p.only(Plane.ROWWISE) for p in planes)
        cols = tuple(p.only(Plane.COLWISE) for p in planes)
    else:  # quantized inside the forward program
        rows, cols = tuple(weights), (None,) * 4
    dout = jnp.ones_like(x)
    out, saved = U.unit_forward(params, rows, x, (), spec=spec)
    kept = saved.forwarded.kept(params, rows, x, ())
    packed = U.unit_backward(saved, kept, dout, cols, spec=spec).packed
    redo = U.unit_recompute_backward(params, rows, x, (), dout, cols, spec=spec).packed
    assert np.array_equal(np.asarray(packed), np.asarray(redo))
    layout = U.grad_layout([(x.shape, x.dtype)], [p.shape for p in params], ["float32"] * 4,
                           list(LINEARS.values()), spec.dw_dtypes)
    assert packed.shape == (layout.nbytes,)
    assert np.array_equal(np.asarray(out), np.asarray(U.unit_apply(params, rows, x, (), spec=spec)))


@dataclasses.dataclass(frozen=True)
class _Checkpointed:
    """A unit function whose body runs under ``jax.checkpoint``: its backward recomputes the
    forward, and the linears' backward rules run while that recompute is traced (an inner
    trace), not in ``unit_backward``'s own."""

    fn: object

    def __call__(self, params, linear, x):
        return jax.checkpoint(lambda p, h: self.fn(p, linear, h))(params, x)


def test_weight_gradients_leave_through_autodiff_also_under_jax_checkpoint():
    # dW is the cotangent of each linear's gradient carrier (unit_program's docstring): under
    # remat the rules run in an inner trace, and the gradients still come out, the same bytes
    spec, params, weights, x = _inputs()
    planes = [quantize_weight(w) for w in weights]
    rows = tuple(p.only(Plane.ROWWISE) for p in planes)
    cols = tuple(p.only(Plane.COLWISE) for p in planes)
    dout = (0.5 * jax.random.normal(jax.random.key(3), x.shape)).astype(x.dtype)
    packed = []
    for s in (spec, spec._replace(fn=_Checkpointed(spec.fn))):
        out, saved = U.unit_forward(params, rows, x, (), spec=s)
        kept = saved.forwarded.kept(params, rows, x, ())
        packed.append((np.asarray(out), np.asarray(U.unit_backward(saved, kept, dout, cols,
                                                                   spec=s).packed)))
    (plain_out, plain), (remat_out, remat) = packed
    assert plain_out.tobytes() == remat_out.tobytes()
    assert plain.tobytes() == remat.tobytes()
    layout = U.grad_layout([(x.shape, x.dtype)], [p.shape for p in params], ["float32"] * 4,
                           list(LINEARS.values()), spec.dw_dtypes)
    dw = [_cut(remat, seg) for seg in layout.mxfp8]
    assert all(d.any() for d in dw), "every linear's dW arrived (none is the zeros stand-in)"


def test_grad_groups_lay_gradients_out_as_the_callers_flat_buffer():
    """``UnitSpec.grad_groups``: the grouped gradients come as one flat buffer per group (cast
    to its dtype, at their starts, zeros between and after), the others as before."""
    spec, params, weights, x = _inputs()
    planes = [quantize_weight(w) for w in weights]
    rows = tuple(p.only(Plane.ROWWISE) for p in planes)
    cols = tuple(p.only(Plane.COLWISE) for p in planes)
    dout = jnp.ones_like(x)
    d = TINY.d_model
    # parameters 1 and 0 (LayerNorm 1's bias and weight) and MXFP8 weight 1 (attn.proj) in a
    # bf16 buffer, out of order and with gaps; the rest stay alone
    group = U.GradGroup(2 * d + d * d + 64, "bfloat16", ((1, 0), (0, d + 32), (4 + 1, 2 * d + 64)))
    grouped = spec._replace(grad_groups=(group,))

    def run(s):
        _, saved = U.unit_forward(params, rows, x, (), spec=s)
        kept = saved.forwarded.kept(params, rows, x, ())
        return U.unit_backward(saved, kept, dout, cols, spec=s)

    plain_grads, grouped_grads = run(spec), run(grouped)
    assert plain_grads.groups == ()
    plain, packed = np.asarray(plain_grads.packed), np.asarray(grouped_grads.packed)
    (flat,) = grouped_grads.groups
    shapes = ([p.shape for p in params], ["float32"] * 4, list(LINEARS.values()), spec.dw_dtypes)
    lp = U.grad_layout([(x.shape, x.dtype)], *shapes)
    lg = U.grad_layout([(x.shape, x.dtype)], *shapes, groups=(group,))

    def cut(raw, seg):
        start, shape, dtype = seg
        n = int(np.prod(shape)) * np.dtype(jnp.dtype(dtype)).itemsize
        return raw[start:start + n].view(jnp.dtype(dtype)).reshape(shape)

    grads = [cut(plain, s) for s in (*lp.params, *lp.mxfp8)]
    want = np.zeros(group.numel, jnp.bfloat16)
    for i, start in group.slots:
        g = grads[i].reshape(-1).astype(jnp.bfloat16)
        want[start:start + g.size] = g
    assert lg.params[0] is None and lg.params[1] is None and lg.mxfp8[1] is None
    assert flat.shape == (group.numel,) and flat.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(flat).view(np.uint16), want.view(np.uint16))
    assert packed.shape == (lg.nbytes,) and lg.nbytes < lp.nbytes  # the group is not packed
    for a, b in ((lp.dxs[0], lg.dxs[0]), (lp.params[2], lg.params[2]), (lp.mxfp8[0], lg.mxfp8[0])):
        assert np.array_equal(cut(plain, a), cut(packed, b))


def _span_inputs():
    """Two GPT blocks (bf16) as one ``SpanFn`` and each as its own unit; each block's weights
    as (rowwise, colwise) planes."""
    spec, params, weights, x = _inputs()
    keys = jax.random.split(jax.random.key(1), 4)
    second = [0.05 * jax.random.normal(k, s)
              for k, s in zip(keys, LINEARS.values(), strict=True)]
    planes = [[quantize_weight(w) for w in ws] for ws in (weights, second)]
    rows = [tuple(p.only(Plane.ROWWISE) for p in ps) for ps in planes]
    cols = [tuple(p.only(Plane.COLWISE) for p in ps) for ps in planes]
    span = U.UnitSpec(U.SpanFn((spec.fn, spec.fn)),
                      tuple(f"{i}.{n}" for i in range(2) for n in NORMS),
                      tuple(f"{i}.{n}" for i in range(2) for n in LINEARS), (),
                      spec.dw_dtypes * 2, spec.kernels)
    return spec, span, params, rows, cols, x


def _program(fn, *args, spec):
    """``fn``'s program compiled as XLA compiles by default (``--xla_allow_excess_precision``:
    bf16 intermediates may stay fp32 inside a fusion; the tests' flag turns it off), then run."""
    compiled = fn.lower(*args, spec=spec).compile({"xla_allow_excess_precision": True})
    return compiled(*args)


def _cut(raw, seg):
    start, shape, dtype = seg
    n = int(np.prod(shape)) * np.dtype(jnp.dtype(dtype)).itemsize
    return np.asarray(raw)[start:start + n]


@pytest.mark.parametrize("own_cotangent", [True, False], ids=["read", "unread"])
def test_a_span_returns_each_blocks_output_with_the_bits_of_one_program_per_block(own_cotangent):
    """A ``SpanFn`` of two blocks against each block as its own program, both compiled with
    XLA's default excess precision: the same outputs (h_1, h_2) and gradients, whether block 1's
    output gets a cotangent of its own (a model reading it) or only block 2's dx (a block loop:
    None, another program variant). h_1, an input of block 2's backward, is returned once."""
    spec, span, params, rows, cols, x = _span_inputs()
    d2 = jnp.ones_like(x)
    d1 = (0.25 * jax.random.normal(jax.random.key(2), x.shape)).astype(x.dtype)
    h1, s1 = _program(U.unit_forward, params, rows[0], x, (), spec=spec)
    h2, s2 = _program(U.unit_forward, params, rows[1], h1, (), spec=spec)
    g2 = _program(U.unit_backward, s2, s2.forwarded.kept(params, rows[1], h1, ()), d2, cols[1],
                 spec=spec).packed
    one = U.grad_layout([(x.shape, x.dtype)], [p.shape for p in params], ["float32"] * 4,
                        list(LINEARS.values()), spec.dw_dtypes)
    dh1 = jnp.asarray(_cut(g2, one.dxs[0]).view(x.dtype).reshape(x.shape))
    g1 = _program(U.unit_backward, s1, s1.forwarded.kept(params, rows[0], x, ()),
                 dh1 + d1 if own_cotangent else dh1, cols[0], spec=spec).packed

    both, rows2, cols2 = params * 2, rows[0] + rows[1], cols[0] + cols[1]
    outs, saved = _program(U.unit_forward, both, rows2, x, (), spec=span)
    n_inputs = len(jax.tree.leaves((both, rows2, x, ())))
    assert any(i >= n_inputs for _, i in saved.forwarded.positions), "h_1 is kept, not copied"
    kept = saved.forwarded.kept(both, rows2, x, (), outs)
    g = _program(U.unit_backward, saved, kept, (d1 if own_cotangent else None, d2), cols2,
                spec=span).packed
    assert [np.asarray(o).tobytes() for o in outs] == [np.asarray(h1).tobytes(),
                                                       np.asarray(h2).tobytes()]
    two = U.grad_layout([(x.shape, x.dtype)], [p.shape for p in both], ["float32"] * 8,
                        list(LINEARS.values()) * 2, span.dw_dtypes)
    assert np.array_equal(_cut(g, two.dxs[0]), _cut(g1, one.dxs[0]))
    want = [(g1, seg) for seg in one.params] + [(g2, seg) for seg in one.params]
    want += [(g1, seg) for seg in one.mxfp8] + [(g2, seg) for seg in one.mxfp8]
    for k, (seg, (raw, own)) in enumerate(zip((*two.params, *two.mxfp8), want, strict=True)):
        assert np.array_equal(_cut(g, seg), _cut(raw, own)), k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_group_buffer_by_in_place_updates_is_the_concatenation_byte_for_byte(dtype):
    """``flat_group`` (zeros, then one ``dynamic_update_slice`` per gradient) against the plain
    concatenation: gradients out of order, gaps, a cast, zeros after; an overlap is refused."""
    keys = jax.random.split(jax.random.key(7), 3)
    grads = [jax.random.normal(keys[0], (4, 8)), jnp.full((5,), -0.0),
             jax.random.normal(keys[2], (3, 16)).astype(jnp.bfloat16)]
    group = U.GradGroup(200, dtype, ((2, 40), (0, 3), (1, 100)))
    fast = jax.jit(lambda gs: unit_grads.flat_group(group, gs))(grads)
    ref = jax.jit(lambda gs: unit_grads.flat_group_reference(group, gs))(grads)
    assert fast.dtype == ref.dtype == jnp.dtype(dtype) and fast.shape == (200,)
    assert np.asarray(fast).tobytes() == np.asarray(ref).tobytes()
    assert np.asarray(fast)[100:105].tobytes() == np.full(5, -0.0, dtype).tobytes()
    with pytest.raises(ValueError, match="gradient 2 at 34 overlaps or overflows"):
        unit_grads.flat_group(group._replace(slots=((0, 3), (2, 34))), grads)
    # a fill and in-place updates, never a pad of the whole buffer (XLA's rewrite of zeros + a
    # first update, several times slower at the 1.3B GPT's 429 MB root group)
    hlo = jax.jit(lambda gs: unit_grads.flat_group(group, gs)).lower(grads).compile().as_text()
    assert " pad(" not in hlo and "dynamic-update-slice(" in hlo


def test_the_gaps_are_what_no_slot_covers():
    """``unit_grads.gaps``: what ``flat_group`` zeroes when the GEMMs write their slots in place
    (``cublaslt.zeroed_gaps``); every element is in exactly one slot or one gap."""
    assert unit_grads.gaps(200, [(40, 48), (0, 3), (100, 5)]) == ((3, 37), (88, 12), (105, 95))
    assert unit_grads.gaps(10, [(0, 4), (4, 6)]) == ()
    assert unit_grads.gaps(10, []) == ((0, 10),)
    assert unit_grads.gaps(10, [(2, 3), (2, 3)]) == ((0, 2), (5, 5))
    spans = [(7, 5), (30, 2), (0, 3), (12, 1)]
    covered = np.zeros(40, int)
    for start, length in [*spans, *unit_grads.gaps(40, spans)]:
        covered[start:start + length] += 1
    assert (covered == 1).all()


class _DirectWriter:
    """A writer that says it writes in place (as cuBLASLt does on a GPU) and writes its slot."""

    def __init__(self, value):
        self.value = value

    def direct(self, dtype, start):
        return True

    def into(self, buf, start):
        return lax.dynamic_update_slice(buf, self.value.astype(buf.dtype), (start,))


def test_a_direct_writer_without_the_gpu_handler_gets_a_zero_buffer():
    """Where the cuBLASLt handlers cannot run (here: no GPU), a writer claiming to write in
    place still gets zeros around its slot (never an undefined buffer)."""
    group = U.GradGroup(64, "float32", ((0, 8), (1, 32)))
    grads = [jnp.ones((8,)), jnp.full((16,), 2.0)]
    got = jax.jit(lambda gs: unit_grads.flat_group(group, gs, {1: _DirectWriter(gs[1])}))(grads)
    want = unit_grads.flat_group_reference(group, grads)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
