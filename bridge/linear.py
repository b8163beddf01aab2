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
  Planes of another block-scaled format (a provider whose ``blocks`` are not MXFP8's: FSDP with
  a registered format) are read by ``jax_side.block_scaled``; x and dy are MXFP8 either way.
  Without planes, W = quantize(bf16(weight)) in forward, and its colwise plane is kept for dgrad.
- x colwise: the colwise MXFP8 plane of the (token-padded) x, computed in forward and kept (in JAX
  memory) for wgrad, as Transformer Engine does.

Saved for backward: the JAX planes (x colwise; without ``weight_planes`` also W's colwise plane)
live as long as autograd's saved tensors (``bridge.residuals``) -- freed right after this
node's backward, or kept when the graph is retained (``backward(retain_graph=True)``: a second
backward accumulates the same gradients again, with FSDP re-gathering W's colwise plane). A
backward through a freed graph raises Torch's own "backward through the graph a second time"
error, as ``nn.Linear`` does; under ``torch.utils.checkpoint(use_reentrant=False)`` they are
made again by the recomputation, not held (saved-tensor hooks: ``bridge.residuals``). They stay
JAX arrays (no crossing back to Torch and again to JAX per layer). Backward returns dx and dW in
one crossing. Zero tokens (x of shape (..., 0, K)) give an empty y and dx and a zero dW.

Quantization points, the token-padding rule and the jitted programs: ``jax_side.linear``, the one
JAX linear (the Flax twin runs it too). Kernels: a ``KernelConfig`` (None: the default for the
device the tensors are on), resolved once per call. Lifetime: every JAX result is brought back
with ``to_torch`` before the JAX views of Torch inputs are dropped, which orders Torch's stream
after the JAX reads (ownership note in ``bridge/dlpack.py``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import torch
from torch.autograd.function import once_differentiable

from bridge import residuals
from bridge.capabilities import required_alignment
from bridge.compile_ahead import active, run_in, run_or_compile
from bridge.dlpack import to_jax, to_torch
from bridge.dtypes import jax_dtype_for, torch_dtype_for
from bridge.mxfp8_tensor import MXFP8WeightPlanes, check_plane, planes_to_jax
from bridge.shared import SharedPlane, to_flat_plane
from common.formats import ALL_PLANES, MXFP8_BLOCKS, Plane, check_mxfp8_shape
from common.kernels import KernelConfig
from common.modes import LinearMode
from jax_side import linear as L
from jax_side.linear import FlatPlane
from jax_side.mxfp8 import MXFP8Tensor, ResolvedKernels, resolve_kernels

__all__ = ["LinearMode", "MXFP8Linear", "mxfp8_linear", "resolve_for"]

_MXFP8_DTYPES = (torch.float32, torch.bfloat16)
_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _share(t: torch.Tensor) -> jax.Array:
    """JAX view of an activation; one Torch-side copy if it cannot be aliased as it is."""
    t = t.detach()
    aligned = t.data_ptr() % required_alignment(t.device.type) == 0
    return to_jax(t, copy=not (t.is_contiguous() and aligned))


def _weight_plane(
    planes: MXFP8WeightPlanes, weight: torch.Tensor | _PlaneShape, plane: Plane
) -> FlatPlane | MXFP8Tensor:
    """Call the provider for one plane and share it with JAX (validated, zero-copy): from its
    already-shared buffers (``shared``), else by crossing its (data, scale) tensors."""
    shared = getattr(planes, "shared", None)
    if shared is not None:
        sp = shared(plane)
        if not isinstance(sp, SharedPlane) or sp.plane is not plane or (
            tuple(sp.shape) != tuple(weight.shape)
        ):
            raise ValueError(
                f"mxfp8_linear: weight_planes.shared({plane.value}) returned {sp!r}; expected a "
                f"bridge.shared.SharedPlane of the {plane.value} plane of shape "
                f"{tuple(weight.shape)}"
            )
        return to_flat_plane(sp)
    data, scale = planes.rowwise() if plane is Plane.ROWWISE else planes.colwise()
    shape, blocks = tuple(weight.shape), getattr(planes, "blocks", MXFP8_BLOCKS)
    check_plane(f"mxfp8_linear weight_planes.{plane.value}()", shape, plane, data, scale, blocks)
    if data.device != weight.device:
        raise ValueError(
            f"mxfp8_linear: weight_planes.{plane.value}() returned tensors on {data.device}, but "
            f"the weight is on {weight.device}; JAX runs each op on its Torch tensors' device"
        )
    if blocks != MXFP8_BLOCKS:  # another block format: read by jax_side.block_scaled
        flat_data, flat_scale = (_share(t.contiguous().view(torch.uint8).reshape(-1))
                                 for t in (data, scale))
        return FlatPlane(flat_data, flat_scale, 0, 0, shape, plane, blocks)
    # weights are quantized as bf16(master)
    return planes_to_jax(shape, torch.bfloat16, {plane: (data, scale)})


def resolve_for(kernels: KernelConfig | None, device: torch.device) -> ResolvedKernels:
    """The kernels a ``KernelConfig`` resolves to for work on a Torch device."""
    return resolve_kernels(kernels, "gpu" if device.type == "cuda" else "cpu")


def _check_args(x: torch.Tensor, weight: torch.Tensor, planes: MXFP8WeightPlanes | None,
                mode: LinearMode, out_dtype: torch.dtype | None) -> None:
    allowed = _MXFP8_DTYPES if mode is LinearMode.MXFP8 else _HP_DTYPES
    if mode is LinearMode.MXFP8:
        check_mxfp8_shape(weight.shape, "mxfp8_linear weight (N, K) (or use HIGH_PRECISION mode)")
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
        ctx.ahead = active()  # the backward compiles ahead too if this forward did
        ctx.w_dtype, ctx.w_shape, ctx.w_device = weight.dtype, tuple(weight.shape), weight.device
        out_j = jax_dtype_for(out_dtype)
        if mode is LinearMode.HIGH_PRECISION:
            # The parameter itself, not a detached alias: under FSDP its storage is the unsharded
            # bucket, which reshard frees after forward and pre-backward gathers again.
            ctx.save_for_backward(x2d, weight)
            y = run_or_compile(
                L.hp_forward, _share(x2d), _share(weight), out_dtype=out_j, kernels=kernels
            )
            return _result(y, x.device).reshape(*lead, n)
        # needs_input_grad stays True under torch.no_grad(); nothing is kept for backward then.
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        if planes is not None:
            w_row, w_colwise = _weight_plane(planes, weight, Plane.ROWWISE), None
        else:
            planes = ALL_PLANES if need_dx else (Plane.ROWWISE,)
            wq = run_or_compile(L.quantize_weight_program, _share(weight), planes=planes,
                                kernels=kernels)
            w_row, w_colwise = wq, (wq.only(Plane.COLWISE) if need_dx else None)
        out = run_or_compile(
            L.forward, _share(x2d), w_row, out_dtype=out_j, keep_x_colwise=need_dw,
            kernels=kernels,
        )
        # The JAX planes live as long as autograd's saved tensors (bridge.residuals): freed after
        # backward, kept by a retained graph; a backward through a freed graph raises Torch's
        # own error (nn.Linear's behaviour).
        ctx.save_for_backward(residuals.holder((out.x_colwise, w_colwise)))
        # orders Torch after JAX's reads of x and W
        return _result(out.y, x.device).reshape(*lead, n)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = dy.shape[-1]
        dy2d = _share(dy.reshape(-1, n))  # (T, N)
        if ctx.mode is LinearMode.HIGH_PRECISION:
            x2d, weight = ctx.saved_tensors
            out = run_in(
                ctx.ahead, L.hp_backward,
                dy2d, _share(x2d), _share(weight), need_dx=need_dx, need_dw=need_dw,
                kernels=ctx.kernels, packed=True,
            )
        else:
            x_colwise, w_col = residuals.saved(ctx)  # raises once the graph was freed
            if need_dx:
                if ctx.planes is not None:
                    w_col = _weight_plane(ctx.planes, _PlaneShape(ctx), Plane.COLWISE)
            out = run_in(
                ctx.ahead, L.backward,
                dy2d,
                w_col,
                x_colwise if need_dw else None,
                dx_dtype=jax_dtype_for(ctx.x_dtype),
                dw_dtype=jax_dtype_for(ctx.w_dtype),
                kernels=ctx.kernels,
                packed=True,
            )
        dx, dw = _unpack(out.packed, ctx, dy, need_dx, need_dw)
        return dx, dw, None, None, None, None, None


def _unpack(packed: jax.Array | None, ctx: Any, dy: torch.Tensor, need_dx: bool,
            need_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dx (lead..., K) and dW (N, K): views of the one uint8 array backward returned."""
    if packed is None:
        return None, None
    raw = _result(packed, dy.device)  # one crossing for both gradients
    n_w, k = ctx.w_shape
    tokens = dy.numel() // dy.shape[-1]
    dx = dw = None
    cursor = 0
    if need_dx:
        nbytes = tokens * k * ctx.x_dtype.itemsize
        dx = raw[:nbytes].view(ctx.x_dtype).view(*ctx.lead, k)
        cursor = nbytes
    if need_dw:
        dw = raw[cursor:cursor + n_w * k * ctx.w_dtype.itemsize].view(ctx.w_dtype).view(n_w, k)
    return dx, dw


def _result(a: jax.Array | jax.ShapeDtypeStruct, device: torch.device) -> torch.Tensor:
    """A JAX result as a Torch tensor; inside ``compile_ahead()`` (an abstract result, the
    program was compiled, not run) zeros of its shape and dtype on ``device``."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return torch.zeros(a.shape, dtype=torch_dtype_for(a.dtype), device=device)
    return to_torch(a)


class _PlaneShape:
    """What ``_weight_plane`` needs of the weight in backward, without keeping the weight."""

    def __init__(self, ctx: Any) -> None:
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
        device: torch.device | str | None = None,
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

    def mxfp8_params(self) -> tuple[str, ...]:
        """``common.formats.BlockScaledParams``: the weight is block-scaled in MXFP8 mode only."""
        return ("weight",) if self.mode is LinearMode.MXFP8 else ()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, mode={self.mode.value}"
            + ("" if self.kernels is None else f", kernels={self.kernels}")
        )
