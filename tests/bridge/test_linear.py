"""bridge.mxfp8_linear: Torch autograd over JAX MXFP8 GEMMs, against the pure-JAX reference.

Shapes are few on purpose (every new shape is an XLA compile on a 2-core CI box): 51 tokens as
(3, 17) -- not a multiple of 32, so the token-padding rule is exercised -- K = 64, N = 96.
"""

from __future__ import annotations

import gc
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
import bridge.capabilities
import bridge.jax_to_torch
import bridge.torch_to_jax
from bridge import (
    Fp8Transport,
    LinearMode,
    MXFP8Linear,
    ZeroCopyError,
    mxfp8_linear,
    to_jax,
    to_torch_mxfp8,
)
from bridge.capsule import DLDataTypeCode, relabel
from jax_side import linear as jax_linear
from jax_side.linear import padded_tokens
from jax_side.linear_reference import mxfp8_linear_reference
from jax_side.mxfp8 import quantize
from tests.bridge.conftest import DEVICES
from tests.bridge.residual_refs import recording_residuals

LEAD, K, N = (3, 17), 64, 96


def _inputs(device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*LEAD, K, generator=g) * 3).to(dtype).to(device).requires_grad_()
    w = (torch.randn(N, K, generator=g) / 8).to(device).requires_grad_()
    dy = torch.randn(*LEAD, N, generator=g).to(dtype).to(device)
    return x, w, dy


@jax.jit
def _reference_vjp(x, w, dy):
    y, vjp = jax.vjp(mxfp8_linear_reference, x, w)
    return (y, *vjp(dy))


def _reference(x, w, dy):
    """jax.vjp of the pure-JAX reference on copies of the same values."""
    out = _reference_vjp(*(to_jax(t.detach(), copy=True) for t in (x, w, dy)))
    return [np.asarray(v.astype(jnp.float32)) for v in out]


def _np(t):
    return t.detach().float().cpu().numpy()


def _assert_fp32_level(got, want, what, dtype=torch.float32):
    """Equal up to fp32 summation order (plus one rounding step of a bf16 output)."""
    scale = float(np.abs(want).max())
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6 * scale, err_msg=what)


class Planes:
    """An MXFP8WeightPlanes provider like FSDP's: fresh uint8 tensors per call, calls recorded."""

    def __init__(self, w: torch.Tensor):
        q = quantize(to_jax(w.detach(), copy=True).astype(jnp.bfloat16))
        self._tt, self.shape, self.calls, self.handed_out = to_torch_mxfp8(q), (N, K), [], []

    def _give(self, name, data, scale):
        self.calls.append(name)
        out = (data.view(torch.uint8).clone(), scale.view(torch.uint8).clone())
        self.handed_out += [weakref.ref(t) for t in out]
        return out

    def rowwise(self):
        return self._give("rowwise", *self._tt.rowwise())

    def colwise(self):
        return self._give("colwise", *self._tt.colwise())


def _all_released(refs, device) -> bool:
    """Whether every weakref died; on CUDA, JAX may drop a DLPack view from a runtime thread a
    moment after the work that read it, so poll (bounded) instead of checking once."""
    for _ in range(200):
        gc.collect()
        if all(r() is None for r in refs):
            return True
        if device == "cpu":
            return False
        torch.cuda.synchronize()
        time.sleep(0.01)
    return False


def _placeholder(device="cpu"):
    """A storage-free weight whose values must never be read (they would be NaN)."""
    return torch.full((1,), float("nan"), device=device).as_strided((N, K), (0, 0)).requires_grad_()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_pure_jax_reference(device, dtype):
    x, w, dy = _inputs(device, dtype)
    y = mxfp8_linear(x, w)
    y.backward(dy)
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == torch.float32
    y_ref, dx_ref, dw_ref = _reference(x, w, dy)
    if device == "cpu":  # same XLA CPU kernels on both sides: bit for bit
        for got, want in ((y, y_ref), (x.grad, dx_ref), (w.grad, dw_ref)):
            np.testing.assert_array_equal(_np(got), want)
    _assert_fp32_level(_np(y), y_ref, "y", dtype)
    _assert_fp32_level(_np(x.grad), dx_ref, "dx", dtype)
    _assert_fp32_level(_np(w.grad), dw_ref, "dw")


