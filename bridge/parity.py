"""Cross-framework parity: the Torch GPT twin vs the Flax GPT twin on the same bytes.

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
The high-precision control (``MatmulMode.HIGH_PRECISION``) removes quantization and leaves only
float32 rounding: it separates quantization effects from model bugs.

Flow: Flax initialises the parameters from the seed; the Torch twin loads that checkpoint
(``load_flat_params``); Flax then runs on the Torch model's parameters imported zero-copy
(``to_jax``). The sharded case (``torch_side.models.sharded_parity``) runs the Torch twin under
``torch_side`` FSDP on gloo ranks; each rank calls ``parity_on_gathered`` to feed Flax the planes
FSDP all-gathered.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge.dlpack import to_jax
from bridge.linear_kernels import quantize_weight as bridge_quantize_weight
from bridge.mxfp8_tensor import TorchMXFP8Tensor, to_jax_mxfp8
from jax_side.models import (
    FlaxGPT,
    GPTConfig,
    MatmulMode,
    cross_entropy,
    flat_params,
    linear_fn,
    nested_params,
    quantize_activation,
    quantize_weight,
)
from jax_side.mxfp8 import MXFP8Tensor
from torch_side.models import TorchGPT, load_flat_params
from torch_side.models.capture import TorchRun, run_torch

__all__ = [
    "Batch",
    "Diff",
    "FlaxRun",
    "LayerBytes",
    "ParityReport",
    "Quantity",
    "ZeroCopy",
    "compare",
    "init_flax_params",
    "make_batch",
    "parity_on_gathered",
    "parity_report",
    "run_flax",
]


class Batch(NamedTuple):
    tokens: np.ndarray  # int32 (B, S)
    targets: np.ndarray  # int32 (B, S): the next token of the same random stream


def make_batch(cfg: GPTConfig, seed: int, batch_size: int, seq_len: int) -> Batch:
    """A deterministic random token batch; seq_len <= cfg.max_seq_len, any B * S (not only x32)."""
    if not 1 <= seq_len <= cfg.max_seq_len or batch_size < 1:
        raise ValueError(
            f"make_batch: need 1 <= seq_len <= max_seq_len={cfg.max_seq_len} and batch_size >= "
            f"1, got seq_len={seq_len}, batch_size={batch_size}"
        )
    stream = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch_size, seq_len + 1))
    stream = stream.astype(np.int32)
    return Batch(stream[:, :-1].copy(), stream[:, 1:].copy())


def _check_batch(cfg: GPTConfig, batch) -> Batch:
    tokens, targets = (np.asarray(a) for a in batch)
    if tokens.shape != targets.shape or tokens.ndim != 2 or tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(
            f"parity batch: tokens {tokens.shape} and targets {targets.shape} must both be "
            f"(B, S) with S <= max_seq_len={cfg.max_seq_len}"
        )
    for what, a in (("tokens", tokens), ("targets", targets)):
        if a.size and (a.min() < 0 or a.max() >= cfg.vocab_size):
            raise ValueError(f"parity batch: {what} must lie in [0, {cfg.vocab_size})")
    return Batch(tokens.astype(np.int32), targets.astype(np.int32))


@functools.lru_cache(maxsize=8)
def _init_fn(cfg: GPTConfig):
    return jax.jit(FlaxGPT(cfg, MatmulMode.HIGH_PRECISION).init)


def init_flax_params(cfg: GPTConfig, seed: int) -> dict:
    """Nested float32 Linen params of ``FlaxGPT(cfg)`` from ``jax.random.key(seed)``."""
    tokens = jnp.zeros((1, min(cfg.max_seq_len, 32)), jnp.int32)
    return _init_fn(cfg)(jax.random.key(seed), tokens)["params"]


class FlaxRun(NamedTuple):
    logits: jax.Array  # (B, S, V) float32
    loss: jax.Array  # () float32
    linear_io: dict[str, tuple[jax.Array, jax.Array, jax.Array]]  # name -> x, y, dy (T, C)
    grads: dict[str, jax.Array]  # Torch-style parameter names
    # MXFP8 mode: the planes each linear multiplied with -- the given planes, or bf16(weight)
    # requantized by the layer's own (jitted, deterministic) quantize_weight
    weight_q: dict[str, MXFP8Tensor]


def _linear_names(cfg: GPTConfig) -> list[str]:
    return [n.rsplit(".", 1)[0] for n in cfg.linear_shapes()]


@functools.lru_cache(maxsize=16)
def _flax_step_fn(cfg: GPTConfig, mode: MatmulMode, batch_shape: tuple[int, int]):
    """The forward + backward with capture, built once per (config, mode, batch shape).

    Runs eagerly: the MXFP8 linears are jitted per shape inside ``jax_side.models.linear``, so
    layers of equal shape share compiled code (a whole-model jit compiles every layer anew).
    """
    model = FlaxGPT(cfg, mode)
    tokens_n = batch_shape[0] * batch_shape[1]
    names = _linear_names(cfg)

    def loss_fn(params, perturb, planes, tokens, targets):
        variables = {"params": params, "perturbations": perturb}
        if planes is not None:
            variables["mxfp8"] = planes
        logits, state = model.apply(variables, tokens, mutable=["intermediates"])
        return cross_entropy(logits, targets), (logits, state["intermediates"])

    def step(params, planes, tokens, targets):
        shapes = cfg.linear_shapes()
        perturb = nested_params(
            {f"{n}.dy": jnp.zeros((tokens_n, shapes[n + ".weight"][0]), jnp.float32) for n in names}
        )
        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
        (loss, (logits, inter)), (g_params, g_perturb) = grad_fn(
            params, perturb, planes, tokens, targets
        )
        flat_inter, flat_dy = flat_params(inter), flat_params(g_perturb)
        io = {
            n: (flat_inter[f"{n}.input"][0], flat_inter[f"{n}.output"][0], flat_dy[f"{n}.dy"])
            for n in names
        }
        weight_q = {}
        if mode is MatmulMode.MXFP8:
            flat_w, flat_planes = flat_params(params), flat_params(planes or {})
            for n in (n + ".weight" for n in names):
                given = flat_planes.get(n)
                weight_q[n] = quantize_weight(flat_w[n]) if given is None else given
        return logits, loss, io, flat_params(g_params), weight_q

    return step


def run_flax(
    cfg: GPTConfig,
    mode: MatmulMode,
    params: Mapping,
    tokens: np.ndarray,
    targets: np.ndarray,
    planes: Mapping | None = None,
) -> FlaxRun:
    """Forward + backward of FlaxGPT on ``params`` (used as-is), optional MXFP8 ``planes``.

    planes: nested like params, ``<layer path>/weight`` -> MXFP8Tensor (both planes), e.g.
    FSDP's all-gathered planes imported zero-copy; None to quantize bf16(param) in each layer.
    """
    step = _flax_step_fn(cfg, MatmulMode.parse(mode), tuple(tokens.shape))
    return FlaxRun(*step(params, planes, jnp.asarray(tokens), jnp.asarray(targets)))


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


def _np(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def diff(quantity: Quantity, name: str, torch_value, flax_value) -> Diff:
    t, f = _np(torch_value).astype(np.float32), _np(flax_value).astype(np.float32)
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


def _bytes(t: MXFP8Tensor) -> np.ndarray:
    parts = (t.rowwise_data, t.rowwise_scale, t.colwise_data, t.colwise_scale)
    return np.concatenate(
        [np.asarray(p).view(np.uint8).reshape(-1) for p in parts if p is not None]
    )


class LayerBytes(NamedTuple):
    """Bytes of one linear layer. The MXFP8 fields are None in the high-precision control."""

    name: str
    teacher_forced_identical: bool  # Flax on Torch's x, W, dy reproduces Torch's y, dx, dW bytes
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
    mode: MatmulMode
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

    def format(self) -> str:
        return format_report(self)

    def verdict(self) -> str:
        """One line: what was bit-identical and the largest difference elsewhere."""
        same = [d for d in self.diffs if d.identical]
        worst = max((d for d in self.diffs if not d.identical), key=lambda d: d.max_rel,
                    default=None)
        forced = all(lb.teacher_forced_identical for lb in self.layers)
        planes = all(lb.weight_identical is not False for lb in self.layers)
        planes_text = "no MXFP8 planes (control)" if self.mode is MatmulMode.HIGH_PRECISION else (
            f"weight planes {'identical' if planes else 'DIFFER'}")
        text = (
            f"verdict: {len(same)}/{len(self.diffs)} compared tensors bit-identical; "
            f"teacher-forced linears {'all identical' if forced else 'NOT all identical'}; "
            f"{planes_text}; zero-copy "
            f"{'all' if self.all_zero_copy else 'NOT all'} shared"
        )
        if worst is not None:
            text += (
                f"; largest other difference: {worst.quantity.value} {worst.name} max_rel "
                f"{worst.max_rel:.1e}"
            )
        return text


def _byte_equal_fraction(a: MXFP8Tensor, b: MXFP8Tensor) -> float:
    """Fraction of identical bytes over both planes (data and scales) of two MXFP8Tensors."""
    return float(np.mean(_bytes(a) == _bytes(b)))


def _layer_check(mode: MatmulMode, t_x, t_dy, f_x, f_dy, weight, planes):
    """One layer: byte-equal fractions of Torch's vs Flax's quantized x and dy (MXFP8 mode),
    and the teacher-forced Flax linear (jax_side.models) on Torch's x, W or planes, dy.

    Runs eagerly: the linear's quantizations and GEMMs are jitted per shape in
    ``jax_side.models.linear``, so this reuses the code the Flax model already compiled.
    """
    fn = linear_fn(mode)
    y, vjp = jax.vjp(lambda x, w: fn(x, w, planes), t_x, weight)
    dx, dw = vjp(t_dy)
    fx = fdy = None
    if mode is MatmulMode.MXFP8:
        fx = _byte_equal_fraction(quantize_activation(t_x), quantize_activation(f_x))
        fdy = _byte_equal_fraction(quantize_activation(t_dy), quantize_activation(f_dy))
    return fx, fdy, y, dx, dw


def _same_bits(a, b) -> bool:
    a, b = _np(a), _np(b)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def _torch_weight_planes(weight: torch.Tensor) -> MXFP8Tensor:
    """The planes the bridge op multiplies with when no FSDP planes are given (its own code)."""
    return bridge_quantize_weight(to_jax(weight.detach()), rowwise=True, colwise=True)


def compare(
    cfg: GPTConfig,
    mode: MatmulMode,
    torch_run: TorchRun,
    flax_run: FlaxRun,
    weights: Mapping[str, torch.Tensor],
    planes: Mapping[str, MXFP8Tensor] | None = None,
) -> tuple[tuple[Diff, ...], tuple[LayerBytes, ...]]:
    """Diffs and per-layer MXFP8 bytes of two runs. weights: Torch-style name -> Torch tensor
    (the values the Torch op used; a placeholder where planes are given); planes: flat weight
    name -> MXFP8Tensor when both stacks ran on these planes (FSDP's), else None."""
    names = _linear_names(cfg)
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
            None if planes is None else planes[w[name]],
        )
        pairs = ((tio.y, y), (tio.dx, dx), (torch_run.grads[w[name]], dw))
        forced = all(_same_bits(a, b) for a, b in pairs)
        if mode is MatmulMode.MXFP8:
            torch_q = (
                planes[w[name]] if planes is not None else _torch_weight_planes(weights[w[name]])
            )
            same_w = _same_bits(_bytes(torch_q), _bytes(flax_run.weight_q[w[name]]))
            layers.append(LayerBytes(name, forced, same_w, x_frac, dy_frac))
        else:
            layers.append(LayerBytes(name, forced, None, None, None))
    diffs += [diff(Quantity.LOGITS, "", torch_run.logits, flax_run.logits)]
    diffs += [diff(Quantity.LOSS, "", torch_run.loss, flax_run.loss)]
    diffs += [diff(Quantity.GRAD, n, g, flax_run.grads[n]) for n, g in torch_run.grads.items()]
    return tuple(diffs), tuple(layers)


