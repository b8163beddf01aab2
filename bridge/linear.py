"""``mxfp8_linear``: y = x W^T as a Torch autograd op whose GEMMs are JAX MXFP8 kernels.

Tensors in one call (names used below):
- x: activations (..., K) bf16/fp32 (float64 allowed in HIGH_PRECISION), shared with JAX zero-copy
  when contiguous and aligned, else copied once on the Torch side (autograd hands out expanded or
  strided grads, which JAX cannot alias).
- weight: the (N, K) Torch tensor that receives dW through autograd. With ``weight_planes`` its
  values are never read (it may be a storage-free placeholder such as
  ``torch.zeros(1).as_strided((N, K), (0, 0)).detach().requires_grad_()``); only its shape, dtype,
  device and autograd identity matter.
- weight planes: precomputed MXFP8 planes held by Torch (``MXFP8WeightPlanes``, e.g. FSDP buffers).
  ``rowwise()`` is called in forward and ``colwise()`` only in backward; both are shared zero-copy
  (never re-quantized or copied) and no reference to them outlives the call that reads them.
  Without planes, W = quantize(bf16(weight)) in forward, and its colwise plane is kept for dgrad.
- x colwise: the colwise MXFP8 plane of the (token-padded) x, computed in forward and kept for
  wgrad, as Transformer Engine does.

Saved for backward: the x colwise plane (and, without planes, the weight's colwise plane) are
JAX arrays shared with Torch zero-copy and saved with ``ctx.save_for_backward``, so autograd owns
their lifetime exactly as ``nn.Linear``'s saved tensors: freed after backward, kept when the graph
is retained (``backward(retain_graph=True)``; a second backward accumulates the same gradients
again, and after a backward that freed the graph Torch's own "backward through the graph a second
time" error is raised), dropped and recomputed under ``torch.utils.checkpoint``, and visible to
``saved_tensors_hooks``. Zero tokens (x of shape (..., 0, K)) give an empty y and dx and a zero dW.

Quantization points, the token-padding rule and the jitted programs: ``jax_side.linear``, the one
JAX linear (the Flax twin runs it too). Kernels: a ``KernelConfig`` (None: the default for the
device the tensors are on), resolved once per call. Lifetime: every JAX result is brought back
with ``to_torch`` before the JAX views of Torch inputs are dropped, which orders Torch's stream
after the JAX reads (ownership note in ``bridge/dlpack.py``).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from bridge.dlpack import jax_dtype_for, required_alignment, to_jax, to_torch
from bridge.mxfp8_tensor import MXFP8WeightPlanes, check_plane, planes_to_jax
from common.formats import BLOCK_SIZE, Plane
from common.kernels import KernelConfig
from common.modes import LinearMode
from jax_side import linear as L
from jax_side.mxfp8 import MXFP8Tensor, ResolvedKernels, resolve_kernels

__all__ = ["LinearMode", "MXFP8Linear", "mxfp8_linear", "resolve_for"]

_MXFP8_DTYPES = (torch.float32, torch.bfloat16)
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _share(t: torch.Tensor):
    """JAX view of an activation; one Torch-side copy if it cannot be aliased as it is."""
    t = t.detach()
    aligned = t.data_ptr() % required_alignment(t.device.type) == 0
    return to_jax(t, copy=not (t.is_contiguous() and aligned))


def _weight_plane(planes: MXFP8WeightPlanes, weight: torch.Tensor, plane: Plane):
    """Call the provider for one plane and share it with JAX (validated, zero-copy)."""
    data, scale = planes.rowwise() if plane is Plane.ROWWISE else planes.colwise()
    shape = tuple(weight.shape)
    check_plane(f"mxfp8_linear weight_planes.{plane.value}()", shape, plane, data, scale)
    if data.device != weight.device:
        raise ValueError(
            f"mxfp8_linear: weight_planes.{plane.value}() returned tensors on {data.device}, but "
            f"the weight is on {weight.device}; JAX runs each op on its Torch tensors' device"
        )
    kw = {"rowwise" if plane is Plane.ROWWISE else "colwise": (data, scale)}
    return planes_to_jax(shape, torch.bfloat16, **kw)  # weights are quantized as bf16(master)


def _colwise_to_torch(t: MXFP8Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(data, scale) of a JAX colwise plane as Torch tensors over the same memory, to be saved
    for backward (autograd then owns their lifetime); (None, None) for no plane."""
    if t is None:
        return None, None
    data, scale = t.plane(Plane.COLWISE)
    return to_torch(data), to_torch(scale)