@pytest.mark.parametrize("device", DEVICES)
def test_weight_planes_are_used_lazily_and_give_the_same_result(device):
    x, w, dy = _inputs(device)
    y = mxfp8_linear(x, w)
    y.backward(dy)
    planes, ph = Planes(w), _placeholder(device)
    x2 = x.detach().clone().requires_grad_()
    y2 = mxfp8_linear(x2, ph, weight_planes=planes)
    assert planes.calls == ["rowwise"]  # forward never asks for the columnwise plane
    assert _all_released(planes.handed_out, device)  # no reference kept after forward
    y2.backward(dy)
    assert planes.calls == ["rowwise", "colwise"]
    assert _all_released(planes.handed_out, device)
    for got, want in ((y2, y), (x2.grad, x.grad), (ph.grad, w.grad)):
        np.testing.assert_array_equal(_np(got), _np(want))


def test_planes_cross_as_relabeled_uint8_where_native_float8_is_unavailable(monkeypatch):
    x, w, dy = _inputs()
    y = mxfp8_linear(x, w)
    y.backward(dy)
    byte_floats = bridge.dlpack_support().torch_to_jax
    uint8_only = bridge.DlpackSupport(
        {d: Fp8Transport.UINT8 for d in byte_floats},
        {d: Fp8Transport.UINT8 for d in byte_floats},
        {"simulated": "native float8 DLPack unavailable"},
    )
    monkeypatch.setattr(bridge.capabilities, "dlpack_support", lambda: uint8_only)
    relabels = []

    def spy(c, code):
        relabels.append(code)
        relabel(c, code)

    for direction in (bridge.torch_to_jax, bridge.jax_to_torch):
        monkeypatch.setattr(direction, "relabel", spy)
    planes, ph = Planes(w), _placeholder()
    relabels.clear()  # count only the op's own transfers
    x2 = x.detach().clone().requires_grad_()
    mxfp8_linear(x2, ph, weight_planes=planes).backward(dy)
    e4m3, e8m0 = DLDataTypeCode.FLOAT8_E4M3FN, DLDataTypeCode.FLOAT8_E8M0FNU
    assert relabels == [
        e4m3, e8m0,  # forward: the weight's rowwise plane to JAX
        e4m3, e8m0,  # backward: the weight's colwise plane to JAX (x's stays in JAX on ctx)
    ], relabels
    np.testing.assert_array_equal(_np(x2.grad), _np(x.grad))
    np.testing.assert_array_equal(_np(ph.grad), _np(w.grad))


def test_colwise_plane_is_not_fetched_when_no_dgrad_is_needed():
    x, w, dy = _inputs()
    planes = Planes(w)
    ph = _placeholder()
    y = mxfp8_linear(x.detach(), ph, weight_planes=planes)
    y.backward(dy)
    assert planes.calls == ["rowwise"] and ph.grad is not None


def test_misaligned_weight_planes_are_refused_not_copied():
    _, w, _ = _inputs()

    class Misaligned(Planes):
        def rowwise(self):
            data, scale = super().rowwise()
            buf = torch.empty(data.numel() + 8, dtype=torch.uint8)
            shifted = buf[8:].view(data.shape)
            shifted.copy_(data)
            return shifted, scale

    with pytest.raises(ZeroCopyError, match="8 bytes past a 64-byte boundary"):
        mxfp8_linear(torch.ones(32, K), _placeholder(), weight_planes=Misaligned(w))


def test_expanded_and_strided_grads_and_inputs_are_accepted():
    x, w, _ = _inputs()
    xt = x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # strided
    y = mxfp8_linear(xt, w)
    y.sum().backward()  # dy is an expanded (stride-0) tensor
    y_ref, dx_ref, dw_ref = _reference(xt, w, torch.ones_like(y))
    _assert_fp32_level(_np(xt.grad), dx_ref, "dx")
    _assert_fp32_level(_np(w.grad), dw_ref, "dw")


def test_only_requested_grads_are_computed():
    x, w, dy = _inputs()
    y = mxfp8_linear(x, w.detach())
    y.backward(dy)
    assert x.grad is not None
    _, dx_ref, _ = _reference(x, w, dy)
    _assert_fp32_level(_np(x.grad), dx_ref, "dx")