def flax_params_view(weights: Mapping[str, torch.Tensor]) -> dict[str, jax.Array]:
    """Torch tensors as JAX arrays over the same memory (``to_jax``, zero-copy)."""
    return {n: to_jax(t.detach()) for n, t in weights.items()}


def parity_report(
    cfg: GPTConfig,
    *,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 40,
    mode: MatmulMode | str = MatmulMode.MXFP8,
    device: str = "cpu",
    batch: Batch | None = None,
) -> ParityReport:
    """Single process, no FSDP: TorchGPT (bridge op) vs FlaxGPT on the Torch parameters.

    device: where the Torch model lives ("cpu" or "cuda"); JAX runs on the same device (the
    bridge op runs its kernels where its tensors are; Flax gets the same buffers).
    batch: explicit (tokens, targets) int (B, S); default ``make_batch(cfg, seed, batch_size,
    seq_len)``.

    Flax initialises from ``seed``; Torch loads that checkpoint; Flax then runs on the Torch
    parameters imported zero-copy, each MXFP8 layer quantizing bf16(weight) exactly as the
    bridge op does.
    """
    mode = MatmulMode.parse(mode)
    batch = _check_batch(cfg, batch) if batch is not None else make_batch(
        cfg, seed, batch_size, seq_len)
    model = TorchGPT(cfg, mode, device=device)
    flat = {n: np.asarray(a) for n, a in flat_params(init_flax_params(cfg, seed)).items()}
    load_flat_params(model, flat)
    tokens, targets = (torch.from_numpy(a).long().to(device) for a in batch)
    torch_run = run_torch(model, tokens, targets)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    shared = flax_params_view(weights)
    zero_copy = tuple(
        ZeroCopy(n, weights[n].data_ptr(), a.unsafe_buffer_pointer()) for n, a in shared.items()
    )
    flax_run = run_flax(cfg, mode, nested_params(shared), batch.tokens, batch.targets)
    diffs, layers = compare(cfg, mode, torch_run, flax_run, weights)
    return ParityReport(cfg, mode, seed, batch.tokens.shape, 1, diffs, layers, zero_copy)


