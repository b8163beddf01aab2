"""The parity report: the Torch GPT twin vs the Flax GPT twin on the same bytes, compared.

Given a ``GPTConfig``, a seed and a batch, both twins run one forward and backward and the report
lists, per linear layer and for the model outputs:

- differences (max / mean absolute, and relative to the Torch value's max / mean magnitude) of
  each linear's input x, output y and output gradient dy, of logits, of the loss, and of every
  parameter's gradient; ``identical`` when the float32 bytes are equal;
- MXFP8 bytes (``LayerBytes``): whether the weight planes each side multiplied with are identical,
  the fraction of identical bytes in the quantized x and dy each side fed to its GEMMs, and a
  *teacher-forced* check: the Flax linear run on Torch's very x, W and dy must reproduce Torch's
  y, dx and dW byte for byte (same JAX kernels on the same bytes);
- zero-copy (``ZeroCopy``): every weight Flax consumed is the Torch tensor's memory (data pointers
  equal).

Where differences come from: the linears run the same JAX kernels on both sides; embeddings,
LayerNorm, attention, GELU and the loss are Torch kernels on one side and XLA on the other, with
different summation orders (float32 rounding, ~1e-7 relative). In MXFP8 mode such a rounding
difference occasionally moves an activation across an E4M3 rounding boundary, flipping one element
by one E4M3 step (2^-3 relative), which the next GEMMs spread; ``LayerBytes`` counts those flips.
The high-precision control (``LinearMode.HIGH_PRECISION``) removes quantization and leaves only
float32 rounding: it separates quantization effects from model bugs.

Gradients under FSDP (``GradExactness``): every rank runs the same batch, so each rank's local
gradient is the single-process gradient g and FSDP's is the DP average ``sum_r fl(g / W)``. For
W = 1, 2, 4 that is exactly g (a division by a power of two is exact, and any sum of W equal
values is exact for these W); for other W it is g only to fp32 rounding (W = 3: fl(g/3) * 3
need not be g), at most ``2 W 2^-24 |g|`` per element. The report says which holds
(``ParityReport.grad_exactness``), and the teacher-forced dW check uses that bound instead of
byte equality when the world size makes it inexact -- an expected rounding, not a failure.

Flow (``single.parity_report``): Flax initialises the parameters from the seed; the Torch twin
loads that checkpoint (``load_flat_params``); Flax then runs on the Torch model's parameters
imported zero-copy (``to_jax``). The sharded case (``sharded.sharded_parity_report``) runs the
Torch twin under ``torch_side`` FSDP on spawned ranks; rank 0 feeds Flax the planes FSDP
all-gathered. Both twins' linears run the one JAX linear (``jax_side.linear``) with the same
``KernelConfig``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import NamedTuple, TypeAlias

import jax
import numpy as np
import torch

from apps.parity.flax_run import FlaxRun, linear_names
from apps.parity.torch_run import TorchRun
from bridge import to_jax
from common.kernels import KernelConfig
from common.model_config import GPTConfig
from common.modes import LinearMode
from jax_side.linear import linear_fn, quantize_activation, quantize_weight
from jax_side.mxfp8 import MXFP8Tensor

__all__ = [
    "Diff",
    "GradExactness",
    "LayerBytes",
    "ParityReport",
    "Quantity",
    "ZeroCopy",
    "compare",
    "diff",
    "format_report",
    "mxfp8_bytes",
    "same_bits",
]


class Quantity(enum.Enum):
    """What a ``Diff`` row compares."""

    X = "x"  # a linear layer's input (T, in)
    Y = "y"  # its output (T, out)
    DY = "dy"  # its output gradient (T, out)
    LOGITS = "logits"
    LOSS = "loss"
    GRAD = "grad"  # a parameter's gradient


class Diff(NamedTuple):
    """Torch vs Flax for one tensor. rel = abs / (max or mean |torch value|)."""

    quantity: Quantity
    name: str
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float
    identical: bool  # float32 bytes equal


ArrayLike: TypeAlias = torch.Tensor | jax.Array | np.ndarray  # a value either stack computed


def _np(a: ArrayLike) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def diff(quantity: Quantity, name: str, torch_value: ArrayLike, flax_value: ArrayLike) -> Diff:
    t: np.ndarray = _np(torch_value).astype(np.float32)
    f: np.ndarray = _np(flax_value).astype(np.float32)
    if t.shape != f.shape:
        raise ValueError(f"parity diff {quantity} {name}: shapes {t.shape} vs {f.shape}")
    d = np.abs(t.astype(np.float64) - f.astype(np.float64))
    mag = np.abs(t.astype(np.float64))
    tiny = np.finfo(np.float32).tiny
    return Diff(
        quantity,
        name,
        float(d.max(initial=0.0)),
        float(d.mean()) if d.size else 0.0,
        float(d.max(initial=0.0) / max(mag.max(initial=0.0), tiny)),
        float(d.mean() / max(mag.mean(), tiny)) if d.size else 0.0,
        bool(np.array_equal(t.view(np.uint32), f.view(np.uint32))),
    )


def mxfp8_bytes(t: MXFP8Tensor) -> np.ndarray:
    return np.concatenate(
        [np.asarray(a).view(np.uint8).reshape(-1) for pair in t.planes.values() for a in pair]
    )


class GradExactness(enum.Enum):
    """How FSDP's DP-averaged gradient ``sum_r fl(g / W)`` relates to the single-process g when
    every rank runs the same batch (module note)."""

    EXACT = "exact"  # W in (1, 2, 4): bit for bit
    FP32_ROUNDING = "fp32_rounding"  # other W: within 2 W 2^-24 |g| per element

    @classmethod
    def for_world_size(cls, world_size: int) -> GradExactness:
        return cls.EXACT if world_size in _EXACT_WORLD_SIZES else cls.FP32_ROUNDING

    def describe(self, world_size: int) -> str:
        if self is GradExactness.EXACT:
            return f"gradients: the DP average over {world_size} rank(s) is exact"
        return (
            f"gradients: the DP average over {world_size} ranks is sum_r fl(g/{world_size}), "
            f"equal to the single-process gradient only to fp32 rounding (expected, not a "
            f"failure; teacher-forced dW compared within 2*{world_size}*2^-24*|g|)"
        )


_EXACT_WORLD_SIZES = (1, 2, 4)


def dp_average_matches(averaged: ArrayLike, single: ArrayLike, world_size: int) -> bool:
    """Whether ``averaged`` is ``sum_r fl(single / W)`` as exactly as ``GradExactness`` allows:
    byte-equal for W in (1, 2, 4), else within ``2 W 2^-24 |single| + W 2^-149`` per element
    (W relative roundings of 2^-24 in the divisions and the sum; the last term for subnormals)."""
    if GradExactness.for_world_size(world_size) is GradExactness.EXACT:
        return same_bits(averaged, single)
    a: np.ndarray = _np(averaged).astype(np.float64)
    b: np.ndarray = _np(single).astype(np.float64)
    bound = 2 * world_size * 2.0**-24 * np.abs(b) + world_size * 2.0**-149
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= bound))


class LayerBytes(NamedTuple):
    """Bytes of one linear layer. The MXFP8 fields are None in the high-precision control."""

    name: str
    # Flax on Torch's x, W, dy reproduces Torch's y, dx bytes and its dW (bytes, or within the
    # DP-average rounding bound when the world size makes it inexact: ``GradExactness``)
    teacher_forced_identical: bool
    weight_identical: bool | None  # both planes + scales each side multiplied with
    x_equal_fraction: float | None  # of the quantized (token-padded) input bytes, both planes
    dy_equal_fraction: float | None  # of the quantized output-gradient bytes, both planes


class ZeroCopy(NamedTuple):
    name: str  # parameter name (or "<name>:<plane field>" for MXFP8 planes)
    torch_ptr: int
    jax_ptr: int

    @property
    def shared(self) -> bool:
        return self.torch_ptr == self.jax_ptr


@dataclasses.dataclass(frozen=True)
class ParityReport:
    config: GPTConfig
    mode: LinearMode
    seed: int
    batch_shape: tuple[int, int]
    world_size: int
    diffs: tuple[Diff, ...]
    layers: tuple[LayerBytes, ...]
    zero_copy: tuple[ZeroCopy, ...]

    def get(self, quantity: Quantity | str, name: str = "") -> Diff:
        """The row for (quantity, name); quantity may be given by value, e.g. "grad"."""
        quantity = Quantity(quantity)
        for d in self.diffs:
            if d.quantity is quantity and (not name or d.name == name):
                return d
        raise KeyError(f"ParityReport has no diff for ({quantity.value!r}, {name!r})")

    def of(self, quantity: Quantity | str) -> list[Diff]:
        quantity = Quantity(quantity)
        return [d for d in self.diffs if d.quantity is quantity]

    @property
    def all_zero_copy(self) -> bool:
        return bool(self.zero_copy) and all(z.shared for z in self.zero_copy)

    @property
    def grad_exactness(self) -> GradExactness:
        """What equality FSDP's gradients can have with the single-process ones (module note)."""
        return GradExactness.for_world_size(self.world_size)

    def format(self) -> str:
        return format_report(self)

    def verdict(self) -> str:
        """One line: what was bit-identical and the largest difference elsewhere."""
        same = [d for d in self.diffs if d.identical]
        worst = max((d for d in self.diffs if not d.identical), key=lambda d: d.max_rel,
                    default=None)
        forced = all(lb.teacher_forced_identical for lb in self.layers)
        planes = all(lb.weight_identical is not False for lb in self.layers)
        planes_text = "no MXFP8 planes (control)" if self.mode is LinearMode.HIGH_PRECISION else (
            f"weight planes {'identical' if planes else 'DIFFER'}")
        text = (
            f"verdict: {len(same)}/{len(self.diffs)} compared tensors bit-identical; "
            f"teacher-forced linears {'all identical' if forced else 'NOT all identical'}; "
            f"{planes_text}; zero-copy "
            f"{'all' if self.all_zero_copy else 'NOT all'} shared; "
            f"{self.grad_exactness.describe(self.world_size)}"
        )
        if worst is not None:
            text += (
                f"; largest other difference: {worst.quantity.value} {worst.name} max_rel "
                f"{worst.max_rel:.1e}"
            )
        return text