def test_nothing_is_kept_for_backward_under_no_grad(monkeypatch):
    x, w, _ = _inputs()
    seen = []
    real = jax_linear.forward

    def spy(*args, keep_x_colwise, **kw):
        seen.append(keep_x_colwise)
        return real(*args, keep_x_colwise=keep_x_colwise, **kw)

    monkeypatch.setattr(jax_linear, "forward", spy)
    planes = Planes(w)
    with torch.no_grad():
        y = mxfp8_linear(x, _placeholder(), weight_planes=planes)
    assert not y.requires_grad and seen == [False] and planes.calls == ["rowwise"]
    y = mxfp8_linear(x, w)
    assert seen == [False, True]


@pytest.mark.parametrize("tokens", [1, 31, 32, 33])
def test_token_padding_rule(tokens):
    assert padded_tokens(tokens) % 32 == 0 and padded_tokens(tokens) >= max(tokens, 32)
    assert padded_tokens(tokens) - tokens < 32


def test_mxfp8_is_close_to_the_unquantized_product():
    x, w, _ = _inputs()
    y = mxfp8_linear(x.detach(), w.detach())
    exact = (x.detach().double() @ w.detach().double().T).numpy()
    rel = np.linalg.norm(_np(y) - exact) / np.linalg.norm(exact)
    assert rel < 0.1, rel  # E4M3 has 3 mantissa bits; a wrong scale or plane is far off


def test_high_precision_mode_passes_gradcheck_in_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    with jax.enable_x64(True):
        assert torch.autograd.gradcheck(
            lambda a, b: mxfp8_linear(a, b, mode=LinearMode.HIGH_PRECISION), (x, w)
        )
    with pytest.raises(ZeroCopyError, match="jax_enable_x64"):
        mxfp8_linear(x, w, mode="high_precision")


def test_high_precision_mode_matches_torch_in_float32():
    x, w, dy = _inputs()
    y = mxfp8_linear(x, w, mode=LinearMode.HIGH_PRECISION)
    y.backward(dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (xr @ wr.T).backward(dy.double())
    for got, want in ((y, xr @ wr.T), (x.grad, xr.grad), (w.grad, wr.grad)):
        np.testing.assert_allclose(_np(got), _np(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda x, w: mxfp8_linear(x[..., :32], w), ValueError, "must end in K = 64"),
        (lambda x, w: mxfp8_linear(x, w[:40]), ValueError, r"M % 32 == 0.*\(40, 64\)"),
        (lambda x, w: mxfp8_linear(x.half(), w), TypeError, "x dtype torch.float16"),
        (lambda x, w: mxfp8_linear(x, w, out_dtype=torch.int8), TypeError, "out_dtype"),
        (
            lambda x, w: mxfp8_linear(x, w, weight_planes=Planes(w), mode="high_precision"),
            ValueError,
            "only make sense with mode=LinearMode.MXFP8",
        ),
        (lambda x, w: mxfp8_linear(x, w, mode="fp4"), ValueError, "fp4"),
    ],
    ids=["k-mismatch", "n-not-32", "fp16", "out-int8", "planes-in-hp", "bad-mode"],
)
def test_bad_arguments_are_refused_clearly(call, error, match):
    x, w, _ = _inputs()
    with pytest.raises(error, match=match):
        call(x, w)