def _fmt(v: float) -> str:
    return f"{v:9.2e}"


def format_report(r: ParityReport) -> str:
    """The report as a fixed-width text table (what ``python -m demos.main`` prints)."""
    c = r.config
    lines = [
        f"Cross-framework parity: TorchGPT (bridge op{', FSDP' if r.world_size > 1 else ''}) "
        f"vs FlaxGPT, matmul mode {r.mode.value}",
        f"config: vocab {c.vocab_size}, layers {c.n_layer}, heads {c.n_head}, d_model "
        f"{c.d_model}, d_ff {c.d_ff} | seed {r.seed} | batch {r.batch_shape} = "
        f"{r.batch_shape[0] * r.batch_shape[1]} tokens | Torch world size {r.world_size}",
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


def parity_on_gathered(
    cfg: GPTConfig,
    seed: int,
    batch: Batch,
    torch_run: TorchRun,
    gathered: Mapping[str, TorchMXFP8Tensor | torch.Tensor],
    master: Mapping[str, np.ndarray],
    world_size: int,
    mode: MatmulMode = MatmulMode.MXFP8,
) -> ParityReport:
    """The sharded report, on one rank: FlaxGPT on what FSDP all-gathered vs the FSDP run.

    gathered: ``FSDPModel.gathered_weights()`` (MXFP8 weights as ``TorchMXFP8Tensor`` with both
    uint8 planes, the rest fp32), imported zero-copy (the report records every data pointer);
    torch_run: the FSDP model's captured run (``torch_side.models.fsdp_twin.run_sharded``);
    master: the full fp32 weights FSDP was loaded with, to check its planes against quantizing
    bf16(master) on one device. mode: HIGH_PRECISION for the control (no MXFP8 groups).
    Call inside the ``gathered_weights`` context.
    """
    planes_t = {n: t for n, t in gathered.items() if isinstance(t, TorchMXFP8Tensor)}
    if (mode is MatmulMode.MXFP8) != bool(planes_t):
        raise ValueError(
            f"parity_on_gathered: mode {mode.value} but FSDP gathered {len(planes_t)} MXFP8 "
            f"weights; wrap the Torch twin built with the same MatmulMode"
        )
    hp = {n: t for n, t in gathered.items() if not isinstance(t, TorchMXFP8Tensor)}
    planes = {n: to_jax_mxfp8(t) for n, t in planes_t.items()}
    # MXFP8 weights: FSDP gathers no high-precision copy; Flax gets a zero slot for dW only.
    slots = {n: torch.zeros(t.shape, dtype=torch.float32) for n, t in planes_t.items()}
    weights = {**hp, **slots}
    shared = flax_params_view(weights)
    zero_copy = [ZeroCopy(n, hp[n].data_ptr(), shared[n].unsafe_buffer_pointer()) for n in hp]
    for n, t in planes_t.items():
        for field in ("rowwise_data", "rowwise_scale", "colwise_data", "colwise_scale"):
            zero_copy.append(ZeroCopy(
                f"{n}:{field}", getattr(t, field).data_ptr(),
                getattr(planes[n], field).unsafe_buffer_pointer(),
            ))
    flax_planes = nested_params(planes) if planes else None
    flax_run = run_flax(cfg, mode, nested_params(shared), batch.tokens, batch.targets,
                        planes=flax_planes)
    diffs, layers = compare(cfg, mode, torch_run, flax_run, weights, planes or None)
    # The planes both stacks used (pointer-equal) must also be the bytes of quantizing the full
    # bf16(master) on one device: FSDP's distributed quantization is exact.
    def single_device(name: str) -> MXFP8Tensor:
        return quantize_weight(jnp.asarray(master[name + ".weight"]))

    if planes:
        layers = tuple(
            lb._replace(weight_identical=lb.weight_identical and _same_bits(
                _bytes(planes[lb.name + ".weight"]), _bytes(single_device(lb.name))))
            for lb in layers
        )
    return ParityReport(
        cfg, mode, seed, batch.tokens.shape, world_size, diffs, layers, tuple(zero_copy)
    )
