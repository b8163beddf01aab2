"""Byte-for-byte comparison of named tensors, and the Flax twin's whole-model loss and gradients.

Used where the Torch side computes what the Flax twin computes with the same functions
(``Compute.UNIT``: ``models.gpt_math`` in both) and the bytes must be equal, not close:
the unit-compute parity report (``unit_report``) and the multi-step replay (``replay``).

- ``Mismatch`` / ``compare_named``: for each name (in a given order), whether the two sides'
  bytes are equal; a differing tensor gets its count of differing elements and max |difference|;
- ``torch_plane_bytes(fsdp, names)`` / ``flax_plane_bytes(params, names)``: the bytes of the
  MXFP8 planes and scales FSDP gathered / ``quantize_weight`` makes of fp32 weights;
- ``flax_loss_and_grads(cfg, mode, activations)``: the jitted ``jax.value_and_grad`` of the mean
  token cross-entropy of ``FlaxGPT`` over its fp32 parameters (flat Torch names), on the CPU or
  the Torch tensors' device (``jax_work_on``). Attention is written out (``fused_attention=False``)
  as in the Torch twin off the GPU.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from apps.parity.report import mxfp8_bytes
from bridge import TorchMXFP8Tensor, to_jax_mxfp8
from common.model_config import GPTConfig
from common.modes import Activations, LinearMode
from jax_side.linear import quantize_weight
from models.flax_gpt import FlaxGPT, cross_entropy, flat_params, nested_params
from torch_side.fsdp.fsdp_model import FSDPModel

__all__ = [
    "Kind",
    "Mismatch",
    "as_numpy",
    "compare_named",
    "flax_loss_and_grads",
    "flax_plane_bytes",
    "torch_plane_bytes",
]


class Kind(enum.Enum):
    """What a compared tensor is, in the order a step produces them."""

    LOSS = "loss"
    GRAD = "grad"  # a parameter's (reduced) gradient
    MAIN = "main"  # an fp32 main weight after the optimizer step
    EXP_AVG = "exp_avg"  # AdamW's first moment after the step
    EXP_AVG_SQ = "exp_avg_sq"  # its second moment
    PLANES = "planes"  # an MXFP8 weight's planes and scales (both planes), after the step


class Mismatch(NamedTuple):
    """One tensor whose bytes differ between the two stacks."""

    kind: Kind
    name: str  # parameter name ("" for the loss)
    differing: int  # elements (bytes for planes) that differ
    total: int
    max_abs: float  # max |torch - flax| (fp32 tensors; 0 for planes)

    def describe(self) -> str:
        what = f"{self.kind.value} {self.name}".strip()
        unit = "bytes" if self.kind is Kind.PLANES else "elements"
        text = f"{what}: {self.differing}/{self.total} {unit} differ"
        return text + (f", max |diff| {self.max_abs:.3e}" if self.kind is not Kind.PLANES else "")


def as_numpy(a: torch.Tensor | jax.Array | np.ndarray) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _mismatch(kind: Kind, name: str, t: np.ndarray, f: np.ndarray) -> Mismatch | None:
    if t.shape != f.shape or t.dtype != f.dtype:
        raise ValueError(
            f"compare {kind.value} {name!r}: Torch has {t.dtype}{t.shape}, Flax "
            f"{f.dtype}{f.shape}; the two stacks must produce the same tensors")
    tb: np.ndarray = t.reshape(-1).view(np.uint8)
    fb: np.ndarray = f.reshape(-1).view(np.uint8)
    if np.array_equal(tb, fb):
        return None
    if t.dtype == np.uint8:
        return Mismatch(kind, name, int(np.sum(tb != fb)), tb.size, 0.0)
    diff = t.reshape(-1).view(np.uint32) != f.reshape(-1).view(np.uint32)
    d = np.abs(t.astype(np.float64) - f.astype(np.float64))
    return Mismatch(kind, name, int(diff.sum()), t.size, float(np.nanmax(d, initial=0.0)))


def compare_named(kind: Kind, torch_side: Mapping, flax_side: Mapping,
                  names: Iterable[str] | None = None) -> list[Mismatch]:
    """The mismatches among ``names`` (default: Torch's names, in order), each side's value an
    array-like of the same dtype and shape (fp32, or uint8 for planes)."""
    names = list(torch_side) if names is None else list(names)
    missing = sorted(set(names) - set(flax_side))
    if missing:
        raise KeyError(f"compare {kind.value}: the Flax side has no {missing}")
    out = []
    for n in names:
        m = _mismatch(kind, n, as_numpy(torch_side[n]), as_numpy(flax_side[n]))
        if m is not None:
            out.append(m)
    return out


@functools.lru_cache(maxsize=8)
def flax_loss_and_grads(
    cfg: GPTConfig, mode: LinearMode, activations: Activations
) -> Callable[[Mapping[str, jax.Array], np.ndarray, np.ndarray],
              tuple[jax.Array, dict[str, jax.Array]]]:
    """``fn(flat_params, tokens, targets) -> (loss, flat_grads)``: the Flax twin's mean token loss
    and ``jax.value_and_grad`` over every parameter, one jitted program (flat Torch names)."""
    model = FlaxGPT(cfg, mode, activations=activations, fused_attention=False)

    @jax.jit
    def value_and_grad(flat, tokens, targets):
        with jax.numpy_dtype_promotion("standard"):  # attention's backward rule (unit_program)
            loss, grads = jax.value_and_grad(
                lambda p: cross_entropy(model.apply({"params": p}, tokens), targets)
            )(nested_params(flat))
        return loss, flat_params(grads)

    def run(flat: Mapping[str, jax.Array], tokens: np.ndarray,
            targets: np.ndarray) -> tuple[jax.Array, dict[str, jax.Array]]:
        return value_and_grad(dict(flat), jnp.asarray(tokens, jnp.int32),
                              jnp.asarray(targets, jnp.int32))

    return run


def torch_plane_bytes(fsdp: FSDPModel, names: Iterable[str]) -> dict[str, np.ndarray]:
    """COLLECTIVE: the bytes of every MXFP8 weight's gathered planes and scales (copies)."""
    with fsdp.gathered_weights() as gathered:
        return {n: np.array(mxfp8_bytes(to_jax_mxfp8(gathered[n]))) for n in names
                if isinstance(gathered[n], TorchMXFP8Tensor)}


def flax_plane_bytes(params: Mapping[str, jax.Array],
                     names: Iterable[str]) -> dict[str, np.ndarray]:
    """The same bytes from ``quantize_weight`` (bf16, both planes) of fp32 weights."""
    return {n: np.array(mxfp8_bytes(quantize_weight(params[n]))) for n in names}