def _byte_equal_fraction(a: MXFP8Tensor, b: MXFP8Tensor) -> float:
    """Fraction of identical bytes over both planes (data and scales) of two MXFP8Tensors."""
    return float(np.mean(mxfp8_bytes(a) == mxfp8_bytes(b)))


def _layer_check(
    mode: LinearMode, t_x: jax.Array, t_dy: jax.Array, f_x: jax.Array, f_dy: jax.Array,
    weight: jax.Array, planes: MXFP8Tensor | None, kernels: KernelConfig | None,
) -> tuple[float | None, float | None, jax.Array, jax.Array, jax.Array]:
    """One layer: byte-equal fractions of Torch's vs Flax's quantized x and dy (MXFP8 mode),
    and the teacher-forced Flax linear (models.flax_gpt) on Torch's x, W or planes, dy.

    Runs eagerly: the linear's quantizations and GEMMs are jitted per shape in
    ``jax_side.linear``, so this reuses the code the Flax model already compiled.
    """
    fn = linear_fn(mode, kernels)
    y, vjp = jax.vjp(lambda x, w: fn(x, w, planes), t_x, weight)
    dx, dw = vjp(t_dy)
    fx = fdy = None
    if mode is LinearMode.MXFP8:
        def q(a: jax.Array) -> MXFP8Tensor:
            return quantize_activation(a, kernels=kernels)

        fx = _byte_equal_fraction(q(t_x), q(f_x))
        fdy = _byte_equal_fraction(q(t_dy), q(f_dy))
    return fx, fdy, y, dx, dw