def test_planes_with_the_wrong_layout_are_refused():
    _, w, _ = _inputs()

    class Transposed(Planes):
        def rowwise(self):
            data, scale = super().rowwise()
            return data, scale.reshape(-1)[: (N // 32) * K].reshape(N // 32, K)

    with pytest.raises(ValueError, match=r"rowwise scale .* must have shape \(96, 2\)"):
        mxfp8_linear(torch.ones(32, K), _placeholder(), weight_planes=Transposed(w))


def test_module_wrapper_trains_weight_and_bias():
    torch.manual_seed(0)
    layer = MXFP8Linear(K, N)
    assert "mode=mxfp8" in repr(layer)
    x, _, dy = _inputs()
    y = layer(x)
    y.backward(dy)
    assert tuple(y.shape) == (*LEAD, N)
    np.testing.assert_allclose(_np(layer.bias.grad), _np(dy.sum(dim=(0, 1))), rtol=1e-5)
    _, _, dw_ref = _reference(x, layer.weight, dy)
    _assert_fp32_level(_np(layer.weight.grad), dw_ref, "dw")


@pytest.mark.parametrize("with_planes", [False, True], ids=["quantized", "weight-planes"])
def test_second_backward_over_a_retained_graph_accumulates_like_nn_linear(with_planes):
    """The saved planes live as long as the graph: ``retain_graph=True`` keeps them, so a second
    backward adds the same dx and dW again (with planes, the colwise plane is asked for again);
    once a backward has freed the graph, Torch's own error is raised, as for ``nn.Linear``."""
    x, w, dy = _inputs()
    y = mxfp8_linear(x, w)
    y.backward(dy)
    once_dx, once_dw = x.grad.clone(), w.grad.clone()
    x2 = x.detach().clone().requires_grad_()
    planes = Planes(w) if with_planes else None
    w2 = _placeholder() if with_planes else w.detach().clone().requires_grad_()
    y2 = mxfp8_linear(x2, w2, weight_planes=planes)
    y2.backward(dy, retain_graph=True)
    y2.backward(dy)
    assert torch.equal(x2.grad, 2 * once_dx) and torch.equal(w2.grad, 2 * once_dw)
    if with_planes:
        assert planes.calls == ["rowwise", "colwise", "colwise"]
        assert _all_released(planes.handed_out, "cpu")
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y2.backward(dy)


def test_the_saved_planes_are_freed_by_the_backward_while_the_output_lives(monkeypatch):
    """The JAX planes kept for backward die with autograd's saved tensors -- right after the
    backward, by reference counts alone, while ``y`` (and so the graph object) is still
    referenced -- not with the graph object (``bridge.residuals``)."""
    refs = recording_residuals(monkeypatch)
    x, w, dy = _inputs()
    gc.disable()
    try:
        y = mxfp8_linear(x, w)
        assert len(refs) >= 2 and all(r() is not None for r in refs)  # x's and W's colwise
        y.backward(dy)
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()
    assert y.grad_fn is not None

def test_under_non_reentrant_checkpointing_the_planes_are_made_again_not_held(monkeypatch):
    """``torch.utils.checkpoint(use_reentrant=False)`` drops the saved holder at the forward:
    the first forward's planes are freed at once, the backward's recomputation makes them again
    (and frees them), and the gradients are the plain backward's bytes."""
    from torch.utils.checkpoint import checkpoint

    x, w, dy = _inputs()
    mxfp8_linear(x, w).backward(dy)
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    refs = recording_residuals(monkeypatch)
    gc.disable()
    try:
        y = checkpoint(lambda t: mxfp8_linear(t, w), x, use_reentrant=False)
        first = len(refs)
        assert first >= 2 and [r() for r in refs] == [None] * first
        y.backward(dy)
        assert len(refs) == 2 * first and [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])


def test_save_on_cpu_keeps_the_planes_and_a_copying_hook_gets_a_clear_error():
    """``save_on_cpu()`` hands the (empty, CPU) holder back as it is: the backward runs. A hook
    that hands back a copy loses the JAX planes the holder carries: a RuntimeError says so."""
    x, w, dy = _inputs()
    mxfp8_linear(x, w).backward(dy)
    want = x.grad.clone()
    x.grad = None
    with torch.autograd.graph.save_on_cpu():
        y = mxfp8_linear(x, w)
    y.backward(dy)
    assert torch.equal(x.grad, want)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        y = mxfp8_linear(x, w)
    with pytest.raises(RuntimeError, match=r"the JAX residuals this op saved for backward are "
                                           r"gone: a saved-tensor hook"):
        y.backward(dy)


@pytest.mark.parametrize("with_planes", [False, True], ids=["quantized", "weight-planes"])
def test_zero_tokens_give_empty_outputs_and_a_zero_weight_gradient(with_planes):
    """An MoE expert that receives no tokens: y and dx are empty, dW is zero (not a crash)."""
    _, w, _ = _inputs()
    x = torch.zeros(2, 0, K, requires_grad=True)
    weight = _placeholder() if with_planes else w.detach().clone().requires_grad_()
    y = mxfp8_linear(x, weight, weight_planes=Planes(w) if with_planes else None)
    assert tuple(y.shape) == (2, 0, N)
    y.sum().backward()
    assert tuple(x.grad.shape) == (2, 0, K)
    assert tuple(weight.grad.shape) == (N, K) and not weight.grad.any()