def _colwise_to_jax(shape, dtype: torch.dtype, data, scale) -> MXFP8Tensor | None:
    """The saved Torch (data, scale) back as a JAX colwise-only ``MXFP8Tensor`` (zero-copy)."""
    if data is None:
        return None
    return planes_to_jax(shape, dtype, colwise=(data, scale))


def resolve_for(kernels: KernelConfig | None, device: torch.device) -> ResolvedKernels:
    """The kernels a ``KernelConfig`` resolves to for work on a Torch device."""
    return resolve_kernels(kernels, "gpu" if device.type == "cuda" else "cpu")


def _check_args(x, weight, planes, mode: LinearMode, out_dtype) -> None:
    allowed = _MXFP8_DTYPES if mode is LinearMode.MXFP8 else _HP_DTYPES
    n, k = _weight_shape(weight)
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"mxfp8_linear: x of shape {tuple(x.shape)} must end in K = {k} (weight is (N, K) = "
            f"{(n, k)}; y = x @ weight.T)"
        )
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in allowed:
            raise TypeError(
                f"mxfp8_linear({mode.value}): {name} dtype {t.dtype} not in {allowed}; cast it"
            )
    if out_dtype is not None and out_dtype not in allowed:
        raise TypeError(f"mxfp8_linear: out_dtype {out_dtype} not in {allowed}")
    if x.device != weight.device:
        raise ValueError(f"mxfp8_linear: x is on {x.device} but weight on {weight.device}")
    if mode is LinearMode.MXFP8 and (n % BLOCK_SIZE or k % BLOCK_SIZE):
        raise ValueError(
            f"mxfp8_linear: MXFP8 needs weight (N, K) with N % 32 == 0 and K % 32 == 0, got "
            f"{(n, k)}; keep this layer in high precision (mode=LinearMode.HIGH_PRECISION)"
        )
    if planes is not None:
        if mode is not LinearMode.MXFP8:
            raise ValueError(
                "mxfp8_linear: weight_planes hold quantized bytes, so they only make sense with "
                "mode=LinearMode.MXFP8; pass weight values (weight_planes=None) for HIGH_PRECISION"
            )
        if tuple(planes.shape) != (n, k):
            raise ValueError(
                f"mxfp8_linear: weight_planes.shape {tuple(planes.shape)} != weight shape {(n, k)}"
            )