def same_bits(a: ArrayLike, b: ArrayLike) -> bool:
    x, y = _np(a), _np(b)
    return x.shape == y.shape and bool(np.array_equal(x.view(np.uint8), y.view(np.uint8)))


def _torch_weight_planes(weight: torch.Tensor, kernels: KernelConfig | None) -> MXFP8Tensor:
    """The planes the bridge op multiplies with when no FSDP planes are given (the same code)."""
    return quantize_weight(to_jax(weight.detach()), kernels=kernels)


def compare(
    cfg: GPTConfig,
    mode: LinearMode,
    torch_run: TorchRun,
    flax_run: FlaxRun,
    weights: Mapping[str, torch.Tensor],
    planes: Mapping[str, MXFP8Tensor] | None = None,
    kernels: KernelConfig | None = None,
    world_size: int = 1,
) -> tuple[tuple[Diff, ...], tuple[LayerBytes, ...]]:
    """Diffs and per-layer MXFP8 bytes of two runs. weights: Torch-style name -> Torch tensor
    (the values the Torch op used; a placeholder where planes are given); planes: flat weight
    name -> MXFP8Tensor when both stacks ran on these planes (FSDP's), else None. world_size:
    the Torch run's DP size (its gradients are DP averages: ``GradExactness``)."""
    names = linear_names(cfg)
    diffs, layers = [], []
    for name in names:
        tio, (fx, fy, fdy) = torch_run.linear_io[name], flax_run.linear_io[name]
        diffs += [diff(Quantity.X, name, tio.x, fx), diff(Quantity.Y, name, tio.y, fy)]
        diffs += [diff(Quantity.DY, name, tio.dy, fdy)]
    w = {n: n + ".weight" for n in names}
    for name in names:
        tio, fio = torch_run.linear_io[name], flax_run.linear_io[name]
        x_frac, dy_frac, y, dx, dw = _layer_check(
            mode, to_jax(tio.x), to_jax(tio.dy), fio[0], fio[2], to_jax(weights[w[name]]),
            None if planes is None else planes[w[name]], kernels,
        )
        forced = same_bits(tio.y, y) and same_bits(tio.dx, dx) and dp_average_matches(
            torch_run.grads[w[name]], dw, world_size
        )
        if mode is LinearMode.MXFP8:
            torch_q = (
                planes[w[name]] if planes is not None
                else _torch_weight_planes(weights[w[name]], kernels)
            )
            same_w = same_bits(mxfp8_bytes(torch_q), mxfp8_bytes(flax_run.weight_q[w[name]]))
            layers.append(LayerBytes(name, forced, same_w, x_frac, dy_frac))
        else:
            layers.append(LayerBytes(name, forced, None, None, None))
    diffs += [diff(Quantity.LOGITS, "", torch_run.logits, flax_run.logits)]
    diffs += [diff(Quantity.LOSS, "", torch_run.loss, flax_run.loss)]
    diffs += [diff(Quantity.GRAD, n, g, flax_run.grads[n]) for n, g in torch_run.grads.items()]
    return tuple(diffs), tuple(layers)


def _fmt(v: float) -> str:
    return f"{v:9.2e}"


def format_report(r: ParityReport) -> str:
    """The report as a fixed-width text table (what ``python -m apps.parity`` prints)."""
    c = r.config
    lines = [
        f"Cross-framework parity: TorchGPT (bridge op{', FSDP' if r.world_size > 1 else ''}) "
        f"vs FlaxGPT, matmul mode {r.mode.value}",
        f"config: vocab {c.vocab_size}, layers {c.n_layer}, heads {c.n_head}, d_model "
        f"{c.d_model}, d_ff {c.d_ff} | seed {r.seed} | batch {r.batch_shape} = "
        f"{r.batch_shape[0] * r.batch_shape[1]} tokens | Torch world size {r.world_size}",
        r.grad_exactness.describe(r.world_size),
        "",
        f"{'quantity':<8} {'name':<22} {'max_abs':>9} {'mean_abs':>9} {'max_rel':>9} "
        f"{'mean_rel':>9}  identical",
    ]
    for d in r.diffs:
        lines.append(
            f"{d.quantity.value:<8} {d.name:<22} {_fmt(d.max_abs)} {_fmt(d.mean_abs)} "
            f"{_fmt(d.max_rel)} {_fmt(d.mean_rel)}  {'yes' if d.identical else 'no'}"
        )
    def frac(v):
        return "-" if v is None else f"{v:.6f}"

    def same(v):
        return "-" if v is None else ("identical" if v else "DIFFERENT")

    if r.layers:
        lines += [
            "",
            "Bytes per linear layer. weight planes: the MXFP8 planes each side multiplied with; "
            "x, dy bytes:",
            "fraction of identical bytes of the quantized x and dy; teacher-forced: the Flax "
            "linear on Torch's x, W, dy gives Torch's y, dx, dW bytes",
            f"{'layer':<22} {'weight planes':>13} {'x bytes':>9} {'dy bytes':>9} "
            f"{'teacher-forced':>15}",
        ]
        for lb in r.layers:
            lines.append(
                f"{lb.name:<22} {same(lb.weight_identical):>13} {frac(lb.x_equal_fraction):>9} "
                f"{frac(lb.dy_equal_fraction):>9} {same(lb.teacher_forced_identical):>15}"
            )
    n_shared = sum(z.shared for z in r.zero_copy)
    lines += ["", f"zero-copy: {n_shared}/{len(r.zero_copy)} tensors Flax read share the Torch "
              f"data pointer"]
    return "\n".join(lines)