def _weight_shape(weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2:
        raise ValueError(f"mxfp8_linear: weight must be 2-D (N, K), got {tuple(weight.shape)}")
    return int(weight.shape[0]), int(weight.shape[1])


class _MXFP8LinearFn(torch.autograd.Function):
    """Forward/backward glue; the JAX pieces are in ``jax_side.linear``."""

    @staticmethod
    def forward(ctx, x, weight, planes, mode, out_dtype, grad_enabled, kernels):
        n, k = weight.shape
        lead = tuple(x.shape[:-1])
        x2d = x.detach().reshape(-1, k)  # (T, K), T = prod(lead)
        ctx.lead, ctx.x_dtype, ctx.mode, ctx.planes = lead, x.dtype, mode, planes
        ctx.kernels = kernels
        ctx.w_dtype, ctx.w_shape, ctx.w_device = weight.dtype, tuple(weight.shape), weight.device
        out_j = jax_dtype_for(out_dtype)
        if mode is LinearMode.HIGH_PRECISION:
            # The parameter itself, not a detached alias: under FSDP its storage is the unsharded
            # bucket, which reshard frees after forward and pre-backward gathers again.
            ctx.save_for_backward(x2d, weight)
            y = L.hp_forward(_share(x2d), _share(weight), out_dtype=out_j)
            return to_torch(y).reshape(*lead, n)
        # needs_input_grad stays True under torch.no_grad(); nothing is kept for backward then.
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        if planes is not None:
            w_row, w_col = _weight_plane(planes, weight, Plane.ROWWISE), None
        else:
            wq = L.quantize_weight(_share(weight), rowwise=True, colwise=need_dx, kernels=kernels)
            w_row, w_col = wq, (wq.only(Plane.COLWISE) if need_dx else None)
        out = L.forward(
            _share(x2d), w_row, out_dtype=out_j, keep_x_colwise=need_dw, kernels=kernels
        )
        y = to_torch(out.y).reshape(*lead, n)  # orders Torch after JAX's reads of x and W
        # (T_pad, K) and (N, K) colwise planes; weights are quantized as bf16(master).
        ctx.x_col_shape = None if out.x_colwise is None else tuple(out.x_colwise.shape)
        ctx.save_for_backward(*_colwise_to_torch(out.x_colwise), *_colwise_to_torch(w_col))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = dy.shape[-1]
        k = ctx.w_shape[1]
        dy2d = _share(dy.reshape(-1, n))  # (T, N)
        if ctx.mode is LinearMode.HIGH_PRECISION:
            x2d, weight = ctx.saved_tensors
            out = L.hp_backward(dy2d, _share(x2d), _share(weight), need_dx=need_dx, need_dw=need_dw)
        else:
            x_data, x_scale, w_data, w_scale = ctx.saved_tensors
            w_col = None
            if need_dx:
                w_col = _colwise_to_jax(ctx.w_shape, torch.bfloat16, w_data, w_scale)
                if ctx.planes is not None:
                    w_col = _weight_plane(ctx.planes, _PlaneShape(ctx), Plane.COLWISE)
            x_col = _colwise_to_jax(ctx.x_col_shape, ctx.x_dtype, x_data, x_scale)
            out = L.backward(
                dy2d,
                w_col,
                x_col if need_dw else None,
                dx_dtype=jax_dtype_for(ctx.x_dtype),
                dw_dtype=jax_dtype_for(ctx.w_dtype),
                kernels=ctx.kernels,
            )
        # (*lead, K): spelled out, since -1 is ambiguous when there are zero tokens
        dx = None if out.dx is None else to_torch(out.dx).reshape(*ctx.lead, k)
        dw = None if out.dw is None else to_torch(out.dw)
        return dx, dw, None, None, None, None, None


class _PlaneShape:
    """What ``_weight_plane`` needs of the weight in backward, without keeping the weight."""

    def __init__(self, ctx):
        self.shape = ctx.w_shape
        self.dtype = ctx.w_dtype
        self.device = ctx.w_device


def mxfp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_planes: MXFP8WeightPlanes | None = None,
    mode: LinearMode | str = LinearMode.MXFP8,
    out_dtype: torch.dtype | None = None,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """y = x @ weight.T with JAX MXFP8 GEMMs and Torch autograd (dx to x, dW to weight).

    x (..., K) bf16/fp32; weight (N, K) bf16/fp32 (float64 too in HIGH_PRECISION); weight_planes:
    precomputed MXFP8 planes of W (then weight's values are never read) or None (W quantized on
    the fly as bf16(weight)). Returns (..., N) in ``out_dtype`` (default x.dtype). dx has x's
    dtype, dW weight's dtype. kernels: None for the default on x's device. See the module
    docstring for the tensors and their lifetimes.
    """
    mode = LinearMode.parse(mode)
    _check_args(x, weight, weight_planes, mode, out_dtype)
    return _MXFP8LinearFn.apply(
        x, weight, weight_planes, mode, out_dtype or x.dtype, torch.is_grad_enabled(),
        resolve_for(kernels, x.device),
    )


class MXFP8Linear(torch.nn.Module):
    """``nn.Linear``-like layer (weight (out, in), optional bias) running ``mxfp8_linear``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        mode: LinearMode | str = LinearMode.MXFP8,
        device=None,
        dtype: torch.dtype = torch.float32,
        kernels: KernelConfig | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.mode, self.kernels = LinearMode.parse(mode), kernels
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
            if bias
            else None
        )
        bound = 1.0 / math.sqrt(in_features)
        torch.nn.init.uniform_(self.weight, -bound, bound)

    def forward(
        self, x: torch.Tensor, weight_planes: MXFP8WeightPlanes | None = None
    ) -> torch.Tensor:
        y = mxfp8_linear(
            x, self.weight, weight_planes=weight_planes, mode=self.mode, kernels=self.kernels
        )
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, mode={self.mode.value}"
            + ("" if self.kernels is None else f", kernels={self.kernels}")
        )
